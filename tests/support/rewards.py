"""A reward as a user moving from verl writes it: one ``Sample``, the row's metadata read, a dict
returned (``data.reward: support.rewards:graded``)."""

from rlhpc.rewards import exact


def graded(sample) -> dict:
    return {
        "score": exact(sample.prompt, sample.response, sample.label),
        "from_metadata": float(sample.metadata.get("data_source") == "toy"),  # the row's own field
        "chat": float(sample.messages is not None and sample.messages[0]["role"] == "user"),
        "stopped": float(sample.finish_reason in ("stop", "length")),
    }


def spread(prompt: str, response: str, answer: str) -> float:
    """A reward that differs between almost any two responses, so every group has advantages:
    for checks of the loss itself, which a group of equal rewards leaves at zero."""
    return sum(map(ord, response)) % 11 / 10
