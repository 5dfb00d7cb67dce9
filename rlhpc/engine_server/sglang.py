"""Command lines and start-up of SGLang servers (``rollout.backend: sglang``) and of sglang_router.

Flag names follow SGLang's ``python/sglang/srt/server_args.py`` (``ServerArgs``: a field
``tp_size`` is the flag ``--tp-size``) and sglang_router's ``router_args.py``. Everything here is
a small pure function except ``start_on_free_port``, which runs the process.

Ports: SGLang takes a fixed ``--port`` (no port 0 + ready file as the CPU server does), so a free
port is picked and, if the server dies during start-up because the port was taken in between,
another one is picked (a bounded number of times). Its internal NCCL port is passed explicitly
(``--nccl-port``), also picked free, so two engines on one node never pick the same one.

The engine key (``rlhpc.wire.engine_key``): SGLang takes ``--api-key`` only as a server
argument, and reads its server arguments also from a YAML ``--config`` file, so the key goes
there (a 0600 file), not onto the command line. SGLang then requires ``Authorization: Bearer KEY``
on every route except /health*, /ready* and /metrics* (probes), and logs its server arguments,
key included, at start-up: its output reaches the log through ``_RedactingPump``, which
replaces the key. sglang_router takes the key only as ``--api-key KEY``; ``rlhpc.engine_server.router_main``
reads it from the file and hands it over inside the process, so no command line carries it. The
router then requires the key of its own clients too, and sends it on its calls to the engines.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlhpc.errors import RlhpcError
from rlhpc.util.net import http_url
from rlhpc.util.processes import python_command, stop_group
from rlhpc.util.secrets import write_secret
from rlhpc.wire import switches
from rlhpc.wire.client import EngineClient
from rlhpc.wire.engine_key import read_key
from rlhpc.wire.lora import LoraServing
from rlhpc.wire.protocol import FP8_QUANTIZATION, QUANTIZATION_FLAG, ROUTED_EXPERTS_FLAG

log = logging.getLogger(__name__)

SERVER_MODULE = "sglang.launch_server"
ROUTER_MODULE = "sglang_router.launch_router"
ROUTER_MAIN = "rlhpc.engine_server.router_main"  # sglang_router with the key read from a file
PORT_ATTEMPTS = 5  # starts on fresh ports before giving up on address-in-use failures

# What a server prints when a port it was given is taken: uvicorn's bind error (errno 98),
# SGLang's wait_port_available ("... at PORT is not available in N seconds"), ZMQ's EADDRINUSE.
_ADDRESS_IN_USE = re.compile(
    r"address already in use|EADDRINUSE|\[Errno 98\]|is not available in \d+ seconds|is used by a process already",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class SGLangSpec:
    """One SGLang server process: an engine, or its share on one node when it spans nodes."""

    tp_size: int  # GPUs of the whole engine (cluster.rollout_gpus_per_engine)
    mem_fraction_static: float
    memory_saver: bool  # release/resume_memory_occupation need --enable-memory-saver
    seed: int
    gpu_ids: tuple[int, ...] = ()  # this node's GPUs of the engine (Ray's ids); () = the actor's own
    extra_args: tuple[str, ...] = ()
    nnodes: int = 1
    node_rank: int = 0  # only node rank 0 serves HTTP
    deterministic: bool = False  # `deterministic: true`: --enable-deterministic-inference (seeds honoured)
    colocated: bool = False  # its GPUs are shared with actor ranks (cluster.colocate)
    lora: LoraServing | None = None  # serve LoRA adapters (the CPU engine takes the same flags)
    routed_experts: bool = False  # algo.routing_replay: --enable-return-routed-experts

    @property
    def serves_http(self) -> bool:
        return self.node_rank == 0


def require_module(module: str, what: str, fix: str = "") -> None:
    """Fail with the fix when ``module`` is not importable in this (the job's) Python."""
    if importlib.util.find_spec(module) is None:
        raise RlhpcError(
            f"rollout.backend: sglang needs {what}, but `{module}` cannot be imported by {sys.executable}",
            fix
            or "install the GPU extras into the job's environment: pip install 'rlhpc[gpu]' "
            "(or set rollout.backend: cpu)",
        )


def quant_method(model_path: str) -> str | None:
    """The quantization a checkpoint's config.json names (None: none, or no config.json to read)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return (config.get("quantization_config") or {}).get("quant_method")


def launch_server_command(
    python: str,
    model_path: str,
    host: str,
    port: int,
    nccl_port: int,
    spec: SGLangSpec,
    dist_init_addr: str | None = None,
    config_file: Path | None = None,
) -> list[str]:
    """``python -m sglang.launch_server ...`` for one engine (or one node's part of it).

    ``config_file``: SGLang's ``--config`` YAML holding the engine key (``write_key_config``)."""
    cmd = [
        *python_command("-m", SERVER_MODULE, python=python),
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--nccl-port", str(nccl_port),
        "--tp-size", str(spec.tp_size),
        "--mem-fraction-static", str(spec.mem_fraction_static),
        "--random-seed", str(spec.seed),
        "--base-gpu-id", "0",  # CUDA_VISIBLE_DEVICES holds exactly this engine's GPUs (server_env)
    ]  # fmt: skip
    if quant_method(model_path) == FP8_QUANTIZATION:
        # rollout.quantization: fp8 (the run's block-FP8 copy): SGLang reads the blocks from its
        # config.json; the flag says so on the command line and refuses a checkpoint that is not
        cmd += [QUANTIZATION_FLAG, FP8_QUANTIZATION]
    if spec.memory_saver:
        cmd.append("--enable-memory-saver")
    if spec.deterministic:
        # SGLang ignores every request's sampling_seed without it (seeded reruns, requests sent
        # again after an engine restart); its cost: docs/architecture/engines.md
        cmd.append("--enable-deterministic-inference")
    if spec.lora is not None:
        cmd += spec.lora.flags()
    if spec.routed_experts:
        cmd.append(ROUTED_EXPERTS_FLAG)
    if config_file is not None:
        cmd += ["--config", str(config_file)]
    if spec.nnodes > 1:
        if not dist_init_addr:
            raise RlhpcError(
                f"an engine over {spec.nnodes} nodes needs the dist-init address of node rank 0",
                "start node rank 0's part first and pass its address to every part",
            )
        cmd += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank), "--dist-init-addr", dist_init_addr]
    return cmd + list(spec.extra_args)  # last: the user's extra args win where SGLang takes the last value


