"""Config loading: types, unknown keys, cross-field checks; each error names key and fix."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhpc.config import dump_config
from rlhpc.errors import ConfigError
from rlhpc.preflight import load_config

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


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    # PyYAML reads 1e-4 as a string; the docs' `--sweep actor.lr=1e-4,3e-4` (docs/guides/sweeps.md) must still work
    f = tmp_path / "c.yaml"
    f.write_text("actor:\n  adam_eps: 1E-6\n")
    cfg = load_config(f, [*TINY, "actor.lr=1e-4", "actor.weight_decay=+2.5e-2"])
    assert (cfg.actor.lr, cfg.actor.adam_eps, cfg.actor.weight_decay) == (1e-4, 1e-6, 0.025)
    assert "rollout.n_samples_per_prompt must be int" in error(["rollout.n_samples_per_prompt=1e2"])


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
    assert "colocate" in error(
        ["cluster.colocate=true", "cluster.actor_num_gpus=1", "cluster.rollout_num_gpus=2", "cluster.gpus_per_node=4"]
    )


def test_colocated_engines_on_several_nodes_are_refused():
    """A colocated push hands each engine a handle of actor rank 0's buffer (CUDA IPC, or shared
    memory on CPU): no other node can open it. Engines on rank 0's node alone may colocate."""
    msg = error(["cluster.colocate=true", "cluster.num_nodes=2", "cluster.gpus_per_node=2"])
    assert "the engines would span nodes" in msg and "drop cluster.colocate" in msg
    one_node = ["cluster.colocate=true", "cluster.num_nodes=2", "cluster.gpus_per_node=2", "cluster.rollout_num_gpus=2"]
    assert load_config(None, TINY + one_node).cluster.split() == (4, 2)


def test_engine_tp_must_divide_rollout_gpus():
    assert "multiple of" in error(
        ["cluster.rollout_num_gpus=3", "cluster.rollout_gpus_per_engine=2", "cluster.gpus_per_node=8"]
    )


def test_missing_data_file(tmp_path):
    assert "data.train_file" in error([f"data.train_file={tmp_path}/nope.jsonl"])


def test_model_path_without_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config(None, [f"model.path={tmp_path}"])


def test_exactly_one_model_source(tmp_path):
    with pytest.raises(ConfigError, match="neither model.path nor model.tiny is set"):
        load_config(None, [])
    # a model of one's own on the default config, which builds a tiny one (issue 42, item 11): the
    # fix says what to add, and what it says works
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    default = REPO / "jobs" / "configs" / "embedded.yaml"
    with pytest.raises(ConfigError, match="model.path .* and model.tiny are both set") as e:
        load_config(default, [f"model.path={tmp_path}"])
    assert "--set model.tiny=null" in e.value.fix
    from rlhpc import config  # the config's own rules: the model's weights are not read here

    cfg = config.load_config(default, [f"model.path={tmp_path}", "model.tiny=null"])
    assert cfg.model.path == str(tmp_path) and cfg.model.tiny is None


@pytest.mark.parametrize(
    ("typed", "says"),
    [
        ("data.train_batch_size=64", "verl's data.train_batch_size is rlhpc's rollout.rollout_batch_size"),
        ("rollout.n=8", "verl's actor_rollout_ref.rollout.n is rlhpc's rollout.n_samples_per_prompt"),
        ("data.max_response_length=512", "verl's data.max_response_length is rlhpc's rollout.max_new_tokens"),
        ("actor_rollout_ref.actor.optim.lr=1e-6", "verl's actor_rollout_ref.actor.optim.lr is rlhpc's actor.lr"),
        ("actor_rollout_ref.rollout.n=8", "verl's actor_rollout_ref.rollout.n is rlhpc's rollout.n_samples_per_prompt"),
        ("actor_rollout_ref.hybrid_engine=true", "actor_rollout_ref is verl's section"),
        ("trainer.total_epochs=3", "verl's trainer.total_epochs is rlhpc's rollout.num_epoch"),
        ("n_samples_per_prompt=8", "slime's --n-samples-per-prompt is rlhpc's rollout.n_samples_per_prompt"),
        ("global-batch-size=64", "slime's --global-batch-size is rlhpc's actor.num_steps_per_rollout"),
    ],
)
def test_verl_and_slime_key_names_get_rlhpcs(typed, says):
    """verl's and slime's names for rlhpc's keys are answered from one table (rlhpc.foreign_keys,
    shown in docs/guides/coming-from-verl.md), not with the nearest spelling (issue 42, item 10:
    data.train_batch_size got "did you mean data.train_file?")."""
    msg = " ".join(error([typed]).split())
    assert says in msg and "did you mean" not in msg and "docs/guides/coming-from-verl.md" in msg


