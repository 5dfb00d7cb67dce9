"""The reward models (issue 30) against transformers: the CPU engine server's /classify, and the
score a whole local run trains on (a classifier's, a generative judge's), each equal to
transformers' own forward (or greedy decoding) of the model."""

from __future__ import annotations

import h5py
import pytest
import torch
from support.engines import engine_client, start_server, stop_server
from support.jobs import said, submit
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlhpc.config import TinyModelConfig
from rlhpc.errors import RlhpcError
from rlhpc.metrics import read_metrics
from rlhpc.model import build_tiny_model
from rlhpc.rollout.judge import render as judge_render
from rlhpc.rollout.judge import score_prompt
from rlhpc.rollout.scoring import Sample

RM = TinyModelConfig(architecture="qwen2", tokenizer="bpe", seed=3)  # a ChatML template: rendered with it


def hf_scores(path, texts: list[str]) -> list[float]:
    """transformers' own forward: the classifier's logit for each text, tokenized as the template wrote it."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(**tok(t, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item() for t in texts]


def conversation(tok, prompt: str, response: str) -> str:
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return tok.apply_chat_template(messages, tokenize=False)


def test_cpu_server_classifies_as_transformers_scores(tmp_path):
    path = build_tiny_model(tmp_path / "rm", RM, classifier=True)
    tok = AutoTokenizer.from_pretrained(path)
    texts = [conversation(tok, "12+3=", r) for r in ("15", "6", "a much longer answer")]
    proc, url, _ = start_server(str(path), tmp_path, "rm")
    try:
        client = engine_client(url)
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        scores = client.classify(ids)  # a batch of three lengths, two of one
        assert scores == pytest.approx(hf_scores(path, texts), abs=1e-5)
        assert len(set(scores)) == 3
        assert client.classify(ids[1:2]) == pytest.approx(scores[1:2], abs=1e-6)
        assert client.get_model_info()["is_generation"] is False
        with pytest.raises(RlhpcError, match="serves /classify, not /generate"):
            client.generate(input_ids=ids[0], sampling_params={"max_new_tokens": 1})
    finally:
        stop_server(proc)


def test_a_local_run_trains_on_the_reward_models_score(tmp_path):
    """A few rollouts with a tiny classifier on a GPU of its own: each sample's reward is the
    classifier's score of its prompt + response (the rule reward weighted 0), as transformers
    scores the same conversation; both components logged; the layout shows the third group."""
    run = tmp_path / "run"
    p = submit(
        run, "rollout.num_rollout=2", "eval.interval=null", "cluster.gpus_per_node=3", "data.reward_weight=0",
        "reward_model.tiny.architecture=qwen2", "reward_model.tiny.tokenizer=bpe", "reward_model.tiny.seed=3",
        "reward_model.batch_size=5",
    )  # fmt: skip
    assert p.returncode == 0, said(p)[-4000:]
    assert "reward engine 0   (tp=1) -> " in (run / "layout.txt").read_text()
    assert "1 reward engine(s)" in said(p)
    records = [r for r in read_metrics(run) if r["kind"] == "rollout"]
    assert len(records) == 2
    path = run / "reward_model"
    tok = AutoTokenizer.from_pretrained(path)
    for r in (0, 1):
        with h5py.File(run / "rollouts" / f"rollout_{r:06d}.h5") as f:
            prompts = [x.decode() for x in f["prompt"][:]]
            responses = [x.decode() for x in f["response"][:]]
            rewards = f["rewards"][:].tolist()
        expected = hf_scores(path, [conversation(tok, q, a) for q, a in zip(prompts, responses)])
        assert rewards == pytest.approx(expected, abs=1e-5)
        m = records[r]
        assert m["reward/reward_model"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
        assert "reward/rule" in m and m["reward"] == pytest.approx(m["reward/reward_model"], abs=1e-5)


def judge_answers(path, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
    """transformers' own greedy decoding of each judge question, as text (the stop token cut)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
            out.append(tok.decode(y[0, len(ids) :], skip_special_tokens=True))
    return out


