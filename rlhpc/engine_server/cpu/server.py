"""The CPU engine server process: command line, socket, ready file, parent watch, shutdown."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import uvicorn
import uvloop

from rlhpc.engine_server.cpu.app import build_app
from rlhpc.engine_server.cpu.runner import Engine
from rlhpc.errors import RlhpcError
from rlhpc.util.files import write_atomic
from rlhpc.util.http_guard import GuardLimits, connection_cap, uvicorn_options
from rlhpc.wire import lora as L
from rlhpc.wire import protocol as P
from rlhpc.wire import switches
from rlhpc.wire.engine_key import read_key

log = logging.getLogger("rlhpc.cpu_server")

_DESCRIPTION = "A CPU rollout engine that speaks SGLang's native HTTP protocol."


def _write_ready_file(path: Path, info: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(info))  # readers see the whole file or none


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio's own loop sets TCP_NODELAY only on sockets whose proto says TCP
    # (uvloop on every TCP socket); without it a JSON answer (headers, then body) waits out the
    # client's 40 ms delayed ACK on every call
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))  # port 0: the kernel picks a free port, no probe-then-bind race
    sock.set_inheritable(False)
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _watch_parent(parent_pid: int, server: uvicorn.Server) -> None:
    """Exit when the parent dies, so a killed Ray actor leaves no orphan server."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            log.warning("parent %d is gone; shutting down", parent_pid)
            server.should_exit = True
            time.sleep(10)
            os._exit(1)  # graceful shutdown stuck (e.g. a broadcast that never completes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlhpc.engine_server.cpu", description=_DESCRIPTION)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = pick a free port (see --ready-file)")
    p.add_argument("--ready-file", type=Path, help='written as {"host", "port", "pid"} once serving')
    p.add_argument("--weight-version", default="default")
    p.add_argument("--parent-pid", type=int, help="exit when this process is no longer our parent")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the model on cuda:0")
    p.add_argument(
        "--enable-deterministic-inference", action="store_true",
        help="honour each request's sampling_seed (42 without one), as SGLang's flag of this name; "
        "without it every request samples at random",
    )  # fmt: skip
    p.add_argument(
        P.ROUTED_EXPERTS_FLAG, action="store_true",
        help="a MoE model: answer each token's experts to requests with return_routed_experts (SGLang's flag)",
    )  # fmt: skip
    lora = p.add_argument_group("LoRA adapters (SGLang's flags and rules)")
    lora.add_argument(L.ENABLE_LORA, action="store_true", help="serve LoRA adapters, loaded by name")
    lora.add_argument(L.MAX_LORA_RANK, type=int, help="the largest adapter rank served")
    lora.add_argument(
        L.LORA_TARGET_MODULES, nargs="*", choices=[*L.SUPPORTED_TARGET_MODULES, L.ALL],
        help="the modules adapters may adapt ('all': every one)",
    )  # fmt: skip
    lora.add_argument(
        L.MAX_LORAS_PER_BATCH, type=int, default=L.DEFAULT_MAX_LORAS_PER_BATCH,
        help="adapters a batch mixes, the base model counting as one; rows of more run in turn",
    )  # fmt: skip
    lora.add_argument(
        L.MAX_LOADED_LORAS, type=int,
        help="adapters held at once (default: no limit); a load past it unloads the least recently used",
    )  # fmt: skip
    lora.add_argument(L.LORA_PATHS, nargs="*", help="adapters loaded at start: NAME=PATH or PATH (a PEFT directory)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--header-timeout-s", type=float, default=GuardLimits.header_timeout_s,
        help="a connection that has not sent a request's headers this long after its first byte (or the "
        "connection's start) is closed",
    )  # fmt: skip
    p.add_argument(
        "--max-connections", type=int, default=connection_cap(),
        help="connections open at once, at most half the open-file limit; past it the oldest waiting for "
        "its headers is closed, else the longest idle that carried fewer than two requests, else the "
        "new one; a pool's idle connection never is (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--api-key-file",
        type=Path,
        help="a file holding the key every request must carry (Authorization: Bearer KEY); required unless "
        "--host is a loopback address. A path, not the key: command lines are visible to every user",
    )
    args = p.parse_args(argv)
    if args.api_key_file is None and not is_loopback(args.host):
        p.error(f"--host {args.host} is reachable from other machines: pass --api-key-file (or a loopback --host)")
    if args.api_key_file is not None and not args.api_key_file.is_file():
        p.error(f"--api-key-file {args.api_key_file} does not exist")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device (a CPU build of torch, or no GPU visible)")
    args.lora = _lora_serving(p, args)
    return args


