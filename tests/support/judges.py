"""A judge_parse for tests: the tiny random judge never writes a number, so the built-in parse
would score every sample 0; the answer's length varies from sample to sample."""


def length(text: str) -> float:
    return float(len(text))
