"""submitit's local job controller, allowed as many starts as rlhpc's restart policy needs.

submitit's LocalExecutor starts ``python -m submitit.local._local``, whose controller starts
a task that asks for a restart (exit 144) at most 6 times, whatever ``checkpoint.max_restarts``
says; the job then ends without a result. Here the same controller runs with the number of
starts given (``max_restarts`` + 2: the first start, the restarts, and one more that rlhpc's
own policy refuses, so rlhpc, not the controller, decides when a local job stops).

    python -m rlhpc.launch.local_controller SUBMITIT_FOLDER MAX_STARTS
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE, Controller


class StoppableController(Controller):
    """SIGTERM (``kill PID``, as a refused submission says to stop a local job) stops the job for
    good: the task gets it, saves at its next safe point and asks for a restart, which is not
    given (submitit's controller would start it again). A SIGKILL of the controller takes the
    task with it (``TrainJob.run``)."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self.stopping = False
        signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, signum: int, *args: object) -> None:
        self.stopping = True
        self._forward_signal(signum)

    def start_tasks(self) -> None:
        super().start_tasks()
        if self.stopping:  # the SIGTERM came before there was a task to pass it to
            self._forward_signal(signal.SIGTERM)

    def wait(self, freq: int = 24) -> list[int | None]:
        codes = list(super().wait(freq))
        return [0 if self.stopping and c == LOCAL_REQUEUE_RETURN_CODE else c for c in codes]


def main(argv: list[str]) -> None:
    folder, max_starts = argv
    StoppableController(Path(folder)).run(max_retry=int(max_starts))


if __name__ == "__main__":
    main(sys.argv[1:])
