"""Rollout routing replay's wire and config (R3): SGLang 0.5.23's names, encoding and rules read
from its wheel, the answer decoded as it encodes it, and the configs preflight refuses."""

from __future__ import annotations

import re

import numpy as np
import pytest
from support import sglang_wheel as W

from rlhpc import preflight
from rlhpc.config import Config, TinyModelConfig
from rlhpc.engine_server.cpu.command import server_command
from rlhpc.engine_server.sglang import SGLangSpec, launch_server_command
from rlhpc.errors import ConfigError, RlhpcError
from rlhpc.wire import protocol as P

CAPTURER = "sglang/srt/state_capturer/routed_experts.py"
CAPTURER_BASE = "sglang/srt/state_capturer/base.py"
RESULTS = "sglang/srt/managers/scheduler_components/batch_result_processor.py"
DETOKENIZER = "sglang/srt/managers/detokenizer_manager.py"


def test_the_flag_and_request_field_are_sglangs() -> None:
    assert P.ROUTED_EXPERTS_FLAG in W.server_flags()
    generate = W.request_structs()["GenerateReqInput"]
    assert generate["return_routed_experts"].default is False
    assert generate["routed_experts_start_len"].default == 0  # 0: from the first prompt token
    assert P.MetaInfo.ROUTED_EXPERTS in W.meta_info_keys()
    # the field rlhpc sends, and its body leaves it out when unset
    assert P.generate_body(P.GenerateReqInput(input_ids=[1], return_routed_experts=True))["return_routed_experts"]
    assert "return_routed_experts" not in P.generate_body(P.GenerateReqInput(input_ids=[1]))
    # both launch lines carry the flag when asked
    spec = SGLangSpec(tp_size=1, mem_fraction_static=0.8, memory_saver=False, seed=0, routed_experts=True)
    assert P.ROUTED_EXPERTS_FLAG in launch_server_command("python", "m", "h", 1, 2, spec)
    assert P.ROUTED_EXPERTS_FLAG in server_command("python", "m", "h", "r", "1", "1", routed_experts=True)
    assert P.ROUTED_EXPERTS_FLAG not in server_command("python", "m", "h", "r", "1", "1")


def test_the_answer_is_sglangs_int32_positions_by_layers_by_top_k() -> None:
    """SGLang's capturer holds int32 [tokens, layers, num_experts_per_tok]; a finished request's
    rows are its tokens [start_len, seqlen - 1) with seqlen = prompt + output tokens (the prompt's
    included, the last token's not: no forward ran it), base64 of the tensor's bytes; and
    without the launch flag (no capturer) a request's return_routed_experts is ignored, not refused."""
    base = W.function_code(CAPTURER_BASE, "get_topk")
    assert "[start_len:seqlen - 1]" in base
    collect = W.function_code(RESULTS, "_maybe_collect_routed_experts")
    assert "seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)" in collect
    assert "if capturer is None:\n        return" in collect
    capturer = W.function_code(CAPTURER, "__init__")
    assert "topk_size = model_config.hf_text_config.num_experts_per_tok" in capturer
    assert "num_layers = model_config.hf_text_config.num_hidden_layers" in capturer
    assert "dtype=torch.int32" in W.source(CAPTURER_BASE)
    assert "pybase64.b64encode(item.numpy().tobytes())" in W.function_code(DETOKENIZER, "_b64_encode_per_request")
    # decoded as SGLang's own reader does (extract_routed_experts_from_meta_info: int32 frombuffer)
    assert "np.frombuffer(pybase64.b64decode(" in W.function_code(CAPTURER, "extract_routed_experts_from_meta_info")

    experts = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2) % 7
    meta = {P.MetaInfo.ROUTED_EXPERTS: P.encode_routed_experts(experts)}
    assert (P.routed_experts(meta, 5, 3, 2) == experts).all()
    with pytest.raises(RlhpcError, match="not 6 positions x 3 layers x 2 experts"):
        P.routed_experts(meta, 6, 3, 2)
    with pytest.raises(RlhpcError, match="--enable-return-routed-experts"):
        P.routed_experts({}, 5, 3, 2)