def test_every_key_the_foreign_table_names_is_a_key_of_rlhpc():
    from rlhpc.cli.config_reference import blocks
    from rlhpc.foreign_keys import KEYS

    ours = {k.key for b in blocks() for k in b.keys}
    assert not [k.rlhpc for k in KEYS if k.rlhpc is not None and k.rlhpc not in ours]
    assert {k.framework for k in KEYS} == {"verl", "slime"} and len({(k.framework, k.key) for k in KEYS}) == len(KEYS)


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
        if "path" not in yaml.safe_load(f.read_text())["model"]:  # the recipes: tests/unit/test_recipes.py
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
    # pipeline stages: TP x PP divides the actor GPUs, PP the (tiny model's 2) layers, EP what is left for DP
    pp = [
        *megatron,
        "cluster.gpus_per_node=8",
        "cluster.actor_num_gpus=6",
        "actor.megatron.pipeline_model_parallel_size=2",
    ]
    assert "2 x 2 does not divide cluster.actor_num_gpus = 6" in error(
        [*pp, "actor.megatron.tensor_model_parallel_size=2"]
    )
    assert "does not divide the model's 2 layers" in error([*pp, "actor.megatron.pipeline_model_parallel_size=3"])
    assert "does not divide the data-parallel size 3 (cluster.actor_num_gpus / (TP x PP))" in error(
        [*pp, "model.tiny.architecture=qwen3_moe", "actor.megatron.expert_model_parallel_size=2"]
    )
    assert load_config(None, [*TINY, *pp]).actor.megatron.pipeline_model_parallel_size == 2
    assert "measured outside the pipeline schedule" in error([*pp, "algo.kl_coef=0.1", "algo.kl_in_reward=true"])
    # virtual stages: PP > 1, at least 2 chunks, PP x VP divides the layers
    vp = "actor.megatron.virtual_pipeline_model_parallel_size"
    assert "needs pipeline_model_parallel_size > 1" in error([*megatron, f"{vp}=2"])
    assert "must be >= 2" in error([*pp, f"{vp}=1"])
    assert "2 x 2 does not divide the model's 2 layers" in error([*pp, f"{vp}=2"])
    four = [*pp, "model.tiny.num_hidden_layers=4", f"{vp}=2"]
    assert load_config(None, [*TINY, *four]).actor.megatron.virtual_pipeline_model_parallel_size == 2


def test_kl_knobs_need_a_kl_penalty():
    msg = error(["algo.kl_in_reward=true"])
    assert "algo.kl_in_reward = True is true but algo.kl_coef = 0" in msg and "set algo.kl_coef" in msg
    msg = error(["algo.ref_update_interval=4"])
    assert "algo.ref_update_interval = 4 is set but algo.kl_coef = 0" in msg
    assert "algo.ref_update_interval = -1 must be >= 0" in error(["algo.kl_coef=0.1", "algo.ref_update_interval=-1"])
    cfg = load_config(None, [*TINY, "algo.kl_coef=0.1", "algo.kl_in_reward=true", "algo.ref_update_interval=4"])
    assert cfg.algo.kl_loss_coef == 0.0 and cfg.algo.needs_reference
    # the megatron actor cannot reset its reference: refused at submit, not at the first reset
    msg = error(["actor.backend=megatron", "algo.kl_coef=0.1", "algo.ref_update_interval=4"])
    assert "actor.backend = megatron" in msg and "actor.backend: torch" in msg


