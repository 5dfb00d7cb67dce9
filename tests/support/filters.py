"""Dynamic-sampling filters for tests, imported by path as a user's would be (``support.filters:NAME``)."""

from rlhpc.data.dynamic_sampling import Group


def even_answer(group: Group) -> bool:
    """Keep prompts whose answer is even: which groups pass is known before anything is generated."""
    return int(group.answer) % 2 == 0


def keep_all(group: Group) -> bool:
    return True


def length_parity(prompt: str, response: str, answer: str) -> float:
    """A reward (``data.reward``) that differs between samples of one prompt, so some groups pass
    ``nonzero_std`` and some do not, even with an untrained model."""
    return float(len(response) % 2)
