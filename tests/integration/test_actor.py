"""Training ranks on a local Ray with declared GPUs, torch.distributed over gloo, a tiny model."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file
from support.actors import Group, Pool, engine_weights, make_batch, sequence_k1_by_transformers

from rlhpc.actor.group import ActorGroup, ActorRankError
from rlhpc.actor.packing import first_fit_decreasing, sample_lengths
from rlhpc.actor.worker import read_optimizer
from rlhpc.config import Config
from rlhpc.devtools import attacks
from rlhpc.errors import RlhpcError

pytestmark = pytest.mark.ray

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def make_cfg(**actor: object) -> Config:
    cfg = Config(deterministic=True)
    cfg.actor.lr = 1e-2
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return cfg


@pytest.fixture(scope="module")
def pool(ray_cluster: None) -> Iterator[Pool]:
    """Rank groups reused across the tests below, each reset to its start (support.actors.Pool)."""
    p = Pool()
    yield p
    p.close()


def tensors(group: ActorGroup, rank: int = 0, grads: bool = False) -> dict[str, torch.Tensor]:
    return ray.get(group.workers[rank].named_tensors.remote(grads))


def test_two_ranks_train_in_lockstep(ray_cluster: None, model_path: str) -> None:
    with Group(make_cfg(micro_batch_size=3, num_steps_per_rollout=2), model_path, 2) as g:
        no_store_for_the_other_user(g)
        start = g.fingerprints()
        assert start[0] == start[1]
        before = tensors(g)
        prev = start[0]
        for rollout_id in range(3):
            m = g.train(rollout_id, make_batch(10, seed=rollout_id))
            assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
            assert m["tokens"] > 0 and m["grad_norm"] > 0 and m["entropy"] > 0
            fp = g.fingerprints()
            assert fp[0] == fp[1], f"ranks diverged after rollout {rollout_id}"
            assert fp[0] != prev
            prev = fp[0]
        after = tensors(g, rank=1)
        assert any(not torch.equal(before[k], after[k]) for k in before)

        # 3 samples, 2 steps: rank 0's shard (1 sample) has an empty minibatch; the reduction must not hang
        g.train(3, make_batch(3, seed=3))
        fp = g.fingerprints()
        assert fp[0] == fp[1] != prev
        with pytest.raises(RlhpcError, match="samples for 2 data-parallel actor ranks"):
            g.train(4, make_batch(1, seed=4))

        ray.kill(g.workers[1])
        with pytest.raises(ray.exceptions.RayActorError):  # kill is asynchronous: wait for the death
            for _ in range(1200):  # ends at the death: up to 2 minutes on a loaded machine
                ray.get(g.workers[1].node_ip.remote())
                time.sleep(0.1)
        with pytest.raises(ActorRankError, match="actor rank 1 died during state_fingerprint") as e:
            g.fingerprints()
        assert e.value.rank == 1


def no_store_for_the_other_user(g: ActorGroup) -> None:
    # Issue 43, item 7: rank 0's TCPStore listened on every address for the whole run, even with
    # one rank, and answered a keyless set and get. Ranks on one node meet in a private file now.
    pids = ray.get([w.__ray_call__.remote(lambda self: os.getpid()) for w in g.workers])
    ports = attacks.listening(pids)
    if os.getuid() == 0:  # the other user tries each port the ranks listen on
        record = attacks.run("store_probe", *ports)
        assert set(record["stores"]) == set(ports), record
        assert attacks.findings("store_probe", record, set()) == [], record


@ray.remote(num_cpus=0)
class Peer:
    """A stand-in rank: one that fails in a collective, one still waiting in it."""

    def fail(self) -> None:
        raise RuntimeError("[gloo] Connection closed by peer")

    def wait(self) -> None:
        time.sleep(60)


def test_a_rank_failing_because_its_peer_died_is_blamed_on_the_dead_peer(ray_cluster: None) -> None:
    # The soak's rank_kill on four ranks ended a job for good (CI, stop 35): a live rank whose
    # peer was SIGKILLed fails in their collective and can report before Ray reports the death,
    # so the job saw "rank 1 failed" (a named error: not requeued) instead of "rank 3 died".
    live, dead, slow = Peer.remote(), Peer.remote(), Peer.remote()
    stuck, waiting = dead.wait.remote(), slow.wait.remote()
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(live.fail.remote())
    ray.kill(dead)  # its death shows only after the live rank's error, the order the soak hit
    # a grace far beyond the death's showing (it ends there): a loaded machine must not make it a flake
    error = ActorGroup._root_cause(1, "train", raised.value, [waiting, stuck], {waiting: 2, stuck: 3}, grace_s=120.0)
    assert (error.rank, error.transient) == (3, True), error
    assert "actor rank 3 died during train" in str(error)

    # No peer dies within the grace: the rank that raised is named, and its error is not transient.
    error = ActorGroup._root_cause(1, "train", raised.value, [waiting], {waiting: 2}, grace_s=1.0)
    assert (error.rank, error.transient) == (1, False), error
    assert "actor rank 1 failed during train" in str(error) and "Connection closed by peer" in str(error)
    ray.kill(slow)
    ray.kill(live)


# The loss aggregations, each with another policy loss and the entropy bonus: the per-rank share
# must be normalised by the whole minibatch's counts, whatever they are.
LOSS_SETTINGS = {
    "token-mean": {},
    "seq-mean-token-mean": {"loss_agg_mode": "seq-mean-token-mean", "policy_loss": "gspo", "entropy_coef": 0.01},
    "seq-mean-token-sum": {"loss_agg_mode": "seq-mean-token-sum", "policy_loss": "cispo"},
    "seq-mean-token-sum-norm": {"loss_agg_mode": "seq-mean-token-sum-norm", "entropy_coef": 0.01},
}


# The one-rank, one-micro-batch run each split is held against, by its algo settings: the
# gradient and the token-budget tests share those with the same settings (a rank start costs
# more CPU than its training).
Whole = tuple[dict[str, torch.Tensor], dict[str, float], dict[str, torch.Tensor], dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def whole_runs(pool: Pool, model_path: str) -> Callable[[Config], Whole]:
    """``whole(cfg)``: (start weights, metrics, gradients, weights) of one rank training
    ``GRADIENT_BATCH`` in one micro-batch with ``cfg``'s algo settings, made once per settings."""
    done: dict[str, Whole] = {}

    def whole(cfg: Config) -> Whole:
        key = repr(cfg.algo)
        if key not in done:
            with pool.group(cfg, model_path, 1) as g:
                start = tensors(g)
                metrics = g.train(0, make_batch(*GRADIENT_BATCH))
                done[key] = start, metrics, tensors(g, grads=True), tensors(g)
        return done[key]

    return whole


