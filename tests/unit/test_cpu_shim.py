"""The megatron CPU shim checks the megatron-core it patches before it touches anything."""

import logging
import types

import pytest

from rlhpc.actor.megatron.cpu_shim import _REPLACED, TESTED_MEGATRON_CORE, check_megatron_core
from rlhpc.errors import RlhpcError


def fake_megatron(drop: str | None = None):
    """An import_module over stand-in modules holding every name the shim replaces, but ``drop``."""
    modules = {name: types.SimpleNamespace(**dict.fromkeys(attrs)) for name, attrs in _REPLACED.items()}
    if drop is not None:
        name, attr = drop.rsplit(".", 1)
        delattr(modules[name], attr)
    return modules.__getitem__


def test_the_tested_version_passes_quietly(caplog):
    with caplog.at_level(logging.WARNING):
        check_megatron_core(TESTED_MEGATRON_CORE, fake_megatron())
    assert not caplog.records


def test_another_version_with_every_internal_warns(caplog):
    with caplog.at_level(logging.WARNING):
        check_megatron_core("0.99.0", fake_megatron())
    [record] = caplog.records
    assert "megatron-core 0.99.0 is installed" in record.getMessage()
    assert f"pip install megatron-core=={TESTED_MEGATRON_CORE}" in record.getMessage()


def test_a_missing_internal_is_refused_with_the_fix():
    gone = "megatron.core.optimizer.clip_grads.l2_norm_impl"
    with pytest.raises(RlhpcError, match=gone) as err:
        check_megatron_core("0.99.0", fake_megatron(drop=gone))
    assert err.value.fix.startswith(f"pip install megatron-core=={TESTED_MEGATRON_CORE}")


def test_a_missing_module_is_refused():
    def import_module(name: str):
        if name == "megatron.core.fusions.fused_softmax":
            raise ModuleNotFoundError(name)
        return fake_megatron()(name)

    with pytest.raises(RlhpcError, match=r"replaces megatron\.core\.fusions\.fused_softmax, which"):
        check_megatron_core("0.99.0", import_module)
