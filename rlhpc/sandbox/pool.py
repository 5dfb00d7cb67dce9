"""A pool of warm sandboxes on this node, and what an execution's outcome means.

``SandboxPool.run(code)`` takes an idle sandbox (starting one if the pool has room), sends it
the code, and classifies the answer (``Result.status``):

- the code's own outcome, a reward: ``ok`` (exit status 0), ``error`` (any other exit status:
  an exception, a failed assert, ``MemoryError`` at the memory limit), ``timeout`` (still
  running at ``sandbox.wall_s``, having had the CPU it asked for), ``cpu_limit`` (killed at
  ``sandbox.cpu_s`` of CPU time), ``crashed`` (killed by another signal: a segfault, an abort,
  the file-size limit);
- infrastructure, never a reward: ``start_failed`` (the sandbox did not start), ``lost`` (it
  died or went silent mid-execution: killed from outside, the node's OOM killer, a worker
  fault), ``overloaded`` (timed out while its processes waited for a CPU longer than
  ``sandbox.overload_share`` of the wall limit and ran less than that: the node starved it),
  ``killed`` (the code's process got a SIGKILL that neither a limit nor the time-out sent).

An infrastructure outcome is run again, in a fresh sandbox, up to ``sandbox.retries`` times
(safe: an execution has no state and no network). ``killed`` is the one ambiguous case (the
node's OOM killer, an administrator, or the code killing itself): killed again on the retry,
it is taken as the code's own (``crashed``); with no retry left it stays infrastructure.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from rlhpc.errors import InfrastructureFailure, RlhpcError
from rlhpc.sandbox import backends

if TYPE_CHECKING:
    from rlhpc.config import SandboxConfig

log = logging.getLogger(__name__)

Lang = Literal["python", "bash"]
INFRA = frozenset({"start_failed", "lost", "overloaded", "killed"})
_HEADER = struct.Struct(">I")
START_TIMEOUT_S = 60.0  # a sandbox not ready by then did not start (a loaded node starts one in well under a second)


@dataclass(frozen=True)
class Result:
    """One execution's outcome (module doc for ``status``)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0  # every process of the code
    waited_s: float = 0.0  # at a time-out: the code's time runnable without a CPU
    truncated: bool = False  # stdout or stderr past sandbox.output_kb, cut
    attempts: int = 1
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def infra(self) -> bool:
        return self.status in INFRA

    def failure(self) -> InfrastructureFailure:
        return InfrastructureFailure(f"the sandbox {self.status} after {self.attempts} attempt(s): {self.detail}")


@dataclass(frozen=True)
class Job:
    """One execution to run: the code, its language, its stdin and files beside it."""

    code: str
    lang: Lang = "python"
    stdin: str = ""
    files: tuple[tuple[str, str], ...] = ()


def classify(answer: dict, cfg: SandboxConfig) -> tuple[str, str]:
    """(status, detail) of a worker's answer (module doc)."""
    if "worker_error" in answer:
        return "lost", f"the sandbox's worker failed: {answer['worker_error']}"
    if answer["timed_out"]:
        budget = cfg.overload_share * cfg.wall_s
        said = f"{answer['waited_s']:.1f} s waiting for a CPU, {answer['cpu_s']:.1f} s on one"
        if answer["waited_s"] > budget and answer["cpu_s"] < budget:
            return "overloaded", f"timed out at {cfg.wall_s:g} s starved by the node ({said})"
        return "timeout", f"still running after {cfg.wall_s:g} s ({said})"
    sig = answer["signal"]
    if sig is None:
        code = answer["exit_code"]
        return ("ok", "") if code == 0 else ("error", f"exit status {code}")
    cpu_limit = math.ceil(cfg.cpu_s)
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and answer["child_cpu_s"] >= cpu_limit - 0.05):
        return "cpu_limit", f"killed at the CPU limit of {cpu_limit} s"
    name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
    if sig == signal.SIGKILL:
        return "killed", f"killed by {name}, which no limit sent"
    if sig == signal.SIGXFSZ:
        return "crashed", f"{name}: a file past sandbox.disk_mb"
    return "crashed", f"killed by {name}"