def test_the_cpu_engine_checks_the_start_as_sglang_does() -> None:
    """SGLang's Scheduler aborts a request whose routed_experts_start_len is negative or past the
    prompt, in these words; the CPU engine refuses it with them."""
    from rlhpc.engine_server.cpu.requests import EngineError, ModelLimits, normalize_generate

    said = W.function_code("sglang/srt/managers/scheduler.py", "_handle_generate_request")
    low = "{recv_req.routed_experts_start_len!r} is lower than 0. Please use a non-negative routed_experts_start_len."
    high = (
        "{recv_req.routed_experts_start_len!r} is higher than the number of input tokens "
        "len(req.origin_input_ids)={len(req.origin_input_ids)!r}. Please use a smaller routed_experts_start_len."
    )
    assert low in said and high in said
    limits = ModelLimits(100, 1000, frozenset({0}))
    body = {"input_ids": [1, 2, 3], "return_routed_experts": True}
    items, _ = normalize_generate({**body, "routed_experts_start_len": 2}, limits, list)
    assert items[0].routed_experts_start == 2
    for bad, words in ((-1, "is lower than 0"), (4, "is higher than the number of input tokens")):
        with pytest.raises(EngineError, match=words):
            normalize_generate({**body, "routed_experts_start_len": bad}, limits, list)
    assert normalize_generate({"input_ids": [1, 2, 3]}, limits, list)[0][0].routed_experts_start is None


def replay_cfg(**changes: object) -> Config:
    cfg = Config()
    cfg.model.tiny = TinyModelConfig(architecture="qwen3_moe")
    cfg.algo.routing_replay = True
    cfg.rollout.sglang.router = False
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section) if section != "megatron" else cfg.actor.megatron, name, value)
    return cfg


def test_preflight_refuses_what_cannot_replay() -> None:
    preflight.check_routing_replay(replay_cfg())
    dense = replay_cfg()
    dense.model.tiny.architecture = "qwen3"
    with pytest.raises(ConfigError, match="not a mixture-of-experts model") as e:
        preflight.check_routing_replay(dense)
    assert "algo.routing_replay: false" in e.value.fix
    routed = replay_cfg()
    routed.rollout.sglang.router = True
    with pytest.raises(ConfigError, match="sglang_router") as e:
        preflight.check_routing_replay(routed)
    assert "rollout.sglang.router: false" in e.value.fix
    with pytest.raises(ConfigError, match="multi-turn"):
        preflight.check_routing_replay(replay_cfg(rollout__tools=["calculator"]))
    with pytest.raises(ConfigError, match="partial_rollout"):
        preflight.check_routing_replay(replay_cfg(rollout__partial_rollout=True))
    recompute = replay_cfg(megatron__recompute=True)
    recompute.actor.backend = "megatron"
    preflight.check_routing_replay(recompute)  # one stage: each micro-batch's backward follows its forward
    recompute.actor.megatron.pipeline_model_parallel_size = 2
    with pytest.raises(ConfigError, match="recompute"):
        preflight.check_routing_replay(recompute)


def test_routing_for_another_model_is_refused_with_the_fix(tmp_path) -> None:
    """Routing the engines returned for a model other than the actor's (more MoE layers, or
    another top-k) is one named error, not a shape error deep in the forward."""
    import torch

    from rlhpc import moe_routing
    from rlhpc.model import build_tiny_model, load_model, routing_shape

    path = build_tiny_model(tmp_path / "moe", TinyModelConfig(architecture="qwen3_moe", seed=3))
    model = load_model(str(path))
    layers, top_k, _ = routing_shape(str(path))
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(RlhpcError, match="MoE layers") as raised:
        with moe_routing.replayed(model, torch.zeros(4, layers + 1, top_k, dtype=torch.int32)):
            model(ids)
    assert "serve the actor's model" in raised.value.fix
    with pytest.raises(RlhpcError, match="routing of shape"):
        with moe_routing.replayed(model, torch.zeros(4, layers, top_k + 1, dtype=torch.int32)):
            model(ids)


def test_sglang_records_the_routing_before_the_experts_whatever_their_quantization() -> None:
    """R3 with FP8 rollout (docs/guides/moe.md): SGLang captures each token's experts where its
    top-k picks them (``_post_process_topk_ids``, which every ``select_experts`` runs), before any
    quantized expert GEMM, and no quantization method reads the flag: the pair is not refused."""
    import zipfile

    assert "capture_routed_experts_if_allowed" in W.calls_in("sglang/srt/layers/moe/topk.py", "_post_process_topk_ids")
    assert "_post_process_topk_ids" in W.function_code("sglang/srt/layers/moe/topk.py", "select_experts")
    with zipfile.ZipFile(W.wheel_path()) as z:
        quant = [n for n in z.namelist() if n.startswith("sglang/srt/layers/quantization/") and n.endswith(".py")]
        assert "sglang/srt/layers/quantization/fp8.py" in quant
        reading = [n for n in quant if re.search(r"return_routed_experts|RETURN_ROUTED_EXPERTS", z.read(n).decode())]
    assert not reading, reading
