"""Where SGLang 0.5.23 is strict, read in its wheel's sources, against what the CPU engine does and
what rlhpc sets (issue 40): a new SGLang pin that changes one of these rules fails here, naming
it. The CPU engine's server following each rule: tests/integration/test_engine_strict.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import sglang_wheel as sgl

from rlhpc.engine_server import sglang as sglang_server
from rlhpc.engine_server.cpu import app as cpu_app
from rlhpc.engine_server.cpu.command import MODULE, server_command
from rlhpc.engine_server.cpu.runner import UNSEEDED_DETERMINISTIC_SEED
from rlhpc.engine_server.cpu.server import parse_args
from rlhpc.engine_server.sglang import SGLangSpec, engine_env, server_env
from rlhpc.wire import protocol as P
from rlhpc.wire import switches
from rlhpc.wire.protocol import Route

REPO = Path(__file__).resolve().parents[2]
ENGINES_DOC = REPO / "docs" / "architecture" / "engines.md"


# ------------------------------------------------------------------ the switches


def test_the_switches_are_sglangs_with_their_defaults() -> None:
    assert sgl.env_field(switches.HEALTH_GENERATION) == ("EnvBool", True)
    assert sgl.env_field(switches.TP_MEMORY_IMBALANCE_CHECK) == ("EnvBool", True)
    # read once, when the sampler module is imported
    assert sgl.module_constant_call(sgl.SAMPLER, switches.RETURN_ORIGINAL_LOGPROB) == (
        f"get_bool_env_var({switches.RETURN_ORIGINAL_LOGPROB!r})"
    )
    assert sgl.getenv_default(sgl.HTTP_SERVER, "HEALTH_CHECK_TIMEOUT") == (
        switches.HEALTH_CHECK_TIMEOUT, switches.HEALTH_CHECK_TIMEOUT_DEFAULT_S,
    )  # fmt: skip


def test_the_switches_are_read_as_sglang_reads_them() -> None:
    assert sgl.env_bool_values() == (switches.ENV_BOOL_TRUE, switches.ENV_BOOL_FALSE)
    assert sgl.bool_env_var_rule() == ("false", switches.BOOL_ENV_VAR_TRUE, switches.BOOL_ENV_VAR_FALSE)
    assert switches.env_bool({}, "X", True) and not switches.env_bool({"X": "No"}, "X", True)
    assert switches.env_bool({"X": "maybe"}, "X", True)  # SGLang warns and keeps the default
    assert not switches.bool_env_var({}, "X") and switches.bool_env_var({"X": "TRUE"}, "X")
    assert not switches.bool_env_var({"X": "yes"}, "X")  # get_bool_env_var knows only true/1


def test_every_engine_rlhpc_starts_gets_the_switches_it_needs() -> None:
    env = engine_env({"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert not switches.env_bool(env, switches.HEALTH_GENERATION, True)  # /health answers without generating
    assert switches.bool_env_var(env, switches.RETURN_ORIGINAL_LOGPROB)  # the trainer's logprobs (temperature 1)
    assert switches.TP_MEMORY_IMBALANCE_CHECK not in env


def test_the_memory_saver_gets_no_expandable_segments() -> None:
    """torch_memory_saver (SGLang's --enable-memory-saver) refuses to start under expandable_segments."""
    base = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512",
            "PYTORCH_ALLOC_CONF": "expandable_segments:True"}  # fmt: skip
    saver = engine_env(base, memory_saver=True)
    assert saver["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512" and "PYTORCH_ALLOC_CONF" not in saver
    assert engine_env(base) == {**base, **sglang_server.ENGINE_SWITCHES}  # without the saver: left alone
    assert "-PYTORCH_ALLOC_CONF" in sglang_server.env_changes(base, saver)


def test_colocated_tp_engines_turn_off_sglangs_memory_balance_check() -> None:
    """Actor ranks of unequal size beside a TP engine's GPUs: SGLang would refuse to start."""
    switch, raised, threshold = sgl.tp_memory_check()
    assert (switch, raised, threshold) == (switches.TP_MEMORY_IMBALANCE_CHECK, "RuntimeError", 0.9)
    spec = SGLangSpec(tp_size=2, mem_fraction_static=0.4, memory_saver=True, seed=1, colocated=True)
    env = server_env({}, spec, [0, 1])
    assert not switches.env_bool(env, switch, True) and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    for alone in (SGLangSpec(2, 0.4, True, 1), SGLangSpec(1, 0.4, True, 1, colocated=True)):
        assert switch not in server_env({}, alone, [0])


# ------------------------------------------------------------------ /health


def test_health_generates_one_token_and_waits_for_progress_unless_switched_off() -> None:
    h = sgl.health_check()
    assert h.paths == {Route.HEALTH, Route.HEALTH_GENERATE}  # one handler, /health skips it when switched off
    assert h.switch == switches.HEALTH_GENERATION
    assert h.sampling_params == cpu_app.HEALTH_SAMPLING_PARAMS and h.input_ids == cpu_app.HEALTH_INPUT_IDS
    assert h.poll_s == cpu_app.HEALTH_POLL_S and h.timeout == "HEALTH_CHECK_TIMEOUT" and h.answers == {200, 503}


# ------------------------------------------------------------------ memory


def test_resume_removes_each_tag_and_release_pauses_each_again() -> None:
    """Resume: ``offload_tags.remove(tag)``, a KeyError for a tag not released; release pauses
    torch_memory_saver's memory again, which exits the process when it is paused already.
    Neither looks at what is released first."""
    assert sgl.offload_tag_calls("resume_memory_occupation") == {"remove"}
    assert sgl.offload_tag_calls("release_memory_occupation") == {"add"}
    assert not sgl.reads_released_tags("resume_memory_occupation")
    assert not sgl.reads_released_tags("release_memory_occupation")
    assert sgl.memory_saver_calls("release_memory_occupation") == {"pause"}
    assert sgl.memory_saver_calls("resume_memory_occupation") == {"resume"}
    assert sgl.all_memory_tags() == P.MEMORY_TAGS  # what no tags means: the CPU engine's too


def test_an_exception_in_the_scheduler_kills_the_whole_server() -> None:
    assert sgl.scheduler_exception_signal() == "SIGQUIT"  # to the HTTP server process
    assert "kill_process_tree" in sgl.sigquit_handler_calls()  # which kills itself and its children


# ------------------------------------------------------------------ seeds


def test_seeds_are_used_only_with_deterministic_inference() -> None:
    rule = sgl.seed_rule()
    assert rule.gate_source == "get_exec().deterministic.enable_deterministic_inference"
    assert rule.unseeded == UNSEEDED_DETERMINISTIC_SEED
    assert "--enable-deterministic-inference" in sgl.server_flags()


def test_a_deterministic_run_launches_both_engines_with_the_flag(tmp_path: Path) -> None:
    flag = "--enable-deterministic-inference"
    (tmp_path / "key").write_text("k")
    cmd = server_command("/py", "/m", "10.0.0.5", "/r.json", "1", "1", str(tmp_path / "key"), deterministic=True)
    assert cmd[-1] == flag and parse_args(cmd[cmd.index(MODULE) + 1 :]).enable_deterministic_inference
    plain = server_command("/py", "/m", "127.0.0.1", "/r.json", "1", "1")
    assert not parse_args(plain[plain.index(MODULE) + 1 :]).enable_deterministic_inference
    spec = SGLangSpec(1, 0.7, False, 3, deterministic=True)
    assert flag in sglang_server.launch_server_command("/py", "/m", "h", 1, 2, spec)
    assert flag not in sglang_server.launch_server_command("/py", "/m", "h", 1, 2, SGLangSpec(1, 0.7, False, 3))


def test_what_deterministic_inference_costs_is_what_the_engines_doc_says() -> None:
    cost = sgl.deterministic_cost()
    doc = ENGINES_DOC.read_text()
    named = [cost.sampling_backend, *cost.attention_fallbacks, *cost.attention_allowed, *cost.radix_cache_with]
    missing = [w for w in [*named, cost.tp_all_reduce] if f"`{w}`" not in doc]
    assert not missing, f"{ENGINES_DOC.name} does not name {missing} (what --enable-deterministic-inference forces)"
    assert cost.batch_invariant_ops and "batch-invariant" in doc


# ------------------------------------------------------------------ logprobs


def test_logprobs_are_of_logits_over_temperature_unless_greedy_or_switched_off() -> None:
    steps = sgl.sampler_logprob_steps()
    assert "logits.div_(sampling_info.temperatures)" in steps  # before probs, whose log is returned
    assert "sampling_info.is_all_greedy or SGLANG_RETURN_ORIGINAL_LOGPROB" in steps
    assert "return_logprob and SGLANG_RETURN_ORIGINAL_LOGPROB and (target_logprobs is None)" in steps
    assert sgl.greedy_rewrite() == {"temperature": 1.0, "top_k": 1}  # a greedy row's logprobs: temperature 1
    # penalties (repetition_penalty) change the logits the sampler, and so the logprobs, see
    assert "sampling_info.apply_logits_bias" in sgl.calls_in(sgl.MODEL_RUNNER, "_preprocess_logits")
    assert "self.penalizer_orchestrator.apply" in sgl.calls_in(
        sgl.SAMPLING_BATCH_INFO, "_apply_pre_grammar_logits_transforms"
    )


@pytest.mark.parametrize("name", sorted(sglang_server.ENGINE_SWITCHES))
def test_each_switch_rlhpc_sets_has_its_row_in_the_engines_doc(name: str) -> None:
    assert f"`{name}={sglang_server.ENGINE_SWITCHES[name]}`" in ENGINES_DOC.read_text()
