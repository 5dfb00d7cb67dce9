"""One rollout engine as a Ray actor: it owns an engine server process on its node.

The actor holds the GPU(s) Ray placed it on (the caller chooses them with
``EngineActor.options(num_gpus=..., num_cpus=..., scheduling_strategy=...)``) and starts the
engine server beside it, on the node's IP. The CPU engine server picks its own port (port 0 +
ready file), so nothing races for ports; an SGLang server (``sglang=SGLangSpec(...)``) needs a
fixed one, picked free and picked again if it was lost to a race (see ``sglang_server``). An
engine spanning nodes has one actor per node; only node rank 0 serves HTTP. The server dies
with the actor: PR_SET_PDEATHSIG when the actor forks from its main thread (Ray runs a plain
actor's methods there), plus the CPU server's own ``--parent-pid`` watchdog.

Every route of the server requires the job's engine key (``key_file``, see
``rlhpc.wire.engine_key``): the CPU server reads the file itself (``--api-key-file``), SGLang
from a 0600 ``--config`` file in the actor's private temp dir, so the key is on no command line.
The server listens on ``host`` (loopback when every peer is on this node), else the node's IP.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray

from rlhpc.engine_server import sglang as sglang_server
from rlhpc.engine_server.cpu.command import THREAD_DEFAULTS
from rlhpc.engine_server.cpu.command import server_command as cpu_server_command
from rlhpc.engine_server.sglang import SGLangSpec
from rlhpc.errors import RlhpcError
from rlhpc.util.files import node_tmp_dir, read_trusted_json, tail
from rlhpc.util.net import http_url, url_host
from rlhpc.util.processes import die_with_parent, stop_group
from rlhpc.wire.client import EngineClient
from rlhpc.wire.engine_key import read_key
from rlhpc.wire.lora import LoraServing

log = logging.getLogger(__name__)


class EngineServer:
    """Start, watch, restart and stop one engine server (``rlhpc.engine_server.cpu`` or SGLang):
    as a Ray actor (``EngineActor``) in a run, as it is in a shared fleet's owner
    (``rlhpc.launch.fleet``), which starts its engines outside any run's Ray."""

    def __init__(
        self,
        model_path: str,
        log_dir: str,
        engine_id: int,
        startup_timeout_s: float,
        env: dict | None = None,
        sglang: SGLangSpec | None = None,
        start: bool = True,
        key_file: str | None = None,
        host: str | None = None,
        deterministic: bool = False,
        lora: LoraServing | None = None,
        routed_experts: bool = False,
    ):
        self.model_path = model_path
        # the CPU engine's --enable-deterministic-inference and LoRA flags (SGLang's come in ``sglang``)
        self.deterministic = deterministic
        self.lora = lora
        self.routed_experts = routed_experts  # the CPU engine's --enable-return-routed-experts
        self.engine_id = engine_id
        self.startup_timeout_s = startup_timeout_s
        self.extra_env = dict(env or {})
        self.sglang = sglang
        part = f"_node{sglang.node_rank}" if sglang is not None and sglang.nnodes > 1 else ""
        self.log_path = Path(log_dir) / f"engine_{engine_id}{part}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.node_ip = ray.util.get_node_ip_address()  # what other nodes reach (SGLang's dist-init)
        # Without a key the server must not be reachable from other machines: loopback only.
        self.host = host or (self.node_ip if key_file else "127.0.0.1")
        self.key_file = key_file
        self.api_key = read_key(key_file) if key_file else None
        self.tmp_dir = node_tmp_dir(f"rlhpc-engine{engine_id}-")
        self.ready_file = self.tmp_dir / "ready.json"
        self.proc: subprocess.Popen | None = None
        self._url: str | None = None
        self._dist_init_addr: str | None = None
        if sglang is not None:
            sglang_server.require_module("sglang", "SGLang on every engine node")
        if start:
            self._start()

    # -------------------------------------------------------------- lifecycle

    def _command(self) -> list[str]:
        return cpu_server_command(
            sys.executable, self.model_path, self.host, str(self.ready_file), str(os.getpid()),
            self.extra_env.get("OMP_NUM_THREADS", "1"), self.key_file, self.deterministic, self.lora,
            self.routed_experts,
        )  # fmt: skip

    def _env(self) -> dict[str, str]:
        """The job's environment, for either engine (``engine_env`` adds SGLang's switches)."""
        env = {**THREAD_DEFAULTS, **os.environ}
        env.update({k: str(v) for k, v in self.extra_env.items()})
        return env

    def _start(self) -> None:
        if self.sglang is not None:
            self._start_sglang()
            return
        self.ready_file.unlink(missing_ok=True)
        # pdeathsig fires when the forking *thread* exits; only trust it from the main thread
        main = threading.current_thread() is threading.main_thread()
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== engine {self.engine_id} starting at {time.strftime('%F %T')} ===\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=sglang_server.engine_env(self._env()),
                preexec_fn=die_with_parent if main else None,
            )
        log.info("engine %d: server pid %d, log %s", self.engine_id, self.proc.pid, self.log_path)
        self._url = self._wait_ready()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.ready_file.exists():
            code = self.proc.poll()
            if code is not None:
                raise RlhpcError(
                    f"engine {self.engine_id} server exited with code {code} during startup "
                    f"(log {self.log_path}):\n{tail(self.log_path)}",
                    f"read {self.log_path}",
                )
            if time.monotonic() > deadline:
                self._kill()
                raise RlhpcError(
                    f"engine {self.engine_id} not ready after {self.startup_timeout_s:.0f}s (log {self.log_path}):\n"
                    f"{tail(self.log_path)}",
                    "raise rollout.engine_startup_timeout_s for large models, or read the log",
                )
            time.sleep(0.05)
        # The server wrote it in our 0700 dir; still, a file naming another process (or not ours)
        # would send the engine key to whoever listens on the port it names.
        info = read_trusted_json(self.ready_file, pid=self.proc.pid)
        url = http_url(info["host"], info["port"])
        EngineClient(url, api_key=self.api_key).wait_healthy(max(5.0, deadline - time.monotonic()))
        log.info("engine %d ready at %s", self.engine_id, url)
        return url

    def _start_sglang(self) -> None:
        spec = self.sglang
        main = threading.current_thread() is threading.main_thread()
        gpu_ids = spec.gpu_ids or tuple(int(g) for g in ray.get_gpu_ids())
        env = sglang_server.server_env(self._env(), spec, gpu_ids)
        name = f"engine {self.engine_id}" + (f" node rank {spec.node_rank}" if spec.nnodes > 1 else "")

        config = None
        if self.api_key and spec.serves_http:  # a 0600 file in our 0700 temp dir: not on the command line
            config = sglang_server.write_key_config(self.tmp_dir / "sglang_key.yaml", self.api_key)

        def command(port: int) -> list[str]:
            nccl_port = sglang_server.free_port(self.host)
            return sglang_server.launch_server_command(
                sys.executable, self.model_path, self.host, port, nccl_port, spec, self._dist_init_addr, config
            )

        if not spec.serves_http:
            # Node ranks > 0 only join node rank 0's distributed group; node rank 0's /health
            # tells when the whole engine is up.
            with open(self.log_path, "ab") as logf:
                logf.write(f"\n=== {name} starting at {time.strftime('%F %T')} ===\n".encode())
                logf.flush()
                self.proc = subprocess.Popen(
                    command(sglang_server.free_port(self.host)),
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=die_with_parent if main else None,
                    start_new_session=True,
                )
            log.info("%s: SGLang pid %d (GPUs %s), log %s", name, self.proc.pid, gpu_ids, self.log_path)
            return
        self.proc, port = sglang_server.start_on_free_port(
            command,
            self.host,
            name,
            self.log_path,
            env,
            self.startup_timeout_s,
            preexec_fn=die_with_parent if main else None,
            api_key=self.api_key,
        )
        self._url = http_url(self.host, port)
        log.info(
            "%s: SGLang pid %d (GPUs %s) ready at %s, log %s", name, self.proc.pid, gpu_ids, self._url, self.log_path
        )

    def _kill(self, grace_s: float = 5.0) -> None:
        """Stop our own server by pid: TERM, a short wait, then KILL."""
        proc, self.proc = self.proc, None
        self._url = None
        if proc is not None and self.sglang is not None:
            stop_group(proc, grace_s, f"engine {self.engine_id} SGLang server")  # its children hold the GPUs
            return
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("engine %d: server %d ignored SIGTERM; killing", self.engine_id, proc.pid)
            proc.kill()
            proc.wait()

    # -------------------------------------------------------------- API

    def url(self) -> str:
        if self._url is None:
            raise RlhpcError(f"engine {self.engine_id} is not running", "restart() it")
        return self._url

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_file(self) -> str:
        return str(self.log_path)

    def is_alive(self) -> bool:
        """The server process runs and answers /health (a part without HTTP: it runs)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        if self.sglang is not None and not self.sglang.serves_http:
            return True
        return self._url is not None and EngineClient(self._url, api_key=self.api_key).health()

    # -------------------------------------------------------------- engines over several nodes

    def reserve_dist_init_addr(self) -> str:
        """Node rank 0: a free ``host:port`` on this node for SGLang's --dist-init-addr.

        SGLang derives a few more ports from it (port + 1 ...); a lost race shows as a start-up
        failure of the whole engine, which the engine pool reports with the log.
        """
        return f"{url_host(self.node_ip)}:{sglang_server.free_port(self.node_ip)}"

    def start(self, dist_init_addr: str | None = None) -> str | None:
        """Start a part created with ``start=False`` (every part of an engine at once); node rank 0
        returns its URL once the whole engine answers /health."""
        self._kill()
        self._dist_init_addr = dist_init_addr
        self._start()
        return self._url

    def stop(self) -> None:
        self._kill()

    def restart(self) -> str:
        """Kill and start again on the same model path; returns the new URL (a new port).

        The engine comes back with the weights on disk: the caller re-syncs the current weights.
        """
        log.warning("engine %d: restarting", self.engine_id)
        self._kill()
        self._start()
        return self._url

    def shutdown(self) -> None:
        self._kill()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


EngineActor = ray.remote(EngineServer)
