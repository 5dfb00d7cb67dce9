"""User-facing errors: each names the problem and the fix, and is printed as one message."""


class RlhpcError(Exception):
    # Most named problems (config, cluster state) come back after a requeue; a transient one
    # (a hung rank) may not, so the job requeues on it as on a crash (checkpoint.requeue_on_failure).
    transient = False

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}\n  fix: {fix}")
        self.problem = problem
        self.fix = fix

    def __reduce__(self) -> tuple:
        # Pickle by state, not by constructor arguments: raised inside a Ray actor, the error
        # must cross to the driver whatever a subclass's __init__ takes.
        return _rebuild, (type(self), str(self), self.__dict__)


def _rebuild(cls: type[RlhpcError], message: str, state: dict) -> RlhpcError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class ConfigError(RlhpcError):
    """Bad configuration or command-line input, found before anything is submitted."""


class RunDirError(RlhpcError):
    """The run directory cannot be used as asked (unwritable, holds another run, ...)."""


class WeightPushFailed(RlhpcError):
    """Pushing weights to the engines failed on their side (an engine died or refused a bucket)."""

    def __init__(self, version: int, reason: str):
        super().__init__(
            f"pushing weight version {version} to the engines failed: {reason}",
            "see the engine logs (RUN_DIR/logs/engines/); engines that died are restarted and the push repeated",
        )
        self.version = version


class StoppedByUser(RlhpcError):
    """A local job stopped at its next safe point because its submitter was interrupted (Ctrl-C)."""