def write_key_config(path: Path, api_key: str) -> Path:
    """SGLang's ``--config`` file (0600) carrying ``api-key``: the key stays off the command line."""
    write_secret(path, yaml.safe_dump({"api-key": api_key}))
    return path


def router_command(
    python: str,
    worker_urls: Sequence[str],
    host: str,
    port: int,
    metrics_port: int,
    key_file: Path | None = None,
    parent_pid: str | None = None,
) -> list[str]:
    """sglang_router in front of the engines; with ``key_file``, through ``rlhpc.engine_server.router_main``,
    which hands it the key inside the process (sglang_router takes it only as ``--api-key KEY``).

    Round robin: every sample carries its own seed, so which engine serves it does not matter,
    and the requests of a rollout spread evenly. Its Prometheus endpoint on loopback and a port
    of its own: the default (29000) is one port for every job on the node (it cannot be turned
    off: without a port it takes 29000). The job decides alone whether an engine is alive
    (``rlhpc.rollout.engines.health``), so the router's own judgement is off: no periodic
    ``/health`` (SGLang's generates a token, which an engine whose memory is released cannot, and
    a paused one answers late: slime turns it off too), no circuit breaker (after 10 failures it
    refused every request for 60 s, healthy engines or not), no retries (a failed request comes
    back at once, and the pool checks the engines, restarts the dead one and sends it again).
    Its log keeps warnings and errors: at ``info`` it writes two lines per request. With
    ``parent_pid`` (the driver's), it ends when that process is gone, SIGKILLed included.
    """
    if not worker_urls:
        raise RlhpcError("the router needs at least one engine URL", "start the engines before the router")
    wrapped = [*(("--api-key-file", str(key_file)) if key_file is not None else ())]
    wrapped += ["--parent-pid", parent_pid] if parent_pid is not None else []
    entry = [ROUTER_MAIN, *wrapped] if wrapped else [ROUTER_MODULE]
    return [
        *python_command("-m", *entry, python=python),
        "--worker-urls", *worker_urls,
        "--host", host,
        "--port", str(port),
        "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--log-level", "warn",
        # ends at SIGTERM, not after waiting up to 180 s for its requests in flight: the job stops
        # it to route again after an engine is lost (one held by a silent node never ends) or at
        # the end, and the pool sends an unanswered request again itself
        "--shutdown-grace-period-secs", "0",
        *ROUTER_JUDGEMENT_OFF,
    ]  # fmt: skip