def test_a_local_run_trains_on_the_judges_verdict(tmp_path):
    """A few rollouts with a tiny chat model as the judge on a GPU of its own: the built-in
    question (rendered with the judge's template), answered greedily on the reward engine, read by
    the run's judge_parse (the answer's length): each sample's reward is what transformers'
    greedy decoding of the same question gives."""
    run = tmp_path / "run"
    p = submit(
        run, "rollout.num_rollout=1", "eval.interval=null", "cluster.gpus_per_node=3", "data.reward_weight=0",
        "reward_model.kind=judge", "reward_model.tiny.architecture=qwen2", "reward_model.tiny.tokenizer=bpe",
        "reward_model.tiny.seed=3", "reward_model.judge_parse=support.judges:length",
        "reward_model.sampling.max_new_tokens=6", "reward_model.weight=0.5", "reward_model.tiny.max_position_embeddings=512",
    )  # fmt: skip
    assert p.returncode == 0, said(p)[-4000:]
    assert "reward engine 0   (tp=1) -> " in (run / "layout.txt").read_text()
    (m,) = [r for r in read_metrics(run) if r["kind"] == "rollout"]
    path = run / "reward_model"
    tok = AutoTokenizer.from_pretrained(path)
    with h5py.File(run / "rollouts" / "rollout_000000.h5") as f:
        prompts = [x.decode() for x in f["prompt"][:]]
        responses = [x.decode() for x in f["response"][:]]
        rewards = f["rewards"][:].tolist()
    # each question held to the judge's context less the answer's room, keeping its end
    room = AutoConfig.from_pretrained(path).max_position_embeddings - 6
    questions = [
        judge_render(tok, score_prompt(Sample(prompt=q, response=a, label="")))[-room:]
        for q, a in zip(prompts, responses)
    ]
    verdicts = [float(len(t)) for t in judge_answers(path, questions, 6)]
    assert len(set(verdicts)) > 1  # the answers differ: the check below tells samples apart
    assert rewards == pytest.approx([0.5 * v for v in verdicts], abs=1e-6)
    assert m["reward/reward_model"] == pytest.approx(sum(verdicts) / len(verdicts), abs=1e-6)
    assert m["reward"] == pytest.approx(0.5 * m["reward/reward_model"], abs=1e-6) and "reward/rule" in m


@pytest.mark.ray
def test_a_killed_reward_engine_is_restarted_and_its_samples_scored_once(tmp_path, caplog):
    """Two frozen reward engines; one SIGKILLed between two scorings: the requests it does not
    answer fail, it is restarted (on the model on disk: no weights to push), they are sent again,
    and every sample gets the score it got before, in its place."""
    import os
    import signal

    import ray

    from rlhpc.cluster.layout import plan_layout
    from rlhpc.cluster.placement import create_placement
    from rlhpc.config import ClusterConfig, RewardModelConfig, RolloutConfig
    from rlhpc.rollout.reward_model import RewardModel, start_reward_engines

    path = build_tiny_model(tmp_path / "rm", RM, classifier=True)
    cluster = ClusterConfig(gpus_per_node=4, actor_num_gpus=1, rollout_num_gpus=1)
    rm = RewardModelConfig(path=str(path), num_gpus=2)
    samples = [Sample(prompt=f"{i}+{i}=", response=str(2 * i) * (i % 3 + 1), label="") for i in range(12)]
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        layout = plan_layout(cluster, rm)
        placement = create_placement(layout.num_slots)
        engines = start_reward_engines(rm, RolloutConfig(), cluster, 0, str(path), placement, layout, tmp_path / "logs")
        try:
            scorer = RewardModel(engines, AutoTokenizer.from_pretrained(path), batch_size=3)
            before = scorer.score(samples)  # four requests over two engines
            tok = AutoTokenizer.from_pretrained(path)
            texts = [conversation(tok, s.prompt, s.response) for s in samples]
            assert before == pytest.approx(hf_scores(path, texts), abs=1e-5)
            pid = ray.get(engines.engines[1].pid.remote())
            os.kill(pid, signal.SIGKILL)
            assert scorer.score(samples) == pytest.approx(before, abs=1e-6)
            assert engines.restarts == [0, 1]
            assert "reward engine 1 (" in caplog.text and "reward engine 1 is back" in caplog.text
            assert (tmp_path / "logs" / "engine_1.log").read_text().count("starting at") == 2
            with pytest.raises(RlhpcError, match="frozen"):
                engines.connect_weights(None)
        finally:
            engines.shutdown()
            placement.remove()
    finally:
        ray.shutdown()