def _lora_serving(p: argparse.ArgumentParser, args: argparse.Namespace) -> L.LoraServing | None:
    """The LoRA flags as SGLang reads them: --lora-paths alone enables LoRA; the CPU engine needs
    the rank and targets given (SGLang infers them from --lora-paths' adapters when absent)."""
    if not (args.enable_lora or args.lora_paths):
        return None
    if not (args.max_lora_rank and args.lora_target_modules):
        p.error(L.NEEDS_RANK_AND_TARGETS if not args.lora_paths else f"the CPU engine: {L.NEEDS_RANK_AND_TARGETS}")
    try:
        return L.LoraServing(
            args.max_lora_rank, tuple(args.lora_target_modules), args.max_loras_per_batch,
            tuple(args.lora_paths or ()), args.max_loaded_loras,
        )  # fmt: skip
    except RlhpcError as e:
        p.error(str(e))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s cpu_server[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    torch.set_num_threads(max(1, args.threads))
    stop_requested = threading.Event()
    # Our own handler outlives uvicorn's: after its graceful shutdown uvicorn re-raises the
    # signal, which would otherwise kill us with status -15 instead of a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())

    original = switches.bool_env_var(os.environ, switches.RETURN_ORIGINAL_LOGPROB)
    engine = Engine(
        args.model_path,
        args.weight_version,
        args.device,
        args.enable_deterministic_inference,
        original,
        args.lora,
        args.enable_return_routed_experts,
    )
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    address = {"host": args.host, "port": port}
    app = build_app(engine, address, read_key(args.api_key_file) if args.api_key_file is not None else None)
    # Keep idle connections well past uvicorn's 5 s: the pool's clients reuse theirs after a
    # training step, and a server closing one just as a request goes out resets that request.
    # httptools (the guard's protocol) and uvloop (below), as SGLang's server: a round trip
    # ~0.15 ms (25%) shorter than with h11 and asyncio's own loop, and a push or a rollout is a few of them.
    limits = GuardLimits(header_timeout_s=args.header_timeout_s, max_connections=args.max_connections,
                         idle_timeout_s=300)  # fmt: skip
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=3, lifespan="off",
        **uvicorn_options(limits, "the engine server"),
    )  # fmt: skip
    server = uvicorn.Server(config)
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, server), daemon=True).start()

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            log.info(
                "serving %s on %s:%d (weight_version %s, %s)", args.model_path, host, port, engine.weight_version,
                "engine key required" if args.api_key_file is not None else "no key: loopback only",
            )  # fmt: skip
            if args.ready_file:
                _write_ready_file(args.ready_file, {"host": args.host, "port": port, "pid": os.getpid()})
        await task

    code = 0
    try:
        uvloop.run(serve())
    except Exception:
        log.exception("server failed")
        code = 1
    finally:
        app.state.flags["shutting_down"] = True
        if args.ready_file is not None:
            args.ready_file.unlink(missing_ok=True)
        log.info("exiting (%s)", "SIGTERM" if stop_requested.is_set() else f"code {code}")
        logging.shutdown()
        # Worker threads may sit in a gloo broadcast that will never complete; do not join them.
        os._exit(code)