def _read(fd: int, n: int, deadline: float) -> bytes | None:
    """``n`` bytes from ``fd`` by ``deadline``; None at end of file or past the deadline."""
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class _Spawner:
    """Starts every sandbox from one thread that lives as long as the process: a sandbox ends
    with the thread that started it (bwrap's --die-with-parent and the worker's own use Linux's
    parent-death signal, which follows the starting thread, not the process), and sandboxes are
    started from short-lived threads (a tool call's, a reward's)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _serve(self) -> None:
        while True:
            args, kwargs, done = self._jobs.get()
            try:
                done.append(subprocess.Popen(*args, **kwargs))
            except BaseException as e:
                done.append(e)
            done[0].set()

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="sandbox-spawner", daemon=True)
                self._thread.start()
        done: list = [threading.Event()]
        self._jobs.put((args, kwargs, done))
        done[0].wait()
        if isinstance(done[1], BaseException):
            raise done[1]
        return done[1]


_spawner = _Spawner()


class Sandbox:
    """One warm sandbox: its worker process, started at construction (``ready`` waits for it)."""

    def __init__(self, argv: list[str], tmp: str | None, name: str):
        self.name, self.tmp = name, tmp
        # What the backend prints when it cannot start goes to a file, read back for the error.
        self.errors = tempfile.TemporaryFile(prefix="rlhpc-sandbox-")
        self.proc = _spawner.popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors, close_fds=True,
            start_new_session=True,
        )  # fmt: skip
        self.info: dict = {}

    def said(self) -> str:
        self.errors.seek(0)
        return self.errors.read().decode(errors="replace").strip()[-2000:]

    def _message(self, deadline: float) -> dict | None:
        fd = self.proc.stdout.fileno()
        head = _read(fd, _HEADER.size, deadline)
        body = _read(fd, _HEADER.unpack(head)[0], deadline) if head else None
        return json.loads(body) if body else None

    def ready(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        message = self._message(time.monotonic() + timeout_s)
        if message is None or not message.get("ready"):
            return False
        self.info = message
        return True

    def execute(self, request: dict, timeout_s: float) -> dict | None:
        """The worker's answer, or None: it died, or gave none within ``timeout_s``."""
        body = json.dumps(request).encode()
        try:
            self.proc.stdin.write(_HEADER.pack(len(body)) + body)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self._message(time.monotonic() + timeout_s)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.errors):
            try:
                f.close()
            except OSError:
                pass
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


