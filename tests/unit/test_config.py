"""Config loading: types, unknown keys, cross-field checks; each error names key and fix."""

import pytest

from rlhpc.config import dump_config, load_config
from rlhpc.errors import ConfigError

TINY = ["model.tiny={}"]


def error(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, TINY + overrides)
    assert e.value.fix  # every error says how to fix it
    return str(e.value)


def test_defaults_and_overrides_are_typed(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  temperature: 1\n  num_rollout: 7\nactor:\n  adam_betas: [0.8, 0.9]\n")
    cfg = load_config(f, TINY + ["rollout.top_p=0.5", "deterministic=true", "eval.interval=null"])
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.rollout.num_rollout == 7 and cfg.rollout.top_p == 0.5
    assert cfg.actor.adam_betas == (0.8, 0.9)
    assert cfg.deterministic is True and cfg.eval.interval is None
    assert cfg.model.tiny.hidden_size == 64


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, TINY + ["cluster.colocate=true"])
    f = tmp_path / "resolved.yaml"
    f.write_text(dump_config(cfg))
    assert load_config(f) == cfg


def test_unknown_key_suggests_the_right_one():
    msg = error(["rollout.num_rollouts=3"])
    assert "rollout.num_rollouts" in msg and "did you mean rollout.num_rollout" in msg


def test_unknown_section():
    assert "unknown config key 'rolout'" in error(["rolout.num_rollout=3"])


def test_wrong_type_names_key():
    msg = error(["rollout.n_samples_per_prompt=many"])
    assert "rollout.n_samples_per_prompt must be int" in msg


def test_bool_is_not_an_int():
    assert "cluster.actor_num_gpus must be int" in error(["cluster.actor_num_gpus=true"])


def test_literal_choices():
    assert "'fast'" in error(["checkpoint.resume=fast"])


def test_layout_needing_more_gpus_than_the_job_has():
    msg = error(["cluster.actor_num_gpus=4", "cluster.rollout_num_gpus=4", "cluster.gpus_per_node=4"])
    assert "needs 8 GPUs" in msg and "has 4" in msg


def test_colocate_with_more_rollout_than_actor_gpus():
    assert "colocate" in error(["cluster.colocate=true", "cluster.rollout_num_gpus=2", "cluster.gpus_per_node=4"])


def test_engine_tp_must_divide_rollout_gpus():
    assert "multiple of" in error(
        ["cluster.rollout_num_gpus=3", "cluster.rollout_gpus_per_engine=2", "cluster.gpus_per_node=8"]
    )


def test_missing_data_file(tmp_path):
    assert "data.train_file" in error([f"data.train_file={tmp_path}/nope.jsonl"])


def test_model_path_without_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config(None, [f"model.path={tmp_path}"])


def test_exactly_one_model_source():
    with pytest.raises(ConfigError, match="exactly one of model.path and model.tiny"):
        load_config(None, [])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")


def test_invalid_yaml(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)


def test_set_without_equals():
    assert "KEY=VALUE" in error(["rollout.num_rollout"])


def test_reward_plugin_must_import():
    assert "cannot be imported" in error(["data.reward=no_such_module:fn"])


def test_keep_last_at_least_two():
    assert "keep at least two" in error(["checkpoint.keep_last=1"])


def test_shipped_configs_load():
    from pathlib import Path

    for f in sorted((Path(__file__).resolve().parents[2] / "jobs" / "configs").glob("*.yaml")):
        load_config(f)


def test_megatron_layout_errors():
    megatron = ["actor.backend=megatron", "cluster.gpus_per_node=4", "cluster.actor_num_gpus=3"]
    assert "does not divide cluster.actor_num_gpus = 3" in error(
        [*megatron, "actor.megatron.tensor_model_parallel_size=2"]
    )
    msg = error([*megatron, "cluster.actor_num_gpus=4", "actor.megatron.tensor_model_parallel_size=4",
                 "cluster.gpus_per_node=2", "cluster.num_nodes=4"])  # fmt: skip
    assert "across nodes" in msg
    # the tiny model has 4 heads and 2 key/value heads: TP=4 cannot split the kv heads
    msg = error(["actor.backend=megatron", "cluster.gpus_per_node=5", "cluster.actor_num_gpus=4",
                 "actor.megatron.tensor_model_parallel_size=4"])  # fmt: skip
    assert "key/value heads (2)" in msg
    cfg = load_config(None, [*TINY, "actor.backend=megatron", "cluster.gpus_per_node=3", "cluster.actor_num_gpus=2",
                             "actor.megatron.tensor_model_parallel_size=2"])  # fmt: skip
    assert cfg.actor.megatron.tensor_model_parallel_size == 2


def test_sglang_options_are_checked():
    assert "must be in (0, 1)" in error(["rollout.backend=sglang", "rollout.sglang.mem_fraction_static=1.5"])
    assert "rollout.sglang.extra_args[0] must be str" in error(["rollout.sglang.extra_args=[7]"])
    cfg = load_config(None, [*TINY, "rollout.backend=sglang", "rollout.sglang.extra_args=[--dtype, bfloat16]"])
    assert cfg.rollout.sglang.extra_args == ["--dtype", "bfloat16"]
