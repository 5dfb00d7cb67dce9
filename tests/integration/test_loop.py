"""The whole loop on one machine: submitit local executor, local Ray, engine server over HTTP,
training rank over torch.distributed. Each test is a real job started by jobs/submit.py."""

import json
import shutil
import subprocess
import sys

import h5py
import pytest
import torch
from safetensors.torch import load_file
from support.jobs import REPO, rollouts, routed, said, submit
from support.rewards import SCORED_ENV, pass_at_k_by_hand, scored

from rlhpc.checkpoint import CheckpointManager
from rlhpc.metrics import read_metrics

# Colocated, the engines offloaded while the actor trains, sampling at a temperature other than the
# trainer's 1: the engines' logprobs must still be the trainer's (SGLANG_RETURN_ORIGINAL_LOGPROB,
# issue 40), or the rollout/train mismatch is far from 0.
COLOCATE_OFFLOAD = [
    "cluster.colocate=true",
    "cluster.offload=true",
    "cluster.gpus_per_node=1",
    "rollout.temperature=0.7",
]


FINISHED_CONFIG = (
    "data.num_train=16", "rollout.num_rollout=7", "checkpoint.save_interval=3", "eval.interval=3", *COLOCATE_OFFLOAD,
)  # fmt: skip


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished run read by the tests below: 7 rollouts of 8 of 16 prompts (an epoch ends every
    2 rollouts), saved and evaluated every 3 rollouts and at the end; colocated and offloaded
    (``COLOCATE_OFFLOAD``: its layout's checks are ``test_other_layouts_train``'s)."""
    run = tmp_path_factory.mktemp("loop") / "run"
    p = submit(run, *FINISHED_CONFIG)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (run.parent / "submit.out").write_text(p.stdout + p.stderr)
    return run


def test_embedded_loop_end_to_end(finished):
    run = finished
    assert rollouts(run) == list(range(7)) and routed(run)  # generated through the real router
    # keep_last=2 of the saves at rollouts 2, 5 and the final 6
    assert sorted(p.name for p in (run / "checkpoints").glob("rollout_*")) == ["rollout_000005", "rollout_000006"]
    ck = CheckpointManager(run / "checkpoints", 2).latest()
    assert ck.rollout_id == 6 and ck.state["weight_version"] == 7 and ck.state["data"]["next_rollout_id"] == 7
    assert (ck.path / "actor" / "config.json").is_file()  # a plain HF model dir
    with h5py.File(run / "rollouts" / "rollout_000006.h5") as f:
        assert len(f["rewards"]) == 8 * 4 and f.attrs["group_size"] == 4
    assert (run / "FINISHED").is_file()
    # A finished run is never overwritten silently.
    again = submit(run, *FINISHED_CONFIG)
    assert again.returncode == 2 and "holds a finished run" in said(again)


# The entropy bonus moves the policy even where a rollout's rewards are all equal (no advantage).
KL_IN_REWARD = ["algo.kl_in_reward=true", "algo.kl_coef=0.1", "algo.ref_update_interval=2", "algo.entropy_coef=0.01"]


# Two actor ranks and two engines, with the KL in the reward, measured by both ranks, and the
# reference reset after rollout 1
TWO_RANKS_KL_IN_REWARD = [
    "cluster.gpus_per_node=4", "cluster.actor_num_gpus=2", "cluster.rollout_num_gpus=2", *KL_IN_REWARD,
]  # fmt: skip


def test_a_users_own_files_train_on_a_bos_less_byte_level_tokenizer(tmp_path):
    """A new user's first run: a Qwen-shaped tokenizer (byte-level BPE, no BOS, ChatML template),
    verl-format Parquet files (chat-message prompts, the label nested), a reward of one Sample
    that reads the row's metadata and returns a dict, and
    one eval prompt too long for the context. The chat prompts are sent as the template renders
    them, the text ones as the tokenizer encodes them, the long one is dropped at load, and the
    dumps hold what was generated. The layout is ``TWO_RANKS_KL_IN_REWARD`` (a job of its own
    before): its checks are at the end."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    def verl_rows(prompts, split):
        return pa.Table.from_pylist(
            [
                {"prompt": q, "reward_model": {"ground_truth": a}, "data_source": "toy", "split": split}
                for q, a in prompts
            ]
        )

    train = [([{"role": "user", "content": f"{a}+{b}="}], str((a + b) % 10)) for a in range(8) for b in range(8)]
    pq.write_table(verl_rows(train, "train"), tmp_path / "train.parquet")
    pq.write_table(
        verl_rows([("1+2=", "3"), ("3+4=", "7"), ("9+" * 200 + "1=", "0")], "eval"), tmp_path / "eval.parquet"
    )
    run = tmp_path / "run"
    p = submit(
        run, "model.tiny.tokenizer=bpe", "rollout.num_rollout=3", "checkpoint.save_interval=null",
        f"data.train_file={tmp_path}/train.parquet", f"data.eval_file={tmp_path}/eval.parquet",
        "data.label_key=reward_model.ground_truth", "data.reward=support.rewards:graded",
        "eval.n_samples_per_prompt=4", "eval.temperature=1.0", *TWO_RANKS_KL_IN_REWARD,
        env={SCORED_ENV: str(tmp_path / "scored.jsonl")},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "eval data: 1 of 3 prompts are longer than" in said(p)
    evals = [m for m in read_metrics(run) if m["kind"] == "eval"]
    samples = scored(tmp_path / "scored.jsonl", split="eval")  # 2 prompts x 4 samples an evaluation
    assert len(samples) == len(evals) * 8
    for i, m in enumerate(evals):  # a 0/1 reward: pass@1 is its mean
        assert {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/maj@4"} <= set(m)
        assert abs(m["eval/pass@1"] - m["eval/reward"]) < 1e-6
        expected, (maj_low, maj_high) = pass_at_k_by_hand(samples[8 * i : 8 * (i + 1)], 4)
        assert {k: m[f"eval/{k}"] for k in expected} == pytest.approx(expected, abs=1e-9)
        assert maj_low - 1e-9 <= m["eval/maj@4"] <= maj_high + 1e-9
    assert rollouts(run) == [0, 1, 2]
    for m in (m for m in read_metrics(run) if m["kind"] == "rollout"):  # the Sample the reward saw
        assert m["reward/from_metadata"] == 1.0 and m["reward/chat"] == 1.0 and m["reward/stopped"] == 1.0
    tok = AutoTokenizer.from_pretrained(run / "base_model")
    assert tok.bos_token is None
    with h5py.File(run / "rollouts" / "rollout_000001.h5") as f:
        sent = [list(ids) for ids in f["prompt_ids"][:]]
        prompts = [r.decode() for r in f["prompt"][:]]
        assert len(f["rewards"]) == 8 * 4
    assert all(q.startswith("<|im_start|>user\n") and q.endswith("<|im_start|>assistant\n") for q in prompts)
    questions = [q.split("\n")[1].removesuffix("<|im_end|>") for q in prompts]
    chats = [[{"role": "user", "content": q}] for q in questions]
    assert sent == [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
    assert_trained(run, p.stdout + p.stderr, TWO_RANKS_KL_IN_REWARD, 3)
    # k3 is 0 exactly where the policy is the reference: at the start, and right after the reset
    penalty = [r["kl/reward_penalty"] for r in read_metrics(run) if r["kind"] == "rollout"]
    assert penalty[0] == 0.0 and penalty[1] > 0 and penalty[2] == 0.0, penalty
    assert all(r["kl"] == 0.0 for r in read_metrics(run) if r["kind"] == "rollout")  # none in the loss


def test_a_run_counted_in_rollouts_keeps_to_its_intervals_at_epoch_ends(finished):
    """16 prompts, 8 a rollout: an epoch ends every 2 rollouts. Counted in rollouts
    (rollout.num_rollout), the run saves and evaluates only every 3 and at the end (not at the
    epoch ends after rollouts 1 and 3), as the seed's loop does (it adds epoch ends only to a run
    counted in epochs)."""
    records = read_metrics(finished)
    assert [r["rollout_id"] for r in records if r["kind"] == "eval"] == [-1, 2, 5, 6]  # baseline, every 3, last
    saved = [r["rollout_id"] for r in records if r["kind"] == "rollout" and "time/save" in r]
    assert saved == [2, 5, 6]


def test_a_job_that_fails_says_why_in_status(tmp_path):
    """Chat-message prompts for a model whose tokenizer has no chat template: found when the job
    loads the tokenizer, a named problem (no requeue), and jobs/status.py shows the run as failed."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+2="}], "answer": "3"}) + "\n")
    run = tmp_path / "run"
    p = submit(run, f"data.train_file={data}", f"data.eval_file={data}", "data.reward=rlhpc.rewards:exact",
               "rollout.rollout_batch_size=1")  # fmt: skip
    assert p.returncode != 0 and "ships no chat template" in said(p), said(p)[-3000:]
    shown = subprocess.run([sys.executable, str(REPO / "jobs" / "status.py"), str(run)], capture_output=True, text=True)
    shown = " ".join(shown.stdout.split())
    assert (
        "ended FAILED (job" in shown
        and "the prompts are chat messages but the model's tokenizer ships no chat template" in shown
    )
    assert "finished no" in shown and "starts 1 (" in shown


# LoRA, each push the adapter alone (its files under the run dir, loaded by both engines behind the
# router, every request naming it); a rate that moves the adapters far within a rollout, so an
# engine generating without the adapter would be far from the trainer
LORA_ADAPTER_PUSH = [
    "actor.lora.rank=8", "actor.lr=0.01", "cluster.gpus_per_node=3", "cluster.actor_num_gpus=1",
    "cluster.rollout_num_gpus=2", "checkpoint.save_interval=3",
]  # fmt: skip


def assert_trained(run, out: str, layout: list[str], rollouts_: int) -> None:
    """What every layout promises: each rollout through the real router, no engine restarted."""
    assert rollouts(run) == list(range(rollouts_)) and routed(run)  # through the real router, offloaded engines too
    assert json.loads((run / "FINISHED").read_text())["num_rollout"] == rollouts_
    # no engine died and was restarted: as SGLang's, the CPU engine dies resuming memory it holds
    assert "is down; restart" not in out
    assert not [f for f in (run / "logs" / "engines").rglob("*.log") if "Scheduler hit" in f.read_text()]
    if layout in (COLOCATE_OFFLOAD, LORA_ADAPTER_PUSH):
        diffs = [r["rollout_logprob_abs_diff"] for r in read_metrics(run) if r["kind"] == "rollout"]
        assert max(diffs) < 1e-4, diffs


def test_colocated_offloaded_engines_train(finished):
    """``COLOCATE_OFFLOAD``, on the finished run (a job of its own before)."""
    assert_trained(finished, (finished.parent / "submit.out").read_text(), COLOCATE_OFFLOAD, 7)


def test_lora_adapter_push_trains(tmp_path):
    """The other layouts: ``COLOCATE_OFFLOAD`` is the finished run's, ``TWO_RANKS_KL_IN_REWARD``
    the BOS-less tokenizer run's (each a job of its own before); their checks are there."""
    run = tmp_path / "run"
    p = submit(run, "rollout.num_rollout=3", "checkpoint.save_interval=null", *LORA_ADAPTER_PUSH)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert_trained(run, p.stdout + p.stderr, LORA_ADAPTER_PUSH, 3)
    # the last push's adapter is the trained one, and only it is left
    [pushed] = (run / "lora_push").iterdir()
    assert pushed.name == "v000003" and (pushed / "adapter_config.json").is_file()
    [saved] = (run / "checkpoints").glob("rollout_*")  # after the last rollout's training, as that push
    trained = load_file(saved / "actor" / "adapter_model.safetensors")
    assert load_file(pushed / "adapter_model.safetensors").keys() == trained.keys()
    assert all(torch.equal(load_file(pushed / "adapter_model.safetensors")[k], t) for k, t in trained.items())


def test_bad_config_submits_nothing(tmp_path):
    run = tmp_path / "run"
    p = submit(run, "cluster.actor_num_gpus=3")
    assert p.returncode == 2
    assert "needs 4 GPUs" in said(p) and "fix:" in said(p)
    assert not run.exists()  # nothing half-written


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    p = submit(blocker / "run", "rollout.num_rollout=1")
    assert p.returncode == 2 and "not writable" in said(p)


def test_changed_config_is_refused_on_resume(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run, symlinks=True)
    (run / "FINISHED").unlink()  # pretend it was interrupted
    p = submit(run, *FINISHED_CONFIG, "actor.lr=0.5")
    assert p.returncode == 2 and "different config (actor.lr)" in said(p) and "--force" in said(p), said(p)
