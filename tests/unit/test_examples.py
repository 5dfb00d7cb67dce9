"""The examples of the three ways into multi-turn rollouts (examples/*.yaml) load and validate:
their environment, generate function or agent imports and has the right shape; and each one runs
a rollout on an in-process CPU engine on a verl-layout Parquet file and on a plain prompt/answer
file (the row contract: the file's row as it is, rlhpc's forms as attributes). (The agent and
generate-function examples also run as whole jobs in tests/integration/test_ways_in.py.)"""

import json
import sys
from pathlib import Path

import pytest
from support.engines import in_process_send

from rlhpc.config import load_tree
from rlhpc.preflight import config_from_dict, load_config

REPO = Path(__file__).resolve().parents[2]
WAYS_IN = {
    "echo_env.yaml": ("env", "examples.echo_env:EchoEnv"),
    "self_check.yaml": ("generate_fn", "examples.self_check:self_check"),
    "calculator_agent.yaml": ("agent", "examples.calculator_agent:solve"),
}


# a whole job of a guide, its data made by a script (or a task's own)
GUIDES = {
    "verl_gsm8k.yaml": "docs/guides/coming-from-verl.md",
    "code_rl.yaml": "docs/guides/sandbox.md",
    "squares_vlm.yaml": "docs/guides/multimodal.md",
}


def test_every_example_config_is_listed():
    assert sorted(p.name for p in (REPO / "examples").glob("*.yaml")) == sorted([*WAYS_IN, *GUIDES])
    for name, guide in GUIDES.items():
        assert f"--config examples/{name}" in (REPO / guide).read_text()