GRADIENT_BATCH = 9, 7  # samples, seed: shards of 4 and 5 on two ranks


def whole_cfg(algo: dict[str, object]) -> Config:
    cfg = make_cfg(micro_batch_size=64, grad_clip=1e9)
    for k, v in algo.items():
        setattr(cfg.algo, k, v)
    return cfg


@pytest.mark.parametrize("loss", list(LOSS_SETTINGS))
def test_gradient_is_global_token_mean(pool: Pool, model_path: str, whole_runs, loss: str) -> None:
    """2 ranks x small micro-batches == 1 rank x one micro-batch: same gradient, same step."""
    batch = make_batch(*GRADIENT_BATCH)  # shards of 4 and 5, micro-batches of 2 -> uneven
    cfg_split, cfg_whole = make_cfg(micro_batch_size=2, grad_clip=1e9), whole_cfg(LOSS_SETTINGS[loss])
    for k, v in LOSS_SETTINGS[loss].items():
        setattr(cfg_split.algo, k, v)
    start, m_whole, g_whole, w_whole = whole_runs(cfg_whole)
    with pool.group(cfg_split, model_path, 2) as split:
        m_split = split.train(0, batch)
        g_split = tensors(split, grads=True)
        w_split = tensors(split, rank=1)
    assert m_split["tokens"] == m_whole["tokens"]
    assert m_split["pg_loss"] == pytest.approx(m_whole["pg_loss"], rel=1e-5, abs=1e-7)
    assert m_split["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-5)
    # Each step is exactly one AdamW step from the start with the gradient rank 0 reports (rank
    # 1's weights: a rank that stepped with its own shard's gradient differs), and that gradient
    # is the whole batch's, up to the order of the sums.
    assert_one_adamw_step(w_split, start, g_split, cfg_split)
    assert_one_adamw_step(w_whole, start, g_whole, cfg_whole)
    for k in g_whole:
        torch.testing.assert_close(g_split[k], g_whole[k], rtol=1e-5, atol=1e-8)
        # Adam's first step is lr * g / (|g| + eps): where |g| is near eps (1e-8), rounding noise
        # in g changes the step, so compare the weights where the gradient is well above it.
        clear = g_whole[k].abs() > 1e-5
        torch.testing.assert_close(w_split[k][clear], w_whole[k][clear], rtol=1e-6, atol=1e-6)


def assert_one_adamw_step(
    after: dict[str, torch.Tensor], start: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], cfg: Config
) -> None:
    """``after`` is, bit for bit, ``start`` moved by one step of torch's AdamW with ``grads``."""
    a = cfg.actor
    for k, g in grads.items():
        p = torch.nn.Parameter(start[k].clone())
        p.grad = g.clone()
        torch.optim.AdamW([p], lr=a.lr, betas=tuple(a.adam_betas), eps=a.adam_eps, weight_decay=a.weight_decay).step()
        assert torch.equal(after[k], p.detach()), f"{k}: not one AdamW step with the reported gradient"
        assert not torch.equal(after[k], start[k]) or not g.any(), f"{k}: did not move"


