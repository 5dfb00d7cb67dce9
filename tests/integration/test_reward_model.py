"""The reward models (issue 30) against transformers: the CPU engine server's /classify, and the
score a whole local run trains on (a classifier's, a generative judge's), each equal to
transformers' own forward (or greedy decoding) of the model."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import h5py
import pytest
import torch
from support.engines import engine_client, in_process_send, start_server, stop_server
from support.jobs import REPO, routed, said, submit
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlhpc.config import TinyModelConfig
from rlhpc.engine_server.cpu.requests import MAX_ROWS
from rlhpc.errors import RlhpcError
from rlhpc.invariants import comparable, final_weights
from rlhpc.metrics import read_metrics
from rlhpc.model import build_tiny_model
from rlhpc.rollout.judge import render as judge_render
from rlhpc.rollout.judge import score_prompt
from rlhpc.rollout.scoring import Sample
from rlhpc.rollout.weight_sync import WeightSync

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
        # issue 43, item 8: /classify took any number of rows
        with pytest.raises(RlhpcError, match=f"a batch of {MAX_ROWS + 1} rows"):
            client.classify([[1, 2]] * (MAX_ROWS + 1))
    finally:
        stop_server(proc)


RUN = (
    "rollout.num_rollout=2", "eval.interval=1", "data.num_eval=8", "checkpoint.save_interval=1",
    "cluster.gpus_per_node=3", "data.reward_weight=0",
    "reward_model.tiny.architecture=qwen2", "reward_model.tiny.tokenizer=bpe", "reward_model.tiny.seed=3",
    "reward_model.batch_size=5", "deterministic=true",
)  # fmt: skip


def test_a_local_run_trains_on_the_reward_models_score(tmp_path):
    """A few rollouts with a tiny classifier on a GPU of its own: each sample's reward is the
    classifier's score of its prompt + response (the rule reward weighted 0), as transformers
    scores the same conversation; both components logged; the layout shows the third group; the
    reward group's idle share is a metric. Scored as each request is answered (the default) or
    after the rollout (``reward_model.overlap=false``), a deterministic run trains the same."""
    run = tmp_path / "run"
    p = submit(run, *RUN)
    assert p.returncode == 0, said(p)[-4000:]
    assert "reward engine 0   (tp=1) -> " in (run / "layout.txt").read_text()
    assert "1 reward engine(s)" in said(p)
    # the policy's samples through the real router; the reward model scores without one (the
    # router has no /classify)
    assert routed(run) and not routed(run, "reward")
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
        assert 0.0 <= m["time/reward_idle"] < 1.0  # it scored during the step

    after = tmp_path / "after"
    p = submit(after, *RUN, "reward_model.overlap=false")
    assert p.returncode == 0, said(p)[-4000:]
    assert comparable(after) == comparable(run) and final_weights(after) == final_weights(run)

    # rlhpc-eval of a checkpoint scores as the run did: with its reward model (the rule's weight is 0)
    p = subprocess.run([sys.executable, "-m", "rlhpc.cli.evaluate", str(run), "--checkpoint", "rollout_0"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert p.returncode == 0, said(p)[-4000:]
    written = json.loads((run / "evals" / "rollout_000000.json").read_text())
    logged = next(r for r in read_metrics(run) if r["kind"] == "eval" and r["rollout_id"] == 0)
    assert written["metrics"] == {k: v for k, v in logged.items() if k not in ("kind", "rollout_id")}


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
def test_reward_engines_score_overlapped_and_a_killed_one_is_restarted(tmp_path, caplog):
    """Two frozen reward engines (one Ray session for every part: starting them is the cost).

    Between two scorings: one SIGKILLed, the requests it does not answer fail, it is restarted (on
    the model on disk: no weights to push), they are sent again, and every sample gets the score
    it got before, in its place.

    A rollout of 4 requests, generated on an in-process CPU engine: overlapped, request 0's
    samples are scored before request 1 is answered; scored after the rollout, none is until
    generation ends; a reward engine SIGKILLed mid-rollout (after request 0 was scored, before the
    next group goes to it) is restarted and its group sent again. All three give the same
    rewards, bit for bit, each sample one score in its place."""
    import os
    import signal

    import ray

    from rlhpc.cluster.layout import plan_layout
    from rlhpc.cluster.placement import create_placement
    from rlhpc.config import AlgoConfig, ClusterConfig, EvalConfig, RewardModelConfig, RolloutConfig
    from rlhpc.engine_server.cpu.runner import Engine
    from rlhpc.rollout.generation import Generation
    from rlhpc.rollout.reward_model import RewardModel, start_reward_engines
    from rlhpc.rollout.scoring import MixedScorer, Sample, Scorer

    path = build_tiny_model(tmp_path / "rm", RM, classifier=True)
    cluster = ClusterConfig(gpus_per_node=4, actor_num_gpus=1, rollout_num_gpus=1)
    rm_cfg = RewardModelConfig(path=str(path), num_gpus=2)
    rollout = RolloutConfig(n_samples_per_prompt=2, max_new_tokens=6)
    samples = [Sample(prompt=f"{i}+{i}=", response=str(2 * i) * (i % 3 + 1), label="") for i in range(12)]
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        layout = plan_layout(cluster, rm_cfg)
        placement = create_placement(layout.num_slots)
        engines = start_reward_engines(rm_cfg, rollout, cluster, 0, str(path), placement, layout, tmp_path / "logs")
        try:
            tok = AutoTokenizer.from_pretrained(path)
            scorer = RewardModel(engines, tok, batch_size=3)
            before = scorer.score(samples)  # four requests over two engines
            texts = [conversation(tok, s.prompt, s.response) for s in samples]
            assert before == pytest.approx(hf_scores(path, texts), abs=1e-5)
            pid = ray.get(engines.engines[1].pid.remote())
            os.kill(pid, signal.SIGKILL)
            assert scorer.score(samples) == pytest.approx(before, abs=1e-6)
            assert engines.restarts == [0, 1]
            assert "reward engine 1 (" in caplog.text and "reward engine 1 is back" in caplog.text
            assert (tmp_path / "logs" / "engine_1.log").read_text().count("starting at") == 2
            with pytest.raises(RlhpcError, match="frozen"):
                WeightSync(None, engines, 0)  # no weight owner over frozen engines

            policy = build_tiny_model(tmp_path / "policy", TinyModelConfig())
            engine = Engine(str(policy), "default", deterministic=True)  # seeded: each run samples alike
            rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]
            rm = RewardModel(engines, tok, batch_size=64)

            def rollout_rewards(overlap: bool, kill: bool = False) -> torch.Tensor:
                scored_before: list[int] = []  # scoring calls finished when each request was answered

                def answered(request, outputs) -> None:
                    if overlap and len(scored_before) == 1:  # request 0's group is being scored: wait for it
                        deadline = time.monotonic() + 60
                        while not rm.clock.intervals and time.monotonic() < deadline:
                            time.sleep(0.05)
                        if kill:  # the next group goes to engine 1 (rm.sent rotates the engines)
                            assert rm.sent == 1
                            os.kill(ray.get(engines.engines[1].pid.remote()), signal.SIGKILL)
                    scored_before.append(len(rm.clock.intervals))

                rm.clock.intervals.clear()
                rm.sent = 0  # each run's first group goes to engine 0
                mixed = MixedScorer(
                    Scorer(lambda p, r, a: 0.0, "rule"), 0.0, {"reward_model": (1.0, rm.score)},
                    groups={"reward_model": rm.score_groups}, overlap=overlap,
                )  # fmt: skip
                gen = Generation(
                    engine.tokenizer, mixed, rollout, EvalConfig(), AlgoConfig(), 7,
                    in_process_send(engine, answered), num_engines=4,
                )  # fmt: skip
                s = gen.sample(rows, 2, 1.0, 6, "r0", "rollout")
                assert len(scored_before) == 4  # four requests of two rows
                if overlap:
                    assert scored_before[1] >= 1  # request 0 scored while request 1 generated
                else:
                    assert scored_before == [0, 0, 0, 0]  # nothing before the rollout's end
                assert s.parts["reward_model"] == s.rewards.tolist() and len(s.rewards) == 16
                return s.rewards

            after = rollout_rewards(overlap=False)
            assert torch.equal(rollout_rewards(overlap=True), after)
            assert engines.restarts == [0, 1]
            assert torch.equal(rollout_rewards(overlap=True, kill=True), after)
            assert engines.restarts == [0, 2]  # the engine killed mid-rollout was restarted, once more
        finally:
            engines.shutdown()
            placement.remove()
    finally:
        ray.shutdown()