# sglang_router's flags that leave every health decision to the job (see ``router_command``)
ROUTER_JUDGEMENT_OFF = ("--disable-health-check", "--disable-circuit-breaker", "--disable-retries")


# SGLang's switches every engine (SGLang's or the CPU engine, which reads them alike) gets:
ENGINE_SWITCHES = {
    # /health answers without generating: the health checks (rlhpc's, 5 s; the router's) then never
    # call a paused engine dead (SGLang holds such a /health 20 s, then answers 503), nor run a
    # generation on one whose memory is released
    switches.HEALTH_GENERATION: "false",
    # output logprobs of the model's own distribution, as the trainer computes them (temperature
    # 1): SGLang's default divides the logits by the request's temperature first
    switches.RETURN_ORIGINAL_LOGPROB: "true",
}
_ALLOC_CONFS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch's variable, and its newer name


def engine_env(base: Mapping[str, str], memory_saver: bool = False, colocated_tp: bool = False) -> dict[str, str]:
    """An engine server's environment: ``base`` with ``ENGINE_SWITCHES``; with ``memory_saver``,
    no ``expandable_segments`` in torch's allocator settings (torch_memory_saver refuses to start
    under it); ``colocated_tp`` (TP > 1 beside actor ranks): SGLang's check that the GPUs have
    equal free memory off, since the actor ranks beside them differ (it still sizes by the least)."""
    env = {**base, **ENGINE_SWITCHES}
    if memory_saver:
        for name in _ALLOC_CONFS:
            if name in env:
                kept = [o for o in env[name].split(",") if o and not o.strip().startswith("expandable_segments")]
                if kept:
                    env[name] = ",".join(kept)
                else:
                    del env[name]
    if colocated_tp:
        env[switches.TP_MEMORY_IMBALANCE_CHECK] = "false"
    return env


def server_env(base: Mapping[str, str], spec: SGLangSpec, gpu_ids: Sequence[int | str]) -> dict[str, str]:
    """An SGLang server's environment: ``engine_env``, and only this engine's GPUs visible (Ray
    shows an actor only its own)."""
    env = engine_env(base, spec.memory_saver, spec.colocated and spec.tp_size > 1)
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
    return env