class SandboxPool:
    """``sandbox.pool_size`` warm sandboxes, each running one execution at a time. Thread-safe:
    ``run`` blocks until a sandbox is free. Sandboxes start on first use (``start`` starts them
    all at once) and a dead one is replaced by a fresh one."""

    def __init__(self, cfg: SandboxConfig):
        self.cfg = cfg
        self._source = backends.worker_source()
        # a slot per sandbox: a live one, or None (started when taken)
        self._slots: queue.SimpleQueue[Sandbox | None] = queue.SimpleQueue()
        for _ in range(cfg.pool_size):
            self._slots.put(None)
        self._lock = threading.Lock()
        self._live: set[Sandbox] = set()
        self._started = 0
        self._ever_ready = False
        self.counts: Counter[str] = Counter()  # outcomes by status, "retries", "starts"
        self._closed = False

    # ------------------------------------------------------------ sandboxes

    def _argv(self) -> tuple[list[str], str | None]:
        cfg = self.cfg
        if cfg.backend == "bwrap":
            return backends.bwrap_command(cfg, self._source), None
        if cfg.backend == "apptainer":
            return backends.apptainer_command(cfg, self._source, backends.apptainer_binary() or "apptainer"), None
        tmp = tempfile.mkdtemp(prefix="rlhpc-sandbox-tmp-")
        return backends.subprocess_command(cfg, self._source, tmp), tmp

    def _start_one(self) -> Sandbox | str:
        """A ready sandbox, or what it said when it did not start."""
        with self._lock:
            self._started += 1
            name = f"sandbox-{self._started}"
        argv, tmp = self._argv()
        try:
            box = Sandbox(argv, tmp, name)
        except OSError as e:  # the backend's binary itself
            return f"{argv[0]} could not be started: {e}"
        if box.ready():
            with self._lock:
                self._live.add(box)
                self._ever_ready = True
            self._count("starts")
            return box
        said = box.said() or f"exit status {box.proc.poll()}"
        box.close()
        return said

    def start(self) -> None:
        """Start every sandbox of the pool at once and wait for them; the first start of a pool
        that fails is this node's or the config's problem, raised as such."""
        backends.check(self.cfg)
        taken = [self._slots.get() for _ in range(self.cfg.pool_size)]
        with ThreadPoolExecutor(len(taken)) as ex:
            started = list(ex.map(lambda box: box if box is not None else self._start_one(), taken))
        boxes = [b for b in started if isinstance(b, Sandbox)]
        for b in started:
            self._slots.put(b if isinstance(b, Sandbox) else None)
        if not boxes:
            said = next(s for s in started if isinstance(s, str))
            raise RlhpcError(
                f"no sandbox started on this node (sandbox.backend = {self.cfg.backend!r}): {said}",
                backends.start_problem(self.cfg, said),
            )
        if len(boxes) < len(started):
            log.warning(
                "%d of %d sandboxes did not start; they are tried again when needed",
                len(started) - len(boxes),
                len(started),
            )

    def _count(self, what: str) -> None:
        with self._lock:  # executions finish on many threads at once
            self.counts[what] += 1

    def _drop(self, box: Sandbox) -> None:
        with self._lock:
            self._live.discard(box)
        box.close()

    # ------------------------------------------------------------ executions

    def _request(self, job: Job) -> dict:
        c = self.cfg
        limits = {
            "wall_s": c.wall_s, "cpu_s": c.cpu_s, "memory_mb": c.memory_mb, "processes": c.processes,
            "disk_mb": c.disk_mb, "output_kb": c.output_kb,
        }  # fmt: skip
        return {"lang": job.lang, "code": job.code, "stdin": job.stdin, "files": dict(job.files), "limits": limits}

    def _once(self, job: Job) -> Result:
        box = self._slots.get()
        try:
            if box is None or not box.alive:
                if box is not None:
                    self._drop(box)
                box = self._start_one()
                if isinstance(box, str):
                    if not self._ever_ready:  # no sandbox ever started here: not a passing fault
                        raise RlhpcError(
                            f"no sandbox started on this node (sandbox.backend = {self.cfg.backend!r}): {box}",
                            backends.start_problem(self.cfg, box),
                        )
                    detail, box = f"a fresh sandbox did not start: {box}", None
                    return Result("start_failed", detail=detail)
            # The worker answers once the wall limit has passed and the code is killed; a worker
            # silent well past that is hung or starved itself.
            answer = box.execute(self._request(job), 2 * self.cfg.wall_s + 30)
            if answer is None:
                said = box.said()
                self._drop(box)
                box = None
                return Result(
                    "lost", detail="the sandbox died or went silent mid-execution" + (f": {said}" if said else "")
                )
            status, detail = classify(answer, self.cfg)
            return Result(
                status, answer["stdout"], answer["stderr"], answer.get("exit_code"), answer.get("signal"),
                answer["wall_s"], answer["cpu_s"], answer["waited_s"], answer["truncated"], detail=detail,
            )  # fmt: skip
        finally:
            self._slots.put(box if box is not None and box.alive else None)

    def run(self, code: str, lang: Lang = "python", stdin: str = "", files: dict[str, str] | None = None) -> Result:
        """Run ``code`` (Python source, or a bash script) in a sandbox, ``stdin`` on its standard
        input and ``files`` (name -> text) in its working directory; an infrastructure outcome is
        retried (module doc)."""
        return self.run_job(Job(code, lang, stdin, tuple(sorted((files or {}).items()))))

    def run_job(self, job: Job) -> Result:
        if self._closed:
            raise RlhpcError("the sandbox pool was closed", "this is a bug: report it")
        previous: Result | None = None
        attempt = 0
        while True:
            attempt += 1
            result = self._once(job)
            if result.status == "killed" and previous is not None and previous.status == "killed":
                result = replace(result, status="crashed", detail=f"{result.detail}, on a retry too: the code's own")
            if not result.infra or attempt > self.cfg.retries:
                break
            log.warning("sandbox execution %s (%s): running it again in a fresh sandbox", result.status, result.detail)
            self._count("retries")
            previous = result
        self._count(result.status)
        return replace(result, attempts=attempt)

    def run_all(self, jobs: Sequence[Job]) -> list[Result]:
        """Every job, ``sandbox.pool_size`` at once, in order."""
        if not jobs:
            return []
        with ThreadPoolExecutor(min(self.cfg.pool_size, len(jobs)), thread_name_prefix="sandbox") as ex:
            return list(ex.map(self.run_job, jobs))

    def pids(self) -> list[int]:
        """The host pids of the live sandboxes' outermost processes (tests, the benchmark)."""
        with self._lock:
            return [b.proc.pid for b in self._live if b.alive]

    def close(self) -> None:
        self._closed = True
        with self._lock:
            boxes, self._live = list(self._live), set()
        for b in boxes:
            b.close()


_pool: SandboxPool | None = None
_settings: SandboxConfig | None = None
_pool_lock = threading.Lock()


def configure(cfg: SandboxConfig) -> None:
    """Use ``cfg`` (the run's ``sandbox`` section) for this process's pool from now on; a pool
    started with other settings is closed."""
    global _pool, _settings
    with _pool_lock:
        if _pool is not None and _pool.cfg != cfg:
            _pool.close()
            _pool = None
        _settings = cfg


def pool() -> SandboxPool:
    """This process's pool, started on first use with the configured settings (the defaults of
    the ``sandbox`` section if none were given)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            from rlhpc.config import SandboxConfig

            _pool = SandboxPool(_settings or SandboxConfig())
            _pool.start()
        return _pool


def close() -> None:
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.close()
            _pool = None


def stats() -> dict[str, Any]:
    """The outcomes counted so far by this process's pool (empty without one)."""
    return dict(_pool.counts) if _pool is not None else {}
