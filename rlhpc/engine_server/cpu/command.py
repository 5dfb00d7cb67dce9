"""The CPU engine server's command line (``server.parse_args`` reads it): what ``EngineActor``
runs, and what a dry run shows."""

from __future__ import annotations

from rlhpc.util.processes import python_command
from rlhpc.wire.lora import LoraServing
from rlhpc.wire.protocol import ROUTED_EXPERTS_FLAG

MODULE = "rlhpc.engine_server.cpu"
THREAD_DEFAULTS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # unless the job says: CI machines have two cores


def server_command(
    python: str,
    model_path: str,
    host: str,
    ready_file: str,
    parent_pid: str,
    threads: str,
    key_file: str | None = None,
    deterministic: bool = False,
    lora: LoraServing | None = None,
    routed_experts: bool = False,
) -> list[str]:
    """``python -m rlhpc.engine_server.cpu ...`` on a port it picks (written to ``ready_file``).
    ``deterministic``: SGLang's ``--enable-deterministic-inference`` (seeds honoured). ``lora``:
    serve LoRA adapters, with SGLang's flags (as ``rlhpc.engine_server.sglang`` passes them).
    ``routed_experts``: answer each token's experts (SGLang's ``--enable-return-routed-experts``)."""
    cmd = [
        *python_command("-m", MODULE, python=python),
        "--model-path", model_path,
        "--host", host,
        "--port", "0",
        "--ready-file", ready_file,
        "--parent-pid", parent_pid,
        "--threads", threads,
    ]  # fmt: skip
    if key_file is not None:
        cmd += ["--api-key-file", key_file]
    if deterministic:
        cmd.append("--enable-deterministic-inference")
    if lora is not None:
        cmd += lora.flags()
    if routed_experts:
        cmd.append(ROUTED_EXPERTS_FLAG)
    return cmd
