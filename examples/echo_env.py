"""An environment (``rollout.env: examples.echo_env:EchoEnv``): the model must repeat a number.

The episode asks for the row's label back (``row.label``: the file's ``answer`` column, or
verl's ``reward_model.ground_truth``, wherever ``data.label_key`` points); a reply without it
gets a hint and another turn, up to ``rollout.max_turns``. Reward: 1 for the turn that repeats
it, less the later it comes.
"""

from __future__ import annotations


class EchoEnv:
    def reset(self, row) -> list[dict]:  # row: rlhpc.data.rows.Row, the file's row as it is
        self.want, self.turns = row.label, 0
        return [{"role": "user", "content": f"Say {self.want}."}]

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        self.turns += 1
        if self.want in reply:
            return [], 1.0 / self.turns, True
        return [{"role": "user", "content": f"No: say only {self.want}."}], 0.0, False
