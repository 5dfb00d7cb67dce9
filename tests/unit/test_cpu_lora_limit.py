"""The CPU engine past --max-loaded-loras, as SGLang: a load succeeds and the least recently used
adapter (loaded, or named by a request) leaves; a request naming it later loads it again from
its path. SGLang's code and words are pinned in tests/unit/test_sglang_protocol.py."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from rlhpc.engine_server.cpu.lora import Adapters
from rlhpc.wire import lora as L


def adapter_dir(tmp_path, name: str) -> str:
    """A PEFT directory adapting ``0`` (the one Linear of the model below) at rank 1."""
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 1, "lora_alpha": 1, "target_modules": ["0"]}))
    save_file(
        {"base_model.model.0.lora_A.weight": torch.ones(1, 2), "base_model.model.0.lora_B.weight": torch.ones(2, 1)},
        d / "adapter_model.safetensors",
    )
    return str(d)


def test_a_load_past_the_limit_unloads_the_least_recently_used(tmp_path, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    serving = L.LoraServing(1, ("all",), max_loras_per_batch=2, max_loaded_loras=2)
    held = Adapters(model, serving)
    paths = {n: adapter_dir(tmp_path, n) for n in ("a", "b", "c")}
    held.load_path("a", paths["a"])
    held.load_path("b", paths["b"])
    held.resolve(["a", None])  # a request names a: b is now the least recently used
    with caplog.at_level("INFO"):
        assert set(held.load_path("c", paths["c"])) == {"a", "c"}
    assert L.evicting("b", 3, 2) in caplog.text
    [b] = held.resolve(["b"])  # loaded again from its path; a, the least recently used, leaves
    assert b.name == "b" and set(held.listing()) == {"c", "b"}
    unlimited = Adapters(model, L.LoraServing(1, ("all",)))
    for n, p in paths.items():
        unlimited.load_path(n, p)
    assert set(unlimited.listing()) == {"a", "b", "c"}