# Micro-batches by tokens (issue 31, item 8): packed rows, or padded rows within a token budget,
# each with a loss and aggregation whose normalisation or per-sample terms a wrong layout breaks
# (the sequence ratio of gspo, per-sample means, the reference model's logprobs, TIS weights).
TOKEN_BUDGET_SETTINGS = {
    "token-mean-packed": ({}, True),
    "seq-mean-token-mean-gspo-entropy-packed": (
        {"loss_agg_mode": "seq-mean-token-mean", "policy_loss": "gspo", "entropy_coef": 0.01},
        True,
    ),
    "seq-mean-token-sum-cispo-padded": ({"loss_agg_mode": "seq-mean-token-sum", "policy_loss": "cispo"}, False),
    "seq-mean-token-sum-norm-kl-tis-packed": (
        {"loss_agg_mode": "seq-mean-token-sum-norm", "kl_coef": 0.1, "kl_estimator": "low_var_kl", "tis": True},
        True,
    ),
}


@pytest.mark.parametrize("setting", list(TOKEN_BUDGET_SETTINGS))
def test_token_budget_micro_batches_give_the_padded_gradient(
    pool: Pool, model_path: str, whole_runs, setting: str
) -> None:
    """2 ranks x micro-batches of <= 20 tokens (packed or padded) == 1 rank x one padded
    micro-batch: the same loss, gradient and step. The two ranks form different numbers of
    micro-batches, and the first-fit puts samples out of their order."""
    batch = make_batch(*GRADIENT_BATCH)  # shards of 4 and 5 samples
    knobs, packed = TOKEN_BUDGET_SETTINGS[setting]
    lengths = sample_lengths(batch)
    groups = [first_fit_decreasing(lengths[:4], 20, not packed), first_fit_decreasing(lengths[4:], 20, not packed)]
    assert [len(g) for g in groups] == [2, 3], groups
    assert any(g != list(range(g[0], g[-1] + 1)) for g in groups[1]), groups  # not a contiguous slice
    cfg_budget = make_cfg(max_tokens_per_micro_batch=20, sequence_packing=packed, grad_clip=1e9)
    for k, v in knobs.items():
        setattr(cfg_budget.algo, k, v)
    _, m_whole, g_whole, _ = whole_runs(whole_cfg(knobs))
    with pool.group(cfg_budget, model_path, 2) as split:
        m_split = split.train(0, batch)
        g_split = tensors(split, grads=True)
    assert m_split["tokens"] == m_whole["tokens"]
    for key in ("pg_loss", "kl", "entropy", "clipfrac", "rollout_logprob_abs_diff", "grad_norm"):
        assert m_split[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key
    for k in g_whole:
        torch.testing.assert_close(g_split[k], g_whole[k], rtol=1e-5, atol=1e-7)


KL_BATCH = 9, 5  # samples, seed


def packed_run(model_path: str, pool: Pool | None = None) -> tuple[list, list[str], dict[str, torch.Tensor]]:
    """Two ranks in packed micro-batches of <= 20 tokens (the first-fit puts samples out of
    order), two steps a rollout, algo.kl_in_reward: KL_BATCH's per-sample KL to the reference,
    two rollouts, the KL again. Returns (the KLs and metrics, fingerprints, rank 0's weights).
    ``pool``: on a group of the pool, else on one started for it."""
    cfg = make_cfg(max_tokens_per_micro_batch=20, num_steps_per_rollout=2)
    cfg.algo.kl_coef, cfg.algo.kl_in_reward, cfg.algo.kl_estimator = 0.1, True, "k1"
    with pool.group(cfg, model_path, 2) if pool else Group(cfg, model_path, 2) as g:
        answers: list = [g.kl_to_reference(make_batch(*KL_BATCH)).tolist()]
        answers += [g.train(r, make_batch(12, seed=r)) for r in range(2)]
        answers.append(g.kl_to_reference(make_batch(*KL_BATCH)).tolist())
        return answers, g.fingerprints(), tensors(g)


@pytest.fixture(scope="module")
def packed(pool: Pool, model_path: str) -> tuple[list, list[str], dict[str, torch.Tensor]]:
    return packed_run(model_path, pool)


def test_packed_training_is_deterministic(packed, model_path: str) -> None:
    """Packed micro-batches on two ranks, two steps a rollout: a rerun on ranks started for it
    gives every metric, measured KL and weight bit for bit (the first run was on reused ranks)."""
    assert packed_run(model_path)[:2] == packed[:2]
    assert len(set(packed[1])) == 1 and packed[0][2]["optimizer_steps"] == 4


def test_the_entropy_bonus_keeps_entropy_higher(pool: Pool, model_path: str) -> None:
    """The same rollouts with and without algo.entropy_coef: after a few steps the policy trained
    with the bonus has the higher entropy (the metric is the policy's before each rollout)."""
    entropy = {}
    for coef in (0.0, 0.5):
        cfg = make_cfg(micro_batch_size=8)
        cfg.algo.entropy_coef = coef
        with pool.group(cfg, model_path, 1) as g:
            start = g.train(0, make_batch(8, seed=0))["entropy"]
            for rollout_id in range(1, 5):
                entropy[coef] = g.train(rollout_id, make_batch(8, seed=rollout_id))["entropy"]
    assert entropy[0.5] > entropy[0.0], (start, entropy)


def test_save_load_resumes_bit_exact(ray_cluster: None, model_path: str, tmp_path: Path) -> None:
    """Four data-parallel ranks (two can hide a summation-order difference: a + b == b + a): the
    first step after a load gives the uninterrupted run's loss, gradients and weights, bit for
    bit. The uninterrupted ranks take that step as their second (DDP rebuilt its gradient
    buckets there, so a resumed DDP rank rounded its sum differently: issue 34). With a warmup
    and a cosine decay, the resumed steps take the rate of the same step (issue 31)."""
    ranks = 4
    cfg = make_cfg(micro_batch_size=3, num_steps_per_rollout=2)
    cfg.actor.lr_schedule, cfg.actor.lr_warmup_steps, cfg.actor.lr_decay_steps = "cosine", 1, 6
    cfg.actor.min_lr = 1e-3
    ckpt, again = tmp_path / "ckpt", tmp_path / "again"
    with Group(cfg, model_path, ranks) as a:
        a.train(0, make_batch(16, seed=0))
        a.save(str(ckpt))
        saved_fp = a.fingerprints()[0]
        uninterrupted_metrics = a.train(1, make_batch(16, seed=1))
        uninterrupted_grads = tensors(a, rank=3, grads=True)
        uninterrupted = a.fingerprints()
    assert len(set(uninterrupted)) == 1
    actor = ckpt / "actor"
    names = {p.name for p in actor.iterdir()}
    assert {"config.json", "model.safetensors", "optim.safetensors"} | {
        f"rng_rank{r}.pt" for r in range(ranks)
    } <= names
    assert "tokenizer.json" in names

    # The saved model is a plain HF checkpoint.
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(actor)).num_parameters() > 0

    with Group(cfg, model_path, ranks) as b:
        b.load(str(ckpt))
        assert b.fingerprints() == [saved_fp] * ranks
        b.save(str(again))  # what was loaded, written back out: must equal what was saved
        resumed_metrics = b.train(1, make_batch(16, seed=1))
        resumed_grads = tensors(b, rank=3, grads=True)
        assert b.fingerprints() == uninterrupted
    assert resumed_metrics == uninterrupted_metrics  # every float, exactly
    # the last step is the 4th (index 3): 2 after the 1-step warmup, of the 5 of the decay
    assert resumed_metrics["lr"] == pytest.approx(1e-3 + 9e-3 * (1 + math.cos(math.pi * 2 / 5)) / 2, rel=1e-12)
    assert resumed_grads.keys() == uninterrupted_grads.keys()
    for name, g in uninterrupted_grads.items():
        assert torch.equal(resumed_grads[name], g), name

    o1, o2 = read_optimizer(actor), read_optimizer(again / "actor")
    assert o1["param_groups"] == o2["param_groups"]
    assert o1["state"].keys() == o2["state"].keys() and len(o1["state"]) > 0
    for i in o1["state"]:
        for key, value in o1["state"][i].items():
            assert torch.equal(value, o2["state"][i][key]), (i, key)
    for rank in range(ranks):
        r1 = torch.load(actor / f"rng_rank{rank}.pt", weights_only=True)
        r2 = torch.load(again / "actor" / f"rng_rank{rank}.pt", weights_only=True)
        assert r1["python"] == r2["python"] and torch.equal(r1["torch"], r2["torch"])
        assert torch.equal(r1["numpy_key"], r2["numpy_key"])
    w1, w2 = load_file(actor / "model.safetensors"), load_file(again / "actor" / "model.safetensors")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_a_checkpoint_of_another_shape_is_refused_before_any_weight_changes(
    ray_cluster: None, model_path: str, tmp_path: Path
) -> None:
    from rlhpc.model import TinyModelConfig, build_tiny_model

    wider = build_tiny_model(
        tmp_path / "wider", TinyModelConfig(intermediate_size=2 * TinyModelConfig().intermediate_size)
    )
    cfg = make_cfg()
    with Group(cfg, str(wider), 1) as w:
        w.save(str(tmp_path / "ckpt"))
    with Group(cfg, model_path, 1) as g:
        before = g.fingerprints()
        with pytest.raises(
            ActorRankError, match=r"does not fit the model: .* of another shape \(model\.layers\.0\.mlp"
        ):
            g.load(str(tmp_path / "ckpt"))
        assert g.fingerprints() == before  # nothing was read into the parameters


