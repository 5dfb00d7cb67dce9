"""A reward as a user moving from verl writes it: one ``Sample``, the row's own column read, a
dict returned (``data.reward: support.rewards:graded``)."""

from rlhpc.rewards import exact


def graded(sample) -> dict:
    return {
        "score": exact(sample.prompt, sample.response, sample.label),
        "from_metadata": float(sample.row.get("data_source") == "toy"),  # the row's own column
        "chat": float(sample.messages is not None and sample.messages[0]["role"] == "user"),
        "stopped": float(sample.finish_reason in ("stop", "length")),
    }
