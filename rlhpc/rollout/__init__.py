"""The rollout side of the driver: the engine pool, one generation step, episodes, generate
functions and agents (with the agent's OpenAI endpoint), tools, scoring, and the frozen reward
model, judge and teacher. Engines are reached over ``rlhpc.wire``; weights through ``rlhpc.weights``."""