def test_sglang_options_are_checked():
    assert "must be in (0, 1)" in error(["rollout.backend=sglang", "rollout.sglang.mem_fraction_static=1.5"])
    assert "rollout.sglang.extra_args[0] must be str" in error(["rollout.sglang.extra_args=[7]"])
    assert "no text" in error(["rollout.backend=sglang", "rollout.sglang.extra_args=[--skip-tokenizer-init]"])
    cfg = load_config(None, [*TINY, "rollout.backend=sglang", "rollout.sglang.extra_args=[--dtype, bfloat16]"])
    assert cfg.rollout.sglang.extra_args == ["--dtype", "bfloat16"]


# ---------------------------------------------------------------- each section checks its own values

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = REPO / "jobs" / "configs" / "embedded.yaml"

REFUSED = [
    # (override, what the message must say: the full key, its value and the rule)
    ("logging.level=verbose", "logging.level = 'verbose' is not a logging level"),
    ("logging.level=info", "logging.level = 'info' is not a logging level"),
    ("eval.n_samples_per_prompt=0", "eval.n_samples_per_prompt = 0 must be >= 1"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens = 0 must be >= 1"),
    ("eval.temperature=-0.5", "eval.temperature = -0.5 must be >= 0"),
    ("checkpoint.max_starts_without_progress=0", "checkpoint.max_starts_without_progress = 0 must be >= 1"),
    ("checkpoint.max_restarts=-1", "checkpoint.max_restarts = -1 must be >= 0"),
    ("rollout.temperature=-1.0", "rollout.temperature = -1.0 must be >= 0"),
    ("rollout.top_p=0", "rollout.top_p = 0.0 must be in (0, 1]"),
    ("rollout.top_p=1.5", "rollout.top_p = 1.5 must be in (0, 1]"),
    ("rollout.engine_startup_timeout_s=0", "rollout.engine_startup_timeout_s = 0.0 must be > 0"),
    ("cluster.ray_start_timeout_s=-5", "cluster.ray_start_timeout_s = -5.0 must be > 0"),
    ("actor.lr=-0.001", "actor.lr = -0.001 must be >= 0"),
    ("actor.weight_decay=-0.1", "actor.weight_decay = -0.1 must be >= 0"),
    ("actor.grad_clip=0", "actor.grad_clip = 0.0 must be > 0"),
    ("actor.adam_eps=0", "actor.adam_eps = 0.0 must be > 0"),
    ("actor.call_timeout_s=0", "actor.call_timeout_s = 0.0 must be > 0"),
    ("actor.call_timeout_s=-1", "actor.call_timeout_s = -1.0 must be > 0"),
    ("actor.call_timeout_s=.inf", "actor.call_timeout_s = inf is not a finite number"),
    ("actor.stop_wait_s=0", "actor.stop_wait_s = 0.0 must be > 0"),
    ("actor.start_timeout_s=0", "actor.start_timeout_s = 0.0 must be > 0"),
    ("actor.adam_betas=[0.9, 1.0]", "actor.adam_betas[1] = 1.0 must be in [0, 1)"),
    ("actor.adam_betas=[-0.1, 0.9]", "actor.adam_betas[0] = -0.1 must be in [0, 1)"),
    ("data.num_train=0", "data.num_train = 0 must be >= 1"),
    ("data.num_eval=0", "data.num_eval = 0 must be >= 1"),
    ("algo.eps_clip=-0.1", "algo.eps_clip = -0.1 must be >= 0"),
    ("algo.eps_clip_high=-0.1", "algo.eps_clip_high = -0.1 must be >= 0"),
    ("algo.kl_coef=-0.01", "algo.kl_coef = -0.01 must be >= 0"),
    ("algo.entropy_coef=-0.01", "algo.entropy_coef = -0.01 must be >= 0"),
    ("algo.gspo_eps_clip=-1e-4", "algo.gspo_eps_clip = -0.0001 must be >= 0"),
    ("algo.gspo_eps_clip_high=-1e-4", "algo.gspo_eps_clip_high = -0.0001 must be >= 0"),
    ("algo.loss_agg_mode=seq-mean", "algo.loss_agg_mode = 'seq-mean' is not one of 'token-mean' | "),
    ("algo.policy_loss=dapo", "algo.policy_loss = 'dapo' is not one of 'ppo_clip' | 'gspo' | 'cispo'"),
    ("algo.kl_estimator=k4", "algo.kl_estimator = 'k4' is not one of 'k1' | 'k2' | 'k3' | 'low_var_kl'"),
    ("algo.advantage_estimator=reinforce", "algo.advantage_estimator = 'reinforce' is not one of"),
    ("actor.lr=.nan", "actor.lr = nan is not a finite number"),
    ("algo.kl_coef=.nan", "algo.kl_coef = nan is not a finite number"),
    ("rollout.temperature=.inf", "rollout.temperature = inf is not a finite number"),
    ("cluster.ray_start_timeout_s=.inf", "cluster.ray_start_timeout_s = inf is not a finite number"),
    ("actor.adam_betas=[.nan, 0.9]", "actor.adam_betas[0] = nan is not a finite number"),
    ("model.tiny.hidden_size=-8", "model.tiny.hidden_size = -8 must be >= 1"),
    ("model.tiny.intermediate_size=0", "model.tiny.intermediate_size = 0 must be >= 1"),
    ("model.tiny.num_hidden_layers=0", "model.tiny.num_hidden_layers = 0 must be >= 1"),
    ("model.tiny.num_attention_heads=0", "model.tiny.num_attention_heads = 0 must be >= 1"),
    ("model.tiny.num_key_value_heads=0", "model.tiny.num_key_value_heads = 0 must be >= 1"),
    ("model.tiny.max_position_embeddings=0", "model.tiny.max_position_embeddings = 0 must be >= 1"),
    ("model.tiny.hidden_size=66", "model.tiny.hidden_size = 66 is not divisible by model.tiny.num_attention_heads"),
    ("model.tiny.hidden_size=60", "model.tiny.num_attention_heads = 15 is odd"),
    ("model.tiny.num_key_value_heads=3", "model.tiny.num_attention_heads = 4 is not divisible by"),
    ("model.tiny.architecture=gpt2", "model.tiny.architecture = 'gpt2' is not one of 'llama' | 'qwen2' | 'qwen3'"),
    ("model.tiny.num_experts_per_tok=5", "model.tiny.num_experts_per_tok = 5 is above model.tiny.num_experts = 4"),
]


@pytest.mark.parametrize("override,message", REFUSED, ids=[o for o, _ in REFUSED])
def test_section_values_are_refused_naming_the_key(override, message):
    assert message in error([override])


def test_sections_check_themselves_when_built_in_code():
    from rlhpc.config import Config, RolloutConfig, TinyModelConfig, validate

    with pytest.raises(ConfigError, match=r"rollout\.temperature = -1\.0 must be >= 0"):
        RolloutConfig(temperature=-1.0)
    with pytest.raises(ConfigError, match=r"model\.tiny\.hidden_size = -8"):
        TinyModelConfig(hidden_size=-8)
    cfg = Config(model=load_config(None, TINY).model)
    validate(cfg)
    cfg.rollout.temperature = -1.0  # assigned after construction: validate() still catches it
    with pytest.raises(ConfigError, match=r"rollout\.temperature"):
        validate(cfg)


def test_each_section_knows_its_place_in_the_config():
    """Errors name a section's keys by its SECTION; it must be where Config puts the section."""
    import dataclasses
    import typing

    from rlhpc.config import Config, Section

    def walk(cls, where):
        for f in dataclasses.fields(cls):
            for tp in (typing.get_type_hints(cls)[f.name], *typing.get_args(typing.get_type_hints(cls)[f.name])):
                if isinstance(tp, type) and issubclass(tp, Section):
                    assert tp.SECTION == f"{where}{f.name}", tp
                    walk(tp, f"{where}{f.name}.")

    walk(Config, "")


def test_defaults_and_the_embedded_config_still_load():
    from rlhpc.config import Config, RolloutConfig

    Config()  # no model yet: valid to build, validate() asks for one
    assert RolloutConfig().temperature == 1.0
    cfg = load_config(EMBEDDED)
    assert cfg.model.tiny.hidden_size == 64 and cfg.logging.level == "INFO"
    assert load_config(None, TINY).actor.lr == 1e-3


# ---------------------------------------------------------------- unreadable config files and --set values


def test_set_on_a_scalar_config_file(tmp_path):
    f = tmp_path / "scalar.yaml"
    f.write_text("3\n")
    with pytest.raises(ConfigError, match="holds a single value, not a mapping of sections"):
        load_config(f, ["seed=1"])


def test_config_file_not_utf8(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("data:\n  task: r\xe9verse\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(f)


def test_config_is_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_set_value_that_is_not_yaml():
    assert "not valid YAML" in error(["rollout.sglang.extra_args=[--dtype"])


def test_set_under_a_section_left_empty_in_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  tiny:\n")
    assert load_config(f, ["model.tiny.hidden_size=32"]).model.tiny.hidden_size == 32


def test_reading_a_config_imports_neither_torch_nor_transformers(tmp_path):
    """The login node validates configs: that must not pay for (or need) torch."""
    import rlhpc

    env = {**os.environ, "PYTHONPATH": str(Path(rlhpc.__file__).resolve().parents[1])}  # this rlhpc, not cwd's
    code = (
        "import sys\n"
        "from rlhpc.preflight import load_config\n"
        f"load_config({str(EMBEDDED)!r})\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True)


def test_async_generation_is_refused_on_shared_gpus():
    msg = error(["rollout.max_staleness=1", "cluster.colocate=true"])
    assert "rollout.max_staleness = 1" in msg and "cluster.colocate" in msg and "share the same GPUs" in msg
    assert "rollout.max_staleness=0" in msg  # the fix names what to set
    assert "cluster.offload" in error(["rollout.max_staleness=2", "cluster.offload=true"])
    assert "must be >= 0" in error(["rollout.max_staleness=-1"])


def test_async_generation_defaults_off_and_loads_disaggregated():
    assert load_config(None, TINY).rollout.max_staleness == 0
    assert load_config(None, TINY + ["rollout.max_staleness=2"]).rollout.max_staleness == 2
    assert load_config(None, TINY + ["cluster.colocate=true"]).rollout.max_staleness == 0


def test_tis_keys():
    cfg = load_config(None, TINY)
    assert cfg.algo.tis is False and cfg.algo.tis_clip == 2.0
    assert load_config(None, TINY + ["algo.tis=true", "algo.tis_clip=1.5"]).algo.tis_clip == 1.5
    assert "algo.tis_clip" in error(["algo.tis_clip=0"])


def test_loss_keys_default_to_the_old_behaviour_and_take_every_choice():
    algo = load_config(None, TINY).algo
    assert (algo.policy_loss, algo.loss_agg_mode, algo.kl_estimator) == ("ppo_clip", "token-mean", "k3")
    assert algo.entropy_coef == 0.0 and (algo.gspo_eps_clip, algo.gspo_eps_clip_high) == (3e-4, 4e-4)
    sets = [
        "algo.policy_loss=gspo",
        "algo.loss_agg_mode=seq-mean-token-sum-norm",
        "algo.kl_estimator=low_var_kl",
        "algo.entropy_coef=0.001",
        "algo.advantage_estimator=reinforce_plus_plus_baseline",
    ]
    algo = load_config(None, TINY + sets).algo
    assert (algo.policy_loss, algo.loss_agg_mode, algo.kl_estimator) == (
        "gspo",
        "seq-mean-token-sum-norm",
        "low_var_kl",
    )
    assert algo.entropy_coef == 0.001 and algo.advantage_estimator == "reinforce_plus_plus_baseline"


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus_baseline"])
def test_a_group_baseline_needs_two_samples_per_prompt(estimator):
    message = error([f"algo.advantage_estimator={estimator}", "rollout.n_samples_per_prompt=1"])
    assert f"algo.advantage_estimator = '{estimator}' needs rollout.n_samples_per_prompt >= 2" in message
    # the batch-wide baseline has no groups: one sample per prompt is fine
    load_config(None, TINY + ["algo.advantage_estimator=reinforce_plus_plus", "rollout.n_samples_per_prompt=1"])


def test_actor_call_timeout_key():
    from rlhpc.config import ActorConfig

    assert load_config(None, TINY).actor.call_timeout_s == 3600.0  # generous: a whole train step or save
    cfg = load_config(None, TINY + ["actor.call_timeout_s=90"])
    assert cfg.actor.call_timeout_s == 90.0 and isinstance(cfg.actor.call_timeout_s, float)
    with pytest.raises(ConfigError, match=r"actor\.call_timeout_s = 0 must be > 0"):
        ActorConfig(call_timeout_s=0)


def test_a_start_has_its_own_limit():
    """The calls of a start (the ranks up, the checkpoint read, the weight channel) wait up to
    actor.start_timeout_s; every other call up to actor.call_timeout_s. (test_hang: a rank
    SIGSTOPped mid-run is cut at a call_timeout_s its starts could not keep to.)"""
    from rlhpc.actor.group import START_CALLS, ActorGroup

    cfg = load_config(None, TINY + ["actor.call_timeout_s=15", "actor.start_timeout_s=900"])
    group = ActorGroup.__new__(ActorGroup)  # the limits alone: no ranks started
    group.call_timeout_s, group.start_timeout_s = cfg.actor.call_timeout_s, cfg.actor.start_timeout_s
    assert START_CALLS == {"rendezvous", "init_process_group", "load", "connect_rollout"}
    for method in START_CALLS:
        assert group.limit_of(method) == (900.0, "actor.start_timeout_s")
    for method in ("train", "train_and_push", "save", "snapshot", "update_weights", "offload", "onload"):
        assert group.limit_of(method) == (15.0, "actor.call_timeout_s")
    assert load_config(None, TINY).actor.start_timeout_s == 3600.0


def test_partial_rollouts_need_the_async_pipeline_and_no_determinism():
    msg = error(["rollout.partial_rollout=true"])
    assert "rollout.partial_rollout" in msg and "max_staleness >= 1" in msg
    msg = error(["rollout.partial_rollout=true", "rollout.max_staleness=1", "deterministic=true"])
    assert "timing" in msg and "rollout.partial_rollout=false" in msg
    cfg = load_config(None, [*TINY, "rollout.partial_rollout=true", "rollout.max_staleness=1"])
    assert cfg.rollout.partial_rollout and cfg.rollout.dynamic_sampling.filter is None


def test_dynamic_sampling_filter_and_sizes_are_checked():
    cfg = load_config(None, [*TINY, "rollout.dynamic_sampling.filter=nonzero_std"])
    assert cfg.rollout.dynamic_sampling.filter == "nonzero_std"
    assert "neither a built-in filter" in error(["rollout.dynamic_sampling.filter=no_such"])
    msg = error(["rollout.dynamic_sampling.filter=no_such_module_xyz:keep"])
    assert "rollout.dynamic_sampling.filter" in msg and "cannot be imported" in msg
    assert "not callable" in error(["rollout.dynamic_sampling.filter=rlhpc.wire.protocol:SGLANG_VERSION"])
    msg = error(["rollout.rollout_batch_size=8", "rollout.dynamic_sampling.over_sampling_batch_size=4"])
    assert "over_sampling_batch_size = 4 < rollout.rollout_batch_size = 8" in msg
    assert "must be >= 1" in error(["rollout.dynamic_sampling.max_rounds=0"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.max_new_tokens=100000"],
            "rollout.max_new_tokens = 100000 + a prompt token exceeds the model's context",
        ),
        (["eval.max_new_tokens=128"], "at most 127"),
        (["data.max_prompt_tokens=100", "rollout.max_new_tokens=40"], "lower data.max_prompt_tokens"),
    ],
)
def test_requests_longer_than_the_models_context_are_refused_at_load(overrides, message):
    # Issue 32, item 6: the tiny model's context is 128 tokens; SGLang refuses prompt + new > context.
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, TINY + overrides)
    load_config(None, TINY + ["data.max_prompt_tokens=100", "rollout.max_new_tokens=28"])  # exactly fits


def test_the_config_module_imports_nothing_of_rlhpc_but_its_errors_and_util(tmp_path):
    """rlhpc.config is the bottom of the house: a spec is checked where it is resolved, not here.
    (Beside them, the table of verl's and slime's key names, plain data, which its errors read.)"""
    import rlhpc

    env = {**os.environ, "PYTHONPATH": str(Path(rlhpc.__file__).resolve().parents[1])}
    code = (
        "import json, sys\nimport rlhpc.config\nprint(json.dumps([m for m in sys.modules if m.startswith('rlhpc.')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True)
    loaded = json.loads(out.stdout)
    ok = ("rlhpc.config", "rlhpc.errors", "rlhpc.foreign_keys")
    assert loaded and all(m in ok or m.startswith("rlhpc.util") for m in loaded), loaded


def test_the_config_alone_checks_no_code_the_preflight_checks_it_all():
    from rlhpc import config

    cfg = config.load_config(None, [*TINY, "data.reward=nowhere:fn", "data.task=nope"])  # no import, no registry
    assert cfg.data.reward == "nowhere:fn"
    msg = error(["data.task=nope"])
    assert "data.task = 'nope' is not a known task" in msg and "digit_sum" in msg
    assert "nowhere" in error(["data.reward=nowhere:fn"])


def test_the_preflight_runs_every_step_of_the_configs_own_rules_in_their_order(monkeypatch):
    """A rule added to rlhpc.config.validate reaches every entry point only through the preflight:
    each of validate's steps is called by the preflight, in validate's order, and a step that
    refuses the config stops the preflight with its own error (not one it ignored)."""
    import functools
    import inspect

    from rlhpc import config, preflight

    calls: list[str] = []
    depth = [0]

    def spy(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if depth[0] == 0:  # a step the caller takes, not one of the step's own helpers
                calls.append(name)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    own = {n: f for n, f in vars(config).items() if inspect.isfunction(f) and f.__module__ == config.__name__}
    for name, fn in own.items():
        monkeypatch.setattr(config, name, spy(name, fn))

    def steps(check) -> list[str]:
        cfg = config.load_config(None, TINY)  # the config's own loading, not spied
        calls.clear()
        check(cfg)
        return list(calls)

    validated = steps(config.validate)
    assert validated[0] == "validate" and len(validated) == 1  # its steps ran beneath it
    rules = steps(own["validate"])  # the unspied validate: its steps are the calls it makes
    assert len(rules) >= 8, rules
    taken = iter(steps(preflight.check))
    assert all(rule in taken for rule in rules), (rules, steps(preflight.check))  # a subsequence: in order

    for rule in dict.fromkeys(rules):
        with monkeypatch.context() as m:

            def refuse(*args, rule=rule, **kwargs):
                raise ConfigError(f"refused by {rule}", "a test's")

            cfg = config.load_config(None, TINY)
            m.setattr(config, rule, refuse)
            with pytest.raises(ConfigError, match=f"^refused by {rule}\\n"):
                preflight.check(cfg)
