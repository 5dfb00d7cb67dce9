"""The reward model (issue 30): its config, its GPUs in the layout, its protocol against
SGLang's own sources, how a sample is rendered and how the score is mixed."""

from __future__ import annotations

import ast

import pytest
from support import sglang_wheel as sgl

from rlhpc.cluster.layout import describe_layout, idle_note, plan_layout, summarize_layout
from rlhpc.config import ClusterConfig, RewardModelConfig
from rlhpc.errors import ConfigError
from rlhpc.model import build_bpe_tokenizer, build_char_tokenizer
from rlhpc.preflight import config_from_dict
from rlhpc.rollout.reward_model import EMBEDDING_FLAG, render, reward_rollout_config
from rlhpc.rollout.scoring import MixedScorer, Sample, Scorer
from rlhpc.wire import protocol as P

TINY = {"model": {"tiny": {}}}


def _cfg(**sections):
    return config_from_dict({**TINY, **sections})


# ------------------------------------------------------------------ config


def test_absent_by_default():
    assert _cfg().reward_model is None
    assert _cfg().data.reward_weight == 1.0


def test_a_reward_model_takes_gpus_of_its_own_from_the_open_split():
    cfg = _cfg(cluster={"gpus_per_node": 4}, reward_model={"tiny": {}, "num_gpus": 2})
    assert (cfg.cluster.actor_num_gpus, cfg.cluster.rollout_num_gpus) == (1, 1)
    assert cfg.reward_model.tiny.hidden_size == 64