def test_a_snapshot_is_what_gets_written_while_training_goes_on(pool: Pool, model_path: str, tmp_path: Path) -> None:
    cfg = make_cfg(micro_batch_size=3, num_steps_per_rollout=2)
    ckpt, blocking = tmp_path / "ckpt", tmp_path / "blocking"
    with pool.group(cfg, model_path, 2) as a:
        a.train(0, make_batch(10, seed=0))
        a.save(str(blocking))  # the same state, saved the blocking way
        a.snapshot(str(ckpt))
        snapped = a.fingerprints()
        # The ranks write on their checkpoint threads while their main threads train the next rollout.
        writer = threading.Thread(target=a.write_snapshot)
        writer.start()
        a.train(1, make_batch(10, seed=1))
        writer.join()
        uninterrupted = a.fingerprints()
        assert uninterrupted != snapped
    for name in ("model.safetensors", "optim.safetensors", "rng_rank0.pt", "rng_rank1.pt", "actor_meta.json"):
        assert (ckpt / "actor" / name).read_bytes() == (blocking / "actor" / name).read_bytes(), name
    with Group(cfg, model_path, 2) as b:
        b.load(str(ckpt))
        assert b.fingerprints() == snapped
        b.train(1, make_batch(10, seed=1))
        assert b.fingerprints() == uninterrupted


