"""Complete examples of the three ways into multi-turn rollouts (docs/guides/multi-turn.md)."""