@pytest.mark.parametrize(
    "section, cluster, match",
    [
        ({}, {}, "exactly one of reward_model.path and reward_model.tiny"),
        ({"tiny": {}, "path": "/x"}, {}, "exactly one of"),
        (
            {"tiny": {}, "judge_parse": "support.judges:length"},
            {"gpus_per_node": 3},
            r"judge_parse.*(?s:.)*kind: judge",
        ),
        ({"tiny": {}, "num_gpus": 3, "gpus_per_engine": 2}, {"gpus_per_node": 8}, "whole number of engines"),
        ({"tiny": {}}, {}, r"after reward_model.num_gpus = 1 .* none is left for the actor"),
        ({"tiny": {}}, {"gpus_per_node": 2, "rollout_nodes": 1}, r"(?s)no cluster\.reward_nodes.*--reward-nodes N"),
        (
            {"tiny": {}, "num_gpus": 3},
            {"gpus_per_node": 2, "rollout_nodes": 1, "reward_nodes": 1},
            r"reward_model\.num_gpus = 3 but its component has 2 GPUs",
        ),  # fmt: skip
        (
            {"tiny": {}, "num_gpus": 4, "gpus_per_engine": 4},
            {"gpus_per_node": 2, "rollout_nodes": 1, "reward_nodes": 2, "reward_gpus_per_node": 2},
            r"gpus_per_engine = 4 > cluster\.reward_gpus_per_node = 2",
        ),  # fmt: skip
        (
            {"tiny": {}},
            {"gpus_per_node": 3, "reward_nodes": 1},
            r"cluster\.reward_nodes without cluster\.rollout_nodes",
        ),
        (
            {"tiny": {}},
            {"gpus_per_node": 3, "reward_partition": "score"},
            r"reward_partition is set but .*reward_nodes",
        ),
        (
            {"tiny": {}},
            {"gpus_per_node": 2, "rollout_nodes": 1, "reward_nodes": 1, "reward_partition": "a b"},
            "is not a partition name",
        ),  # fmt: skip
        ({"tiny": {}, "num_gpus": 4, "gpus_per_engine": 4}, {"gpus_per_node": 2, "num_nodes": 4}, "one node"),
        (
            {"tiny": {}, "num_gpus": 2, "gpus_per_engine": 2},
            {"gpus_per_node": 4, "num_nodes": 2, "actor_num_gpus": 2, "rollout_num_gpus": 1},
            "straddle two nodes",
        ),  # fmt: skip
        (
            {"tiny": {}, "num_gpus": 2},
            {"gpus_per_node": 4, "actor_num_gpus": 2, "rollout_num_gpus": 1},
            r"needs 5 GPUs .*reward model 2.* has 4",
        ),  # fmt: skip
        ({"tiny": {"hidden_size": 30}}, {"gpus_per_node": 3}, r"reward_model\.tiny\.hidden_size"),
    ],
)
def test_refused_with_the_key_and_the_fix(section, cluster, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(cluster=cluster, reward_model=section)


def test_a_reward_component_without_a_reward_model_is_refused():
    with pytest.raises(ConfigError, match="no reward_model: the reward component would sit idle"):
        _cfg(cluster={"gpus_per_node": 2, "rollout_nodes": 1, "reward_nodes": 1})


# ------------------------------------------------------------------ layout


def test_disaggregated_layout_has_a_third_group():
    rm = RewardModelConfig(path="/rm", num_gpus=2)
    layout = plan_layout(ClusterConfig(gpus_per_node=4), rm)
    assert layout.actor_slots == (0,) and layout.engine_slots == ((1,),) and layout.reward_slots == ((2,), (3,))
    assert layout.num_slots == 4
    summary = summarize_layout(layout)
    assert "2 reward engine(s)" in summary and "reward engines 0-1 on gpu2-3" in summary
    full = describe_layout(layout)
    assert "reward engine 0   (tp=1) -> node0:gpu2" in full and "reward engine 1   (tp=1) -> node0:gpu3" in full


def test_colocated_layout_keeps_the_reward_engines_off_the_shared_gpus():
    rm = RewardModelConfig(path="/rm", num_gpus=2, gpus_per_engine=2)
    layout = plan_layout(ClusterConfig(num_nodes=2, gpus_per_node=2, colocate=True), rm)
    assert layout.actor_slots == (0, 1) and layout.engine_slots == ((0,), (1,))
    assert layout.reward_slots == ((2, 3),) and layout.num_slots == 4
    assert "node1: reward engines 0 on gpu0-1" in summarize_layout(layout)


def test_a_heterogeneous_layout_puts_the_reward_engines_on_the_third_component():
    cfg = _cfg(
        cluster={"gpus_per_node": 2, "rollout_nodes": 2, "rollout_gpus_per_node": 1, "reward_nodes": 1,
                 "reward_gpus_per_node": 4},
        reward_model={"tiny": {}, "num_gpus": 4, "gpus_per_engine": 2},
    )  # fmt: skip
    c = cfg.cluster
    assert (c.actor_num_gpus, c.rollout_num_gpus) == (2, 2)  # the reward GPUs are not taken off the others
    assert c.component_nodes == (1, 2, 1) and c.node_gpus == (2, 1, 1, 4) and c.total_gpus == 8
    layout = plan_layout(c, cfg.reward_model)
    assert layout.reward_slots == ((4, 5), (6, 7)) and layout.slot_groups == (0, 0, 1, 1, 2, 2, 2, 2)
    assert [layout.slot_homes[s] for s in (4, 5, 6, 7)] == [(3, 0), (3, 1), (3, 2), (3, 3)]
    summary = summarize_layout(layout)
    assert "the actor, the engines and the reward engines on components of their own" in summary
    assert "node3: reward engines 0-1 on gpu0-3" in summary
    assert "reward engine 1   (tp=2) -> node3:gpu2, node3:gpu3" in describe_layout(layout)


def test_the_idle_note_names_the_reward_components_unused_gpus():
    cfg = _cfg(
        cluster={"gpus_per_node": 2, "rollout_nodes": 1, "reward_nodes": 1, "reward_gpus_per_node": 3},
        reward_model={"tiny": {}},
    )
    assert "the reward model uses 1 of its component's 3" in idle_note(cfg.cluster, cfg.reward_model)


def test_no_reward_model_no_third_group():
    layout = plan_layout(ClusterConfig(gpus_per_node=4))
    assert layout.reward_slots == () and "reward" not in summarize_layout(layout) + describe_layout(layout)


# ------------------------------------------------------------------ protocol, pinned against SGLang's sources


def test_classify_takes_an_embedding_request_and_answers_its_scores_under_embedding():
    assert sgl.http_routes()[P.Route.CLASSIFY] == P.EmbeddingReqInput.__name__
    # the tokenizer manager's answer to an embedding (and so a /classify) request
    answers = [
        {k.value for k in node.keys if isinstance(k, ast.Constant)}
        for node in ast.walk(ast.parse(sgl.source(sgl.TOKENIZER_MANAGER)))
        if isinstance(node, ast.Dict)
    ]
    assert {P.EMBEDDING, "meta_info"} in answers


def test_reward_engines_are_launched_as_embedding_models():
    assert EMBEDDING_FLAG in sgl.server_flags()
    cfg = _cfg(cluster={"gpus_per_node": 3}, reward_model={"tiny": {}, "backend": "sglang", "extra_args": ["--x"]})
    r = reward_rollout_config(cfg.rollout, cfg.reward_model)
    assert r.backend == "sglang" and not r.sglang.router and r.sglang.extra_args == [EMBEDDING_FLAG, "--x"]
    assert r.sglang.mem_fraction_static == cfg.reward_model.mem_fraction_static


# ------------------------------------------------------------------ rendering and mixing


def test_render_uses_the_reward_models_chat_template():
    tok = build_bpe_tokenizer()
    s = Sample(prompt="1+2=", response="3", label="3")
    ids = render(tok, s)
    assert tok.decode(ids) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"
    chat = Sample(prompt="ignored", response="3", label="3", messages=[{"role": "user", "content": "1+2="}])
    assert render(tok, chat) == ids


def test_render_without_a_template_is_the_plain_text_with_special_tokens():
    tok = build_char_tokenizer()
    ids = render(tok, Sample(prompt="1+2=", response="3", label="3"))
    assert ids[0] == tok.bos_token_id and "".join(tok.convert_ids_to_tokens(ids[1:])) == "1+2=3"


def test_mixed_score_is_the_weighted_sum_and_each_component_is_a_part():
    rule = Scorer(lambda p, r, a: {"score": float(r == a), "format": 0.5}, "rule")
    samples = [Sample(prompt="p", response=r, label="1") for r in ("1", "2", "1")]
    mixed = MixedScorer(rule, 0.5, {"reward_model": (2.0, lambda ss: [10.0 * i for i in range(len(ss))])})
    scores, parts = mixed(samples)
    assert scores == [0.5, 20.0, 40.5]
    assert parts == {"format": [0.5] * 3, "rule": [1.0, 0.0, 1.0], "reward_model": [0.0, 10.0, 20.0]}


def test_the_dry_run_shows_the_third_group_and_the_reward_engines_launch_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(repo / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(run), "--nodes", "1",
         "--gpus-per-node", "8", "--set", "rollout.backend=sglang", "--set", "reward_model.tiny.seed=1",
         "--set", "reward_model.num_gpus=2", "--set", "reward_model.backend=sglang"],
        capture_output=True, text=True, timeout=120, cwd=repo,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "3 actor rank(s), 3 engine(s) (tp=1), 2 reward engine(s)" in p.stdout
    assert "node0: actor ranks 0-2 on gpu0-2; engines 0-2 on gpu3-5; reward engines 0-1 on gpu6-7" in p.stdout
    line = p.stdout.split("reward engine 0's launch line (each reward engine's alike):\n", 1)[1].splitlines()[0]
    assert "--model-path <run dir>/reward_model" in line and line.endswith(EMBEDDING_FLAG)
    assert not run.exists()  # a dry run writes nothing


# ------------------------------------------------------------------ every entry point scores alike


def test_a_generation_for_a_run_with_a_reward_model_needs_its_engines():
    """rlhpc-eval once built its Generation by hand and scored without the run's reward model:
    the builder refuses a reward_model section it is given no engines for."""
    from rlhpc.errors import RlhpcError
    from rlhpc.rollout.build import build_generation

    cfg = _cfg(cluster={"gpus_per_node": 4}, reward_model={"tiny": {}, "num_gpus": 1})
    with pytest.raises(RlhpcError, match="no reward model engines were given"):
        build_generation(cfg, build_char_tokenizer(), lambda requests, done: [])


def test_every_entry_point_builds_its_generation_with_the_builder():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    by_hand = []
    for path in [*(root / "rlhpc").rglob("*.py"), *(root / "tools").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Generation":
                by_hand.append(f"{path.relative_to(root)}:{node.lineno}")
    assert [p.split(":")[0] for p in by_hand] == ["rlhpc/rollout/build.py"], by_hand