def test_kl_against_initial_model(pool: Pool, model_path: str, tmp_path: Path) -> None:
    cfg = make_cfg(micro_batch_size=4)
    cfg.algo.kl_coef = 0.1
    with pool.group(cfg, model_path, 1) as g:
        no_store_for_the_other_user(g)  # one rank: its store is in its own process
        first = g.train(0, make_batch(6, seed=0))
        assert first["kl"] == 0.0  # policy == reference before the first step
        second = g.train(1, make_batch(6, seed=1))
        assert second["kl"] > 0
        assert second["loss"] == pytest.approx(second["pg_loss"] + 0.1 * second["kl"])
        g.save(str(tmp_path / "ckpt"))
    with Group(cfg, model_path, 1) as g:
        g.load(str(tmp_path / "ckpt"))
        # the reference is the initial model, not the checkpoint: KL is nonzero at once
        assert g.train(2, make_batch(6, seed=2))["kl"] > 0


def test_the_reference_is_reset_every_interval_and_a_resume_restores_it(
    ray_cluster: None, model_path: str, tmp_path: Path
) -> None:
    """algo.ref_update_interval = 2: the reference is the initial model until rollout 1 is
    trained, then that policy (equal to it right after the reset, behind it after rollout 2).
    A checkpoint after rollout 2 holds it: the resumed rank has the same reference (not the
    initial model, nor the checkpoint's policy) and trains rollout 3 exactly as the
    uninterrupted one (its KL term reads the reference)."""
    cfg = make_cfg(micro_batch_size=4)
    cfg.algo.kl_coef, cfg.algo.ref_update_interval = 0.1, 2
    ckpt = tmp_path / "ckpt"
    with Group(cfg, model_path, 1) as a:
        initial = a.fingerprints()[0]
        assert a.reference_fingerprints() == [initial]
        a.train(0, make_batch(6, seed=0))
        assert a.reference_fingerprints() == [initial] != a.fingerprints()
        a.train(1, make_batch(6, seed=1))
        reset = a.fingerprints()[0]
        assert a.reference_fingerprints() == [reset] != [initial]
        # the policy about to be trained is the reference: no KL in the first step, as at the start
        assert a.train(2, make_batch(6, seed=2))["kl"] == 0.0
        assert a.reference_fingerprints() == [reset] != a.fingerprints()
        a.save(str(ckpt))
        uninterrupted_metrics = a.train(3, make_batch(6, seed=3))
        uninterrupted = a.fingerprints()
        assert a.reference_fingerprints() == uninterrupted  # the second reset
    assert uninterrupted_metrics["kl"] != 0  # k1: a sum of log ratios, of either sign
    with Group(cfg, model_path, 1) as b:
        b.load(str(ckpt))
        assert b.reference_fingerprints() == [reset]
        assert b.train(3, make_batch(6, seed=3)) == uninterrupted_metrics
        assert b.fingerprints() == uninterrupted == b.reference_fingerprints()


