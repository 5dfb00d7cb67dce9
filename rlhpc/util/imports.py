"""User code named in the config as ``"module:function"`` (a reward, a sampling filter)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rlhpc.errors import ConfigError


def import_function(
    key: str, spec: str, signature: str, not_a_spec: str | None = None, kind: str = "function"
) -> Callable:
    """Import ``spec``; each failure names the config key, the spec and the fix.

    ``signature``: what the function must look like, for the fix; ``not_a_spec``: the problem
    when ``spec`` is not ``module:function`` (by default, exactly that); ``kind``: ``class`` for
    a class named as ``module:Class`` (an environment)."""
    name = "Class" if kind == "class" else "function"
    example = "my_module:MyClass" if kind == "class" else "my_module:my_function"
    module_name, sep, fn_name = spec.partition(":")
    if not sep or not module_name or not fn_name:
        raise ConfigError(
            not_a_spec or f"{key} = {spec!r} is not 'module:{name}'",
            f"write {key}: {example}, a {kind} {signature}",
        )
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"{key} = {spec!r} cannot be imported: {e}",
            f"make the module importable from the job (PYTHONPATH) and check the {kind}'s name",
        ) from e
    if not callable(fn):
        raise ConfigError(f"{key} = {spec!r} is not callable", f"point it at a {kind} {signature}")
    return fn
