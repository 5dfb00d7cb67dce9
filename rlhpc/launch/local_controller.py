"""submitit's local job controller, allowed as many starts as rlhpc's restart policy needs.

submitit's LocalExecutor starts ``python -m submitit.local._local``, whose controller starts
a task that asks for a restart (exit 144) at most 6 times, whatever ``checkpoint.max_restarts``
says; the job then ends without a result. Here the same controller runs with the number of
starts given (``max_restarts`` + 2: the first start, the restarts, and one more that rlhpc's
own policy refuses, so rlhpc, not the controller, decides when a local job stops).

    python -m rlhpc.launch.local_controller SUBMITIT_FOLDER MAX_STARTS
"""

from __future__ import annotations

import sys
from pathlib import Path

from submitit.local.local import Controller


def main(argv: list[str]) -> None:
    folder, max_starts = argv
    Controller(Path(folder)).run(max_retry=int(max_starts))


if __name__ == "__main__":
    main(sys.argv[1:])