def test_kl_in_reward_measures_each_samples_kl_as_transformers_does(packed, model_path: str) -> None:
    """algo.kl_in_reward: two ranks in packed micro-batches of <= 20 tokens (the first-fit puts
    samples out of order) give every sample's sum_t KL_t in the batch's order, as a plain
    transformers forward of each sample does; the loss then has no KL term."""
    (before, *metrics, measured), _, weights = packed
    assert before == [0.0] * KL_BATCH[0]  # the policy is the reference
    for m in metrics:
        assert m["kl"] == 0.0 and m["loss"] == m["pg_loss"]
    expected = sequence_k1_by_transformers(model_path, weights, make_batch(*KL_BATCH))
    assert measured == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert all(x != 0 for x in expected)


def test_update_weights_reaches_engine_bit_exact(ray_cluster: None, model_path: str, tmp_path: Path) -> None:
    from rlhpc.engine_server.host import EngineActor
    from rlhpc.weights.tensor_transport import sendable_as_is
    from rlhpc.wire.client import EngineClient  # the rollout side only for this test

    engine = EngineActor.options(num_cpus=0.5).remote(model_path, str(tmp_path / "logs"), 0, 120.0, None)
    try:
        with Group(make_cfg(micro_batch_size=4), model_path, 2) as g:
            client = EngineClient(ray.get(engine.url.remote()))
            # disaggregated: a gloo broadcast group; then colocated: shared-memory handles (reconnect),
            # the weights themselves in shared memory from then on, trained and pushed again
            for version, colocate in ((1, False), (2, True), (3, True)):
                g.train(version, make_batch(8, seed=version))
                g.connect_rollout([client.base_url], [1], colocate)
                shared = ray.get(
                    g.workers[0].__ray_call__.remote(lambda w: sendable_as_is([t for _, t in w._hf_named(False)]))
                )
                assert shared == colocate  # sent as they are: no staging copy
                g.update_weights(version)
                assert client.get_weight_version() == str(version)
                actor = tensors(g, rank=1)
                got = engine_weights(client, list(actor))
                for name, t in actor.items():
                    assert torch.equal(got[name], t), f"{name} differs after sync (colocate={colocate})"
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine)


