"""A reward for the ``code`` task that also puts hostile code through the job's sandbox: each
rollout, sample 0's sandbox is SIGKILLed from outside mid-execution, samples 1-6 are replaced by
attacks (the network, the run dir's engine key, the job's environment, a fork bomb, a full disk,
a sleep past the wall limit), each scored 1.0 only if it got what it tried for, and the rest are
the model's own answers, scored by the task's reward. A job names it as
``data.reward: support.sandboxed:contained`` with ``$RLHPC_TEST_RUN_DIR`` its run dir."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

from rlhpc import sandbox
from rlhpc.data import code
from rlhpc.rollout.scoring import batched

RUN_ENV = "RLHPC_TEST_RUN_DIR"
LEAK = "LEAK"


def attacks(run: str) -> list[str]:
    key = os.path.join(run, "engine_key")
    return [
        f"import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint({LEAK!r})",
        f"print({LEAK!r}, open({key!r}).read())",
        f"import os\nprint({LEAK!r} if [k for k in os.environ if 'RLHPC' in k or 'KEY' in k] else 'clean')",
        "import os\nwhile True:\n    os.fork()",
        "n = 0\ntry:\n    with open('/tmp/fill', 'wb') as f:\n        while True:\n"
        f"            f.write(b'x' * 65536)\n            n += 1\nexcept OSError:\n    pass\nprint({LEAK!r} if n > 2048 else 'held')",
        f"import time\ntime.sleep(10 ** 6)\nprint({LEAK!r})",
    ]


def kill_when_running(pool: sandbox.SandboxPool) -> threading.Thread:
    """SIGKILL from outside the sandbox of ``pool`` that runs code (its worker has forked the
    execution's child), as the node's OOM killer or an administrator would. Only that one: an
    idle sandbox killed too could still look alive to the next execution, which would then be
    lost as well (a second infrastructure failure where the test counts one)."""

    def descendants(pid: int) -> int:
        try:
            return len(psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            return 0

    def running() -> list[int]:
        return [pid for pid in pool.pids() if descendants(pid) >= 2]

    def kill() -> None:
        while not (pids := running()):
            time.sleep(0.02)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _killed_from_outside() -> object:
    pool = sandbox.pool()
    kill_when_running(pool)
    result = pool.run("import time\ntime.sleep(3)\nprint('finished')")
    return result.failure() if result.infra else float(result.ok)


@batched
def contained(samples: list) -> list:
    out: list = [_killed_from_outside()]
    for program in attacks(os.environ[RUN_ENV]):
        result = sandbox.pool().run(program)
        out.append(result.failure() if result.infra else float(LEAK in result.stdout))
    return out + code.reward(samples[len(out) :])
