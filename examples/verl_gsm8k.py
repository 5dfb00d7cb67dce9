"""A verl GSM8K job's own code, as a verl user brings it (docs/guides/coming-from-verl.md).

- ``compute_score``: verl's reward signature, unchanged. rlhpc tells it by its parameter names
  and calls it with the row's ``data_source`` and ``extra_info`` columns, the response and the
  label (``data.label_key: reward_model.ground_truth``).
- ``GSM8KEnv``: an environment (``rollout.env``) that reads verl's columns as the file has them:
  the chat in ``prompt``, the answer in ``reward_model.ground_truth``. A reply without a final
  answer after "####" is asked once more for one.
"""

from __future__ import annotations

import re

_FINAL = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def final_answer(text: str) -> str | None:
    """The number after the last "####", commas dropped; None without one."""
    found = _FINAL.findall(text)
    return found[-1].replace(",", "") if found else None


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    if data_source != "openai/gsm8k":
        raise NotImplementedError(f"no scorer for data_source {data_source!r}")
    return 1.0 if final_answer(solution_str) == ground_truth else 0.0


class GSM8KEnv:
    def reset(self, row) -> list[dict]:  # row: the file's row as it is (rlhpc.data.rows.Row)
        self.truth, self.asked = row["reward_model"]["ground_truth"], False
        return list(row["prompt"])  # verl's prompt column: the chat messages

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        answer = final_answer(reply)
        if answer is None and not self.asked:
            self.asked = True
            return [{"role": "user", "content": 'Give the final answer after "####".'}], 0.0, False
        score = 1.0 if answer == self.truth else 0.0
        return [], score * (0.5 if self.asked else 1.0), True  # less for the answer asked for