@pytest.mark.parametrize("name", sorted(WAYS_IN))
def test_an_example_config_validates(name, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # as PYTHONPATH=$PWD does for the job
    cfg = load_config(REPO / "examples" / name)
    key, spec = WAYS_IN[name]
    assert getattr(cfg.rollout, key) == spec
    # the one way in: the other two keys unset
    assert [k for k in ("env", "generate_fn", "agent") if getattr(cfg.rollout, k) is not None] == [key]


# ---------------------------------------------------------------- each example on both layouts

CHAT_IN_CHAT = "<|im_start|>user\n<|im_start|>"  # a rendered prompt rendered again (issue 42)


@pytest.fixture(scope="module")
def files_and_engine(tmp_path_factory):
    """A verl-layout Parquet file (``examples/make_verl_gsm8k.py``), a plain prompt/answer file,
    and a tiny BPE model on an in-process CPU engine."""
    from rlhpc.config import TinyModelConfig
    from rlhpc.engine_server.cpu.runner import Engine
    from rlhpc.model import build_tiny_model

    sys.path.insert(0, str(REPO))  # examples/, as PYTHONPATH=$PWD does for the job
    from examples import make_verl_gsm8k

    work = tmp_path_factory.mktemp("examples")
    make_verl_gsm8k.main([str(work), "--train", "8", "--test", "2"])
    (work / "plain.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8))
    )
    # a context that holds the agent's tool schema (the byte-level BPE spends many tokens on JSON)
    model = build_tiny_model(work / "tiny", TinyModelConfig(tokenizer="bpe", max_position_embeddings=1024))
    yield work, model, Engine(str(model), "default")
    sys.path.remove(str(REPO))


LAYOUTS = {
    "verl": ["data.train_file={work}/train.parquet", "data.label_key=reward_model.ground_truth"],
    "plain": ["data.train_file={work}/plain.jsonl"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(WAYS_IN))
def test_an_example_runs_on_a_verl_file_and_on_a_plain_one(files_and_engine, name, layout):
    """Each example, as its config sets it up, on the rows of a verl-layout Parquet file and of a
    plain prompt/answer file: the prompt the model is given is the file's question rendered once
    (not a rendered chat wrapped in another), and the environment reads the file's label."""
    from transformers import AutoTokenizer

    from rlhpc.data.buffer import load_train
    from rlhpc.data.prompts import prepare_prompts
    from rlhpc.rollout.custom import make_custom
    from rlhpc.rollout.episodes import make_episodes
    from rlhpc.rollout.generation import Generation

    work, model, engine = files_and_engine
    tree = load_tree(REPO / "examples" / name, [f"model.path={model}", "model.tiny=null", "data.reward=rlhpc.rewards:exact",
                                                "rollout.n_samples_per_prompt=2", *(o.format(work=work) for o in LAYOUTS[layout])])  # fmt: skip
    cfg = config_from_dict(tree)
    tok = AutoTokenizer.from_pretrained(model)
    rows = load_train(cfg.data, 2, cfg.seed, prepare_prompts(tok, cfg.data, None)).rows[:2]
    prompts = []
    send = in_process_send(engine, lambda request, outputs: prompts.extend(request.input_ids))
    gen = Generation(tok, lambda p, r, a: 0.0, cfg.rollout, cfg.eval, cfg.algo, cfg.seed, send,
                     episodes=make_episodes(cfg, tok), custom=make_custom(cfg, tok))  # fmt: skip
    batch, _, _ = gen.rollout(0, rows)
    assert len(batch) >= 4
    for k, ids in enumerate(batch.prompt_ids):
        row, text = rows[k // 2], tok.decode(ids)
        assert CHAT_IN_CHAT not in text, text
        if name == "echo_env.yaml":  # the environment asks for the file's label back
            assert text.endswith(f"<|im_start|>user\nSay {row.label}.<|im_end|>\n<|im_start|>assistant\n"), text
        else:  # the file's question, as the user's message
            question = row.messages[-1]["content"]
            assert text.endswith(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"), text
    assert all(CHAT_IN_CHAT not in tok.decode(ids) for ids in prompts)  # every engine call's prompt


def test_the_verl_guides_job_validates_as_written(tmp_path, monkeypatch):
    """docs/guides/coming-from-verl.md's job (run end to end when it was written): its data script
    writes verl's layout, its config as the guide shows it validates on that data with verl's
    compute_score and the shipped agent, and so does the environment variant."""
    monkeypatch.syspath_prepend(str(REPO))
    from examples import make_verl_gsm8k

    guide = (REPO / "docs" / "guides" / "coming-from-verl.md").read_text()
    shown = guide.split("```yaml\n", 1)[1].split("```", 1)[0]
    example = (REPO / "examples" / "verl_gsm8k.yaml").read_text()
    assert example.endswith(shown) and all(line.startswith("#") for line in example[: -len(shown)].splitlines())
    monkeypatch.chdir(tmp_path)  # the guide's commands run from the checkout: relative data paths
    make_verl_gsm8k.main(["data/gsm8k", "--train", "16", "--test", "4"])
    cfg = load_config(REPO / "examples" / "verl_gsm8k.yaml")
    assert cfg.rollout.agent == "examples.calculator_agent:solve" and cfg.data.reward.endswith("compute_score")
    env = load_config(
        REPO / "examples" / "verl_gsm8k.yaml", ["rollout.agent=null", "rollout.env=examples.verl_gsm8k:GSM8KEnv"]
    )
    assert env.rollout.env == "examples.verl_gsm8k:GSM8KEnv"


def test_the_code_recipe_validates_on_its_data_and_every_row_holds_tests(tmp_path, monkeypatch):
    """docs/guides/sandbox.md's recipe: its data script writes verl's code layout, one row of each
    test form rlhpc.rewards:code reads, and its config validates on that data as the guide runs it."""
    from rlhpc.data.files import read_rows
    from rlhpc.sandbox.testing import parse_tests

    monkeypatch.syspath_prepend(str(REPO))
    from examples import make_code_rl

    monkeypatch.chdir(tmp_path)
    make_code_rl.main(["data/code", "--train", "12", "--test", "3"])
    cfg = load_config(REPO / "examples" / "code_rl.yaml")
    assert cfg.data.reward == "rlhpc.rewards:code" and cfg.sandbox.backend == "bwrap"
    rows = read_rows("data/code/train.parquet", cfg.data.prompt_key, cfg.data.label_key)
    assert {parse_tests(r.label).kind for r in rows} == {"stdio", "call", "asserts"}


@pytest.mark.parametrize(
    "expression",
    [
        "(" * 1500 + "1" + ")" * 1500,  # too many nested parentheses
        "-" * 3000 + "1",  # RecursionError in the compiler
        "+".join(["1"] * 1500),
        "9" * 1500 + "*" + "9" * 1499,
        "9**9**9",
        "(1)(1)",
        "1/0",
        "__import__('os')",
    ],
)
def test_the_shipped_calculator_answers_any_input_and_never_raises(monkeypatch, expression):
    # Issue 43, item 11: 3,000-character inputs raised MemoryError or RecursionError, which
    # ended the episode and the run: a tool's bad input is a tool result
    monkeypatch.syspath_prepend(str(REPO))
    from examples.calculator_agent import calculator

    assert calculator(expression).startswith("error: ")
    assert calculator("6*(3+4)/2") == "21.0" and calculator("-2*-3") == "6"
