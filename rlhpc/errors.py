"""User-facing errors: each names the problem and the fix, and is printed as one message."""


class RlhpcError(Exception):
    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}\n  fix: {fix}")
        self.problem = problem
        self.fix = fix


class ConfigError(RlhpcError):
    """Bad configuration or command-line input, found before anything is submitted."""


class RunDirError(RlhpcError):
    """The run directory cannot be used as asked (unwritable, holds another run, ...)."""
