"""megatron-core, imported without what its top level imports for features rlhpc never uses.

``import megatron.core`` imports wandb (the optional logging of its inference engine and timers)
and, through ``megatron.core.jit`` (``jit_fuser = torch.compile``), torch._dynamo and
torch._inductor: the decorator alone imports them, though nothing compiles before a fused
function's first call. Together about 40% of the import (measured: 6-7 of which 2.5 CPU
seconds), paid by every process that imports it: each megatron rank, a megatron job's driver.

``import_megatron_core()`` imports it with wandb hidden (megatron then takes its no-wandb path)
and each ``torch.compile`` it applies deferred to the function's first call, which compiles it
as ``torch.compile`` would have. Both only for the duration of that import: a later
``import wandb`` or ``torch.compile`` is the real one."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch


def import_megatron_core() -> None:
    if "megatron.core" in sys.modules:
        return
    compile_now = torch.compile
    hide_wandb = "wandb" not in sys.modules  # one already imported stays as it is
    if hide_wandb:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError
    torch.compile = _compile_on_first_call(compile_now)  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_now
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


def _compile_on_first_call(compile_now: Callable[..., Any]) -> Callable[..., Any]:
    def deferred(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        if fn is None:  # @torch.compile(mode=...): the options first, the function next
            return lambda f: deferred(f, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(fn, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred
