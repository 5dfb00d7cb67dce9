"""Model-written code, run where Slurm jobs run (docs/guides/sandbox.md).

``pool()`` is this process's pool of warm sandboxes (``sandbox`` section; ``configure`` sets
it, the driver does at start): ``pool().run(code, lang)`` runs Python source or a bash script
in a fresh child of a warm sandbox and answers a ``Result`` (``rlhpc.sandbox.pool`` for what its
status means). ``python`` and ``bash`` are the same as tools for episodes (``rollout.tools:
["rlhpc.sandbox:python", "rlhpc.sandbox:bash"]``); ``rlhpc.rewards:code`` scores a solution
against its row's tests with it (``rlhpc.sandbox.testing``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhpc.sandbox.pool import INFRA, Job, Result, SandboxPool, close, configure, pool, stats

if TYPE_CHECKING:
    from rlhpc.config import Config

__all__ = ["INFRA", "Job", "Result", "SandboxPool", "bash", "close", "configure", "pool", "python", "stats", "used"]

TOOLS = ("rlhpc.sandbox:python", "rlhpc.sandbox:bash")
REWARD = "rlhpc.rewards:code"


def used(cfg: Config) -> bool:
    """Whether the run's own pieces run code in the sandbox (the code task or reward, the python
    or bash tool): the job then starts the pool at its start, so a node that cannot run one
    fails there, not at the first rollout. (Code of your own that calls ``pool()`` starts it
    on first use.)"""
    return cfg.data.task == "code" or cfg.data.reward == REWARD or any(t in TOOLS for t in cfg.rollout.tools)


def _answer(result: Result) -> str:
    """What a tool call answers the model: the output, then how the run ended. Only the
    configured limits are named, never measured times, so the same run answers the same text."""
    if result.infra:
        raise result.failure()  # the episode is masked, not answered
    out = result.stdout + (("\n" if result.stdout and not result.stdout.endswith("\n") else "") + result.stderr)
    if result.truncated:
        out += "\n[output cut]"
    cfg = pool().cfg
    ending = {
        "ok": "",
        "error": f"[exit status {result.exit_code}]",
        "timeout": f"[timed out after {cfg.wall_s:g} s]",
        "cpu_limit": f"[killed at the CPU limit of {cfg.cpu_s:g} s]",
        "crashed": f"[{result.detail}]",
    }[result.status]
    return (out + ("\n" if out and ending and not out.endswith("\n") else "") + ending) or "[no output]"


def python(code: str) -> str:
    """Run Python code in a sandbox (no network, a private /tmp, nothing kept between calls) and
    see what it printed and how it ended."""
    return _answer(pool().run(code, "python"))


def bash(command: str) -> str:
    """Run a bash command in a sandbox (no network, a private /tmp, nothing kept between calls)
    and see what it printed and how it ended."""
    return _answer(pool().run(command, "bash"))