def env_changes(base: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """What ``env`` sets or removes relative to ``base`` (``K=V``, ``-K``), sorted: what a dry run
    shows. Only names rlhpc sets appear, never the rest of the job's environment."""
    changed = [f"{k}={v}" for k, v in sorted(env.items()) if base.get(k) != v]
    return changed + [f"-{k}" for k in sorted(set(base) - set(env))]


def free_port(host: str) -> int:
    """A port nobody listens on right now (the caller must cope with losing it to a race)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_conflict(log_text: str) -> bool:
    """Did the server die because a port it was given is taken?"""
    return bool(_ADDRESS_IN_USE.search(log_text))


class ServerExited(RlhpcError):
    """The server process ended during start-up."""

    def __init__(self, name: str, code: int, log_path: Path, log_text: str):
        super().__init__(
            f"{name} exited with code {code} during startup (log {log_path}):\n{_last_lines(log_text, 30)}",
            f"read {log_path}",
        )
        self.log_text = log_text


def wait_healthy(
    proc: subprocess.Popen,
    url: str,
    name: str,
    log_path: Path,
    offset: int,
    timeout_s: float,
    api_key: str | None = None,
) -> None:
    """Block until ``url``/health answers 200 while ``proc`` runs; raise ServerExited if it ends."""
    deadline = time.monotonic() + timeout_s
    with contextlib.closing(EngineClient(url, api_key=api_key)) as client:
        while True:
            code = proc.poll()
            if code is not None:
                raise ServerExited(name, code, log_path, _read_from(log_path, offset))
            if client.health(timeout_s=2) and proc.poll() is None:
                return
            if time.monotonic() > deadline:
                raise RlhpcError(
                    f"{name} not healthy at {url} after {timeout_s:.0f}s (log {log_path}):\n"
                    f"{_last_lines(_read_from(log_path, offset), 30)}",
                    "raise rollout.engine_startup_timeout_s for large models, or read the log",
                )
            time.sleep(0.5)


def start_on_free_port(
    command: Callable[[int], list[str]],
    host: str,
    name: str,
    log_path: Path,
    env: Mapping[str, str],
    timeout_s: float,
    preexec_fn: Callable[[], None] | None = None,
    pick_port: Callable[[str], int] = free_port,
    attempts: int = PORT_ATTEMPTS,
    api_key: str | None = None,
) -> tuple[subprocess.Popen, int]:
    """Start ``command(port)`` on a free port and wait for /health; on an address-in-use death, retry
    on another port (``attempts`` in all). Returns the running process and its port.

    ``api_key``: sent on /health, and replaced in whatever the process writes to its log."""
    for attempt in range(1, attempts + 1):
        port = pick_port(host)
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as logf:
            logf.write(f"\n=== {name} starting on port {port} at {time.strftime('%F %T')} ===\n".encode())
            logf.flush()
            proc = subprocess.Popen(
                command(port),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if api_key else logf,
                stderr=subprocess.STDOUT,
                env=dict(env),
                preexec_fn=preexec_fn,
                start_new_session=True,  # its own process group: stop() ends SGLang's children too
            )
        pump = _RedactingPump(proc, log_path, api_key) if api_key else None
        if pump is not None:
            pump.start()
        try:
            try:
                wait_healthy(proc, http_url(host, port), name, log_path, offset, timeout_s, api_key)
            except ServerExited:
                if pump is None:
                    raise
                pump.join(5.0)  # the last lines, which name the cause, are still in the pipe
                raise ServerExited(name, proc.returncode, log_path, _read_from(log_path, offset)) from None
        except ServerExited as e:
            if attempt < attempts and port_conflict(e.log_text):
                log.warning("%s: port %d was taken (attempt %d of %d); trying another", name, port, attempt, attempts)
                continue
            raise
        except BaseException:
            stop(proc, name=name)
            raise
        return proc, port
    raise AssertionError("unreachable")  # the last attempt returns or raises


class _RedactingPump(threading.Thread):
    """Copy a server's output into its log line by line, with the engine key replaced."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, secret: str):
        super().__init__(name=f"log-pump-{proc.pid}", daemon=True)
        self.proc, self.log_path, self.secret = proc, log_path, secret.encode()

    def run(self) -> None:
        with open(self.log_path, "ab") as logf:
            for line in iter(self.proc.stdout.readline, b""):
                logf.write(redact(line, self.secret))
                logf.flush()
        self.proc.stdout.close()


def redact(data: bytes, secret: bytes) -> bytes:
    return data.replace(secret, b"<engine key>") if secret else data


def stop(proc: subprocess.Popen, grace_s: float = 10.0, name: str = "server") -> None:
    """Stop a server started by ``start_on_free_port`` and its process group (SGLang's scheduler
    and detokenizer children hold the GPUs)."""
    stop_group(proc, grace_s, name)


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _last_lines(text: str, n: int) -> str:
    return "\n".join(text.splitlines()[-n:]) or "(no output)"


def engine_parts(
    engine_slots: Sequence[int],
    location_of_slot: Sequence[tuple[str, int]],
    mem_fraction_static: float,
    memory_saver: bool,
    seed: int,
    extra_args: Sequence[str] = (),
    deterministic: bool = False,
    colocated: bool = False,
    lora: LoraServing | None = None,
    routed_experts: bool = False,
) -> list[tuple[int, SGLangSpec]]:
    """One engine's server processes: ``(first slot on that node, spec)`` per node it spans, in node
    rank order (the node of the engine's first slot is rank 0 and serves HTTP)."""
    nodes: dict[str, list[int]] = {}  # insertion-ordered: the first slot's node comes first
    for slot in engine_slots:
        nodes.setdefault(location_of_slot[slot][0], []).append(slot)
    sizes = {len(slots) for slots in nodes.values()}
    if len(sizes) != 1:
        raise RlhpcError(
            f"an engine's GPUs are spread unevenly over nodes: { ({ip: len(s) for ip, s in nodes.items()}) }",
            "use a cluster.rollout_gpus_per_engine that is a divisor or a multiple of cluster.gpus_per_node",
        )
    return [
        (
            slots[0],
            SGLangSpec(
                tp_size=len(engine_slots),
                mem_fraction_static=mem_fraction_static,
                memory_saver=memory_saver,
                seed=seed,
                gpu_ids=tuple(location_of_slot[s][1] for s in slots),
                extra_args=tuple(extra_args),
                nnodes=len(nodes),
                node_rank=rank,
                deterministic=deterministic,
                colocated=colocated,
                lora=lora,
                routed_experts=routed_experts,
            ),
        )
        for rank, slots in enumerate(nodes.values())
    ]


class Router:
    """sglang_router in front of the engines, run by the driver: generation goes through it,
    weight updates and memory calls go to each engine directly."""

    def __init__(self, host: str, log_path: Path, startup_timeout_s: float, key_file: Path | None = None):
        if importlib.util.find_spec("sglang_router") is None:
            raise RlhpcError(
                f"rollout.sglang.router: true needs sglang_router, but {sys.executable} cannot import it",
                "pip install rlhpc (it depends on sglang-router) into the job's environment, "
                "or set rollout.sglang.router: false",
            )
        self.host = host  # loopback: the driver, beside it, is its one client
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.key_file = key_file
        self.api_key = read_key(key_file) if key_file is not None else None
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.worker_urls: list[str] = []  # the engines it routes to

    def start(self, worker_urls: Sequence[str]) -> str:
        """(Re)start over ``worker_urls`` (after an engine restart its URL changed); returns the URL."""
        self.stop()
        self.worker_urls = list(worker_urls)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc, port = start_on_free_port(
            lambda p: router_command(
                sys.executable, worker_urls, self.host, p, free_port(self.host), self.key_file, str(os.getpid())
            ),
            self.host,
            "sglang router",
            self.log_path,
            os.environ,
            self.startup_timeout_s,
            api_key=self.api_key,
        )
        self.url = http_url(self.host, port)
        self._wait_routing(len(worker_urls))
        log.info("sglang router at %s over %d engine(s), log %s", self.url, len(worker_urls), self.log_path)
        return self.url

    def _wait_routing(self, engines: int) -> None:
        """Until it routes to all ``engines``: it answers /health before it has registered them."""
        deadline = time.monotonic() + self.startup_timeout_s
        with contextlib.closing(EngineClient(self.url, api_key=self.api_key)) as client:
            while (routed := client.routed_engines()) < engines:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    url = self.url
                    self.stop()
                    raise RlhpcError(
                        f"the sglang router at {url} routes to {routed} of its {engines} engine(s) after "
                        f"{self.startup_timeout_s:.0f} s (log {self.log_path}):\n"
                        f"{_last_lines(_read_from(self.log_path, 0), 30)}",
                        f"read {self.log_path}: it could not reach or register the engines",
                    )
                time.sleep(0.05)

    def stop(self) -> None:
        proc, self.proc, self.url = self.proc, None, None
        if proc is not None:
            stop(proc, name="sglang router")
