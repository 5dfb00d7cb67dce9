"""megatron-core imported without wandb and torch._dynamo (rlhpc.actor.megatron.lean_import): what
megatron then does is what it did, the fused functions compiled at their first call, and a later
``import wandb`` or ``torch.compile`` is the real one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhpc.actor.megatron.lean_import import _compile_on_first_call

pytest.importorskip("megatron.core")


def test_a_function_is_compiled_at_its_first_call_with_its_options() -> None:
    compiled: list[tuple[object, dict]] = []

    def compile_now(fn, **options):
        compiled.append((fn, options))
        return lambda x: fn(x) * 10  # stands for the compiled function: its result tells it ran

    deferred = _compile_on_first_call(compile_now)

    def double(x: int) -> int:
        return 2 * x

    plain, with_options = deferred(double), deferred(mode="max-autotune")(double)
    assert compiled == [] and plain.__name__ == "double"
    assert plain(1) == 20 and plain(2) == 40  # compiled once, then the compiled function runs
    assert with_options(1) == 20
    assert compiled == [(double, {}), (double, {"mode": "max-autotune"})]


def test_a_rank_imports_megatron_without_wandb_and_dynamo() -> None:
    # A fresh process, as a rank is: this one may have imported either already.
    check = """
import sys, torch
compile_before = torch.compile
from rlhpc.actor.megatron import torch_dist_load, async_save  # megatron-core's first importers
import megatron.core.jit as jit
from megatron.core.inference.contexts import dynamic_context
assert "megatron.core" in sys.modules
assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules, "dynamo imported"
assert "wandb" not in sys.modules and dynamic_context.wandb is None, "wandb imported"
assert torch.compile is compile_before, "torch.compile left replaced"
assert jit.jit_fuser is not compile_before  # megatron's fuser: the deferred compile
import wandb  # the real one, once megatron is in
print("ok", wandb.__name__)
"""
    p = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "ok wandb" in p.stdout, p.stderr[-3000:]