def test_the_weights_a_push_sends_lie_back_to_back(pool: Pool, model_path: str, tmp_path: Path) -> None:
    """The parameters lie back to back in the order a push sends them, so a weight-sync bucket
    is a view of them, not a copy: from the start, after optimizer steps and after a load."""

    def sent_as_one_view(worker: object) -> bool:  # runs in the rank (nested: pickled by value)
        from rlhpc.weights.tensor_transport import adjacent_bytes

        return adjacent_bytes([t for _, t in worker._hf_named(grads=False)]) is not None  # type: ignore[attr-defined]

    with pool.group(make_cfg(micro_batch_size=4), model_path, 1) as g:
        worker = g.workers[0]
        assert ray.get(worker.__ray_call__.remote(sent_as_one_view))
        g.train(0, make_batch(8, seed=0))
        g.save(str(tmp_path / "ckpt"))
        g.load(str(tmp_path / "ckpt"))
        g.train(1, make_batch(8, seed=1))
        assert ray.get(worker.__ray_call__.remote(sent_as_one_view))


# ------------------------------------------------------------------ LoRA (actor.lora, issue 45)


def response_logprobs(model: torch.nn.Module, batch) -> list[list[float]]:
    """Each sample's response-token logprobs by a plain forward of that sample alone."""
    out = []
    with torch.no_grad():
        for prompt, response in zip(batch.prompt_ids, batch.response_ids):
            lp = torch.log_softmax(model(input_ids=torch.tensor([prompt + response])).logits[0].float(), -1)
            out.append([float(lp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(response)])
    return out


def test_lora_trains_the_adapters_alone_saves_them_as_peft_does_and_resumes_identical(
    ray_cluster: None, model_path: str, tmp_path: Path
) -> None:
    """Two data-parallel ranks with LoRA on three of the llama's linear layers and the KL penalty:
    only the adapted weights move (the push sends base + scale B A under the base's names), the
    optimizer holds the adapters alone, the reference stays the base (adapters off: no copy),
    the checkpoint is PEFT's and peft loads it onto the base with the trainer's logprobs, the KL
    equals the one to a separate frozen base, the merge command's model generates as the
    adapter-on model, and a resumed group trains the next rollout bit for bit."""
    import importlib.util
    import json

    from peft import PeftModel
    from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
    from transformers import AutoModelForCausalLM

    from rlhpc.actor.checkpoint_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from rlhpc.config import LoraConfig

    assert (ADAPTER_CONFIG, ADAPTER_WEIGHTS) == (CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME)

    def policy_logprobs(worker, batch):  # runs in the rank (nested: pickled by value)
        with torch.no_grad():
            mb = worker._on_device(batch)
            lp = mb.per_sample(worker._token_logprobs(worker._logits(worker._policy(train=False), mb), mb.ids))
            return [lp[i][mb.mask[i].bool()].tolist() for i in range(len(batch))]

    cfg = make_cfg(micro_batch_size=3, num_steps_per_rollout=2)
    cfg.actor.lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    cfg.algo.kl_coef, cfg.algo.kl_estimator = 0.1, "k1"
    ckpt, actor, probe = tmp_path / "ckpt", tmp_path / "ckpt" / "actor", make_batch(*KL_BATCH)
    base = load_file(Path(model_path) / "model.safetensors")
    with Group(cfg, model_path, 2) as a:
        start = a.fingerprints()
        assert a.reference_fingerprints() == start  # B = 0: the policy starts as the base
        adapters = [ray.get(w.lora_adapter.remote())[1] for w in a.workers]
        assert all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])  # every rank's A alike
        first = a.train(0, make_batch(10, seed=0))
        assert first["grad_norm"] > 0
        a.save(str(ckpt))
        saved_fp = a.fingerprints()
        assert saved_fp[0] == saved_fp[1] != start[0]
        merged = tensors(a)  # what a push sends: the base's names, adapted weights merged
        kl = a.kl_to_reference(probe)
        trainer = ray.get(a.workers[0].__ray_call__.remote(policy_logprobs, probe))
        adapter_config, adapter = a.lora_adapter()
        uninterrupted_metrics = a.train(1, make_batch(10, seed=1))
        uninterrupted = a.fingerprints()
        assert a.reference_fingerprints() == start  # the reference never moves
    assert uninterrupted_metrics["kl"] != 0  # k1: a sum of log ratios, of either sign

    assert merged.keys() == base.keys()
    moved = {n for n in base if not torch.equal(merged[n], base[n])}
    assert moved == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}  # fmt: skip
    names = {p.name for p in actor.iterdir()}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "optim.safetensors", "config.json"} <= names
    assert "model.safetensors" not in names  # megabytes, not the model
    optim = read_optimizer(actor)["state"]
    assert sum(s["exp_avg"].numel() for s in optim.values()) == sum(t.numel() for t in adapter.values())
    assert adapter_config == json.loads((actor / ADAPTER_CONFIG).read_text()) and adapter_config["r"] == 4
    on_disk = load_file(actor / ADAPTER_WEIGHTS)
    assert on_disk.keys() == adapter.keys() and all(torch.equal(on_disk[n], t) for n, t in adapter.items())

    # peft loads the checkpoint onto the base: the trainer's logprobs, and its KL to a separate frozen base
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), str(actor)).eval()
    frozen = AutoModelForCausalLM.from_pretrained(model_path).eval()
    expected = response_logprobs(with_adapter, probe)
    for got, want in zip(trainer, expected):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    k1 = [sum(p) - sum(r) for p, r in zip(expected, response_logprobs(frozen, probe))]
    assert kl.tolist() == pytest.approx(k1, rel=1e-4, abs=1e-6) and all(x != 0 for x in k1)

    # the merge command: a plain HF model with the pushed weights, generating as the adapter-on model
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOLS / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["merge-lora", str(ckpt), str(tmp_path / "merged"), "--base", model_path]) == 0
    assert tool.main(["merge-lora", str(ckpt), str(tmp_path / "merged"), "--base", model_path]) == 2  # not over it
    plain = load_file(tmp_path / "merged" / "model.safetensors")
    assert plain.keys() == merged.keys() and all(torch.equal(plain[n], merged[n]) for n in merged)
    merged_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    prompt = torch.tensor([probe.prompt_ids[0]])
    greedy = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(merged_model.generate(prompt, **greedy), with_adapter.generate(input_ids=prompt, **greedy))

    with Group(cfg, model_path, 2) as b:
        b.load(str(ckpt))
        assert b.fingerprints() == saved_fp
        assert b.train(1, make_batch(10, seed=1)) == uninterrupted_metrics  # every float, exactly
        assert b.fingerprints() == uninterrupted
