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


class UserCodeError(RlhpcError):
    """The user's own code (a reward, environment, tool parser, generate function, agent or
    sampling filter) raised. The job stops at once, local or on Slurm, and is not requeued: a new
    start would run the same code on the same sample and fail the same way (a grader elsewhere,
    reached over the network, is an outside service and keeps its restarts)."""


def user_code_error(what: str, error: BaseException, on: str, fix: str | None = None) -> UserCodeError:
    """One error for user code ``what`` (e.g. ``the reward my_mod:fn``) that raised ``error`` on
    ``on`` (the sample or row): the exception, where, and the traceback's last frame, chained to
    ``error`` so the whole traceback is logged too."""
    said = " ".join(str(error).split())  # one line: the run's ended file and the status show it
    said = said if len(said) <= 300 else said[:300] + "..."
    problem = f"{what} raised {type(error).__name__}{': ' + said if said else ''} on {on}{_last_frame(error)}"
    err = UserCodeError(problem, fix or "fix that code (the traceback logged above this error shows where it raised)")
    err.__cause__ = error
    return err


def _last_frame(error: BaseException) -> str:
    """`` (at FILE:LINE in FUNCTION `CODE`)`` of the innermost frame of ``error``'s traceback; for
    an error raised in a worker process (``data.reward_workers``), of the traceback it sent."""
    import re
    import traceback

    remote = error.__cause__
    if type(remote).__name__ == "RemoteTraceback":  # multiprocessing's: the worker's traceback as text
        found = re.findall(r'File "(.*)", line (\d+), in (.*)\n\s*(.*)', str(remote))
        if found:
            name, line, fn, code = found[-1]
            return f" (at {name}:{line} in {fn}{f' `{code.strip()}`' if code.strip() else ''})"
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    code = f" `{f.line.strip()}`" if f.line else ""
    return f" (at {f.filename}:{f.lineno} in {f.name}{code})"


class InfrastructureFailure(Exception):
    """Something around the sample failed, not the sample: a sandbox that could not start, was
    killed from outside, or was starved by an overloaded node (``rlhpc.sandbox``). A reward that
    raises it (or returns it, from a batched reward) leaves its sample unscored, and a tool that
    raises it ends its episode unscored: the sample is masked out of the loss and out of its
    group's baseline and counted (``infra/failed``), never scored 0. Not an ``RlhpcError``: the
    run goes on."""
