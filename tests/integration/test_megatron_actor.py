"""The megatron-core actor behind ActorGroup on a local Ray (gloo, CPU shim): same answers as the
PyTorch actor, TP=2 / DP=2 the same as TP=1, torch_dist checkpoints that reshard, weight sync.

A rank process imports torch and megatron-core (about 5 CPU seconds, far more than its training
here): the module's groups take turns on four live processes (``HOSTS``, fresh rank objects
each time, support/rank_hosts.py), a run several tests read is made once, in a module fixture
(``Run``: two rollouts with a checkpoint after the first), and a test adds only the groups its
own promise needs (a resume, a refusal, another layout)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

pytest.importorskip("megatron.core")

from support.actors import engine_weights, make_batch, sequence_k1_by_transformers  # noqa: E402
from support.rank_hosts import HostedGroup, RankHosts  # noqa: E402
from support.tiny_variants import TIED_LLAMA3, build_variant  # noqa: E402

from rlhpc.actor.group import ActorGroup  # noqa: E402
from rlhpc.checkpoint import file_crc32  # noqa: E402
from rlhpc.config import Config  # noqa: E402
from rlhpc.errors import RlhpcError  # noqa: E402
from rlhpc.model import TinyModelConfig, build_tiny_model  # noqa: E402
from rlhpc.weights.expert_names import checkpoint_named  # noqa: E402

pytestmark = pytest.mark.ray

# Weights after four Adam steps, megatron vs PyTorch: both compute the same loss, gradients
# differ by fp32 rounding (fused QKV/fc1 GEMMs, split reductions), and Adam amplifies that for
# near-zero gradients by up to lr/eps. With eps 1e-8 one weight in 10^5 drifted to 1.2e-4;
# eps 1e-6 bounds it (test_megatron_train has the arithmetic). A wrong loss weight, mask or
# missing TP/DP reduction is off by >1e-3.
ADAM_EPS = 1e-6
WEIGHT_ATOL = 5e-5
METRIC_RTOL = 1e-5


# The module's groups take turns on these rank processes (support/rank_hosts.py): one start
# of torch + megatron-core per process for the module, not one per rank of every group.
HOSTS = RankHosts()


@pytest.fixture(scope="module", autouse=True)
def rank_hosts(ray_cluster: None) -> Iterator[RankHosts]:
    yield HOSTS
    HOSTS.close()


def Group(cfg: Config, model_path: str, ranks: int) -> HostedGroup:  # noqa: N802 (support.actors.Group's stand-in)
    return HostedGroup(HOSTS, cfg, model_path, ranks)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TinyModelConfig(seed=3)))


def tensors(group, rank: int = 0) -> dict[str, torch.Tensor]:
    """Full weights in HF names; every rank takes part (TP ranks gather their shards together)."""
    return ray.get([w.named_tensors.remote() for w in group.workers])[rank]


def make_cfg(backend: str = "megatron", tp: int = 1, dist_opt: bool = False, steps: int = 2) -> Config:
    cfg = Config(deterministic=True)
    cfg.actor.backend = backend
    cfg.actor.lr = 1e-2
    cfg.actor.adam_eps = ADAM_EPS
    cfg.actor.micro_batch_size = 3
    cfg.actor.num_steps_per_rollout = steps
    cfg.actor.megatron.tensor_model_parallel_size = tp
    cfg.actor.megatron.use_distributed_optimizer = dist_opt
    return cfg


def make_pp_cfg(pp: int, tp: int = 1, dist_opt: bool = False, steps: int = 2) -> Config:
    cfg = make_cfg(tp=tp, dist_opt=dist_opt, steps=steps)
    cfg.actor.megatron.pipeline_model_parallel_size = pp
    return cfg


def moe_cfg(ep: int, pp: int = 1, coeff: float = 0.0, dist_opt: bool = False) -> Config:
    """Qwen3-MoE at EP=``ep``; the router's aux loss off unless ``coeff``: under EP the
    micro-batches are padded to the EP group's shape and megatron's aux loss counts the pad
    tokens' routing, so EP sizes train alike only without it."""
    cfg = make_pp_cfg(pp, dist_opt=dist_opt)
    cfg.actor.megatron.expert_model_parallel_size = ep
    cfg.actor.megatron.moe_aux_loss_coeff = coeff
    return cfg


Training = tuple[list[dict], dict[str, torch.Tensor]]  # each rollout's metrics, the weights after them


@dataclasses.dataclass
class Run:
    """A group's two rollouts (``train_two``'s batches) with a save after the first."""

    training: Training
    ckpt: Path  # the checkpoint saved after rollout 0
    saved: list[str]  # every rank's state fingerprint at that save


def train_two(cfg: Config, model_path: str, ranks: int, engine_url: str | None = None) -> Training:
    """Two rollouts; with ``engine_url``, then one push there, which must deliver every weight."""
    with Group(cfg, model_path, ranks) as g:
        metrics = [g.train(r, make_batch(12, seed=r)) for r in range(2)]
        if engine_url is not None:
            push_all(g, engine_url)
        return metrics, tensors(g)


def train_saving(cfg: Config, model_path: str, ranks: int, ckpt: Path, g: ActorGroup | None = None) -> Run:
    """``train_two`` with a save after rollout 0 (on the open group ``g`` if given)."""
    with contextlib.nullcontext(g) if g is not None else Group(cfg, model_path, ranks) as g:
        metrics = [g.train(0, make_batch(12, seed=0))]
        g.save(str(ckpt))
        saved = g.fingerprints()
        metrics.append(g.train(1, make_batch(12, seed=1)))
        return Run((metrics, tensors(g)), ckpt, saved)


def push_all(g: ActorGroup, url: str) -> None:
    """Gathered over TP (or from every pipeline stage: rank 0 holds only the first stage's
    layers and the embedding), converted to HF names, bucketed: after one push the engine at
    ``url`` holds the actor's weights, all of them, bit for bit."""
    from rlhpc.wire.client import EngineClient

    client = EngineClient(url)
    g.connect_rollout([url], [1], False)
    g.update_weights(1)
    assert client.get_weight_version() == "1"
    actor = tensors(g, rank=1)
    got = engine_weights(client, list(actor))
    for name, t in actor.items():
        assert torch.equal(got[name], t), name


def assert_same_training(a: Training, b: Training, rtol: float = METRIC_RTOL) -> None:
    for ma, mb in zip(a[0], b[0], strict=True):
        for key in ("pg_loss", "clipfrac", "entropy", "rollout_logprob_abs_diff", "grad_norm", "tokens"):
            assert mb[key] == pytest.approx(ma[key], rel=rtol, abs=1e-7), key
    assert set(a[1]) == set(b[1])
    for name, t in a[1].items():
        torch.testing.assert_close(b[1][name], t, rtol=0, atol=WEIGHT_ATOL, msg=name)


def assert_resumes(cfg: Config, model_path: str, ranks: int, run: Run) -> None:
    """``run``'s checkpoint loads on ``ranks`` ranks at ``cfg``'s layout to the saved weights, bit
    for bit, and training rollout 1 from there gives the run's weights after rollout 1 (which
    takes the saved Adam moments and step too)."""
    assert len(set(run.saved)) == 1  # every rank gathers the same full model
    with Group(cfg, model_path, ranks) as g:
        g.load(str(run.ckpt))
        assert set(g.fingerprints()) == {run.saved[0]}
        g.train(1, make_batch(12, seed=1))
        resumed = tensors(g)
    for name, t in run.training[1].items():
        torch.testing.assert_close(resumed[name], t, rtol=0, atol=WEIGHT_ATOL, msg=name)


def refusal(g: ActorGroup, ckpt: Path) -> str:
    """What ``g`` says when it refuses to load ``ckpt`` (a load that goes through fails the test)."""
    try:
        g.load(str(ckpt))
    except RlhpcError as e:
        return str(e)
    pytest.fail(f"{ckpt} loaded")


@dataclasses.dataclass
class TorchRuns:
    reference: dict[int, Training]  # by data-parallel size
    ckpt: Path  # saved by the one-rank PyTorch actor before it trained


@pytest.fixture(scope="module")
def torch_runs(ray_cluster: None, model_path: str, tmp_path_factory: pytest.TempPathFactory) -> TorchRuns:
    """The PyTorch DDP actor's training on 1 and on 2 data-parallel ranks (a rank's share of a
    rollout is split into minibatches, so DP=2 steps on other minibatches than DP=1)."""
    ckpt = tmp_path_factory.mktemp("torch") / "ckpt"
    with Group(make_cfg("torch"), model_path, 1) as g:
        g.save(str(ckpt))
        metrics = [g.train(r, make_batch(12, seed=r)) for r in range(2)]
        one = (metrics, tensors(g))
    return TorchRuns({1: one, 2: train_two(make_cfg("torch"), model_path, 2)}, ckpt)


@pytest.fixture(scope="module")
def torch_reference(torch_runs: TorchRuns) -> dict[int, Training]:
    return torch_runs.reference


@dataclasses.dataclass
class OneRankRun(Run):
    torch_ckpt_refused: str  # what the load of the PyTorch actor's checkpoint raised


@pytest.fixture(scope="module")
def one_rank_run(torch_runs: TorchRuns, model_path: str, tmp_path_factory: pytest.TempPathFactory) -> OneRankRun:
    """Megatron on one rank: it refuses the PyTorch actor's checkpoint first (before any weight
    changes: it trains on from there as from the model), then ``train_saving``."""
    with Group(make_cfg(), model_path, 1) as g:
        refused = refusal(g, torch_runs.ckpt)
        run = train_saving(make_cfg(), model_path, 1, tmp_path_factory.mktemp("one_rank") / "ckpt", g)
    return OneRankRun(run.training, run.ckpt, run.saved, refused)


def test_megatron_actor_matches_pytorch_actor(torch_reference, one_rank_run: OneRankRun) -> None:
    """Same GRPO loss through vocab-parallel logits (padded vocab masked) as through HF logits
    (a save between the rollouts changes nothing)."""
    assert one_rank_run.training[0][1]["optimizer_steps"] == 4
    assert_same_training(torch_reference[1], one_rank_run.training)


def test_torch_checkpoint_is_refused(one_rank_run: OneRankRun) -> None:
    assert "not written by the megatron actor" in one_rank_run.torch_ckpt_refused


def test_data_parallel_ranks_train_as_pytorch_ddp(torch_reference, model_path: str) -> None:
    """DP=2 (megatron DDP's all-reduce) trains like two PyTorch DDP ranks. (TP=2:
    ``test_token_budget_...`` and ``test_loss_knobs_...``; the distributed optimizer's DP=2:
    ``test_a_checkpoint_before_the_first_step_resumes_exactly``.)"""
    assert_same_training(torch_reference[2], train_two(make_cfg(), model_path, 2))


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_loss_knobs_and_lr_schedule_train_as_in_pytorch(
    model_path: str, ray_cluster: None, tmp_path: Path, tp: int, pp: int
) -> None:
    """The entropy bonus through the vocab shards (its gradient crosses the TP all-reduce), a
    sequence-level aggregation and a warmup + cosine rate: megatron at TP=2 trains as the
    PyTorch actor does (issue 31). At PP=2 the same, and the KL penalty's reference logprobs
    come through the pipeline's forward-only schedule on the reference model's stages. Then
    each pushes its weights (1 MB buckets: several) to an engine: all arrive bit for bit."""

    def knobs(cfg: Config) -> Config:
        cfg.algo.entropy_coef, cfg.algo.loss_agg_mode = 0.05, "seq-mean-token-mean"
        cfg.actor.lr_schedule, cfg.actor.lr_warmup_steps, cfg.actor.lr_decay_steps = "cosine", 1, 4
        if pp > 1:
            cfg.algo.kl_coef = 0.1
        return cfg

    reference = train_two(knobs(make_cfg("torch")), model_path, 1)
    assert reference[0][1]["lr"] == pytest.approx(1e-2 * (1 + math.cos(math.pi * 2 / 3)) / 2)  # step 3 of 1 + 3
    if pp > 1:
        assert reference[0][1]["kl"] > 0
    cfg = knobs(make_pp_cfg(pp, tp=tp))
    cfg.rollout.update_weight_buffer_mb = 1
    with cpu_engine(model_path, tmp_path / "logs") as url:
        got = train_two(cfg, model_path, 2, engine_url=url)
    assert_same_training(reference, got)
    assert got[0][1]["kl"] == pytest.approx(reference[0][1]["kl"], rel=METRIC_RTOL)


@dataclasses.dataclass
class Tp2Run:
    training: Training
    kl_before: torch.Tensor  # kl_to_reference of KL_BATCH before training
    kl_after: torch.Tensor  # and after


KL_BATCH = 7, 5  # samples, seed


@pytest.fixture(scope="module")
def tp2_run(ray_cluster: None, model_path: str) -> Tp2Run:
    """Megatron at TP=2 on two ranks, with a token budget per micro-batch and algo.kl_in_reward
    (a reference model, whose KL goes to the reward, not the loss): two rollouts, the KL of
    a batch to the reference measured before and after them."""
    cfg = make_cfg(tp=2)
    cfg.actor.max_tokens_per_micro_batch = 24
    cfg.algo.kl_coef, cfg.algo.kl_in_reward, cfg.algo.kl_estimator = 0.1, True, "k1"
    with Group(cfg, model_path, 2) as g:
        before = g.kl_to_reference(make_batch(*KL_BATCH))
        metrics = [g.train(r, make_batch(12, seed=r)) for r in range(2)]
        after = g.kl_to_reference(make_batch(*KL_BATCH))
        return Tp2Run((metrics, tensors(g)), before, after)


def test_kl_in_reward_measures_each_samples_kl_through_the_vocab_shards(model_path: str, tp2_run: Tp2Run) -> None:
    """algo.kl_in_reward on megatron at TP=2 (logprobs across vocab shards): every sample's
    sum_t KL_t, in the batch's order, is a plain transformers forward's; the loss has no KL term."""
    assert tp2_run.kl_before.tolist() == pytest.approx([0.0] * KL_BATCH[0], abs=1e-6)  # the policy is the reference
    for m in tp2_run.training[0]:
        assert m["kl"] == 0.0 and m["loss"] == m["pg_loss"]
    expected = sequence_k1_by_transformers(model_path, tp2_run.training[1], make_batch(*KL_BATCH))
    assert tp2_run.kl_after.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert all(abs(x) > 1e-4 for x in expected)


def test_token_budget_micro_batches_train_as_sample_counts_do(
    torch_reference, model_path: str, tp2_run: Tp2Run
) -> None:
    """actor.max_tokens_per_micro_batch: the PyTorch actor's packed rows and megatron's padded
    micro-batches train, over two rollouts of two steps, as the PyTorch actor on micro-batches
    of 3 samples (issue 31, item 8). Megatron's at TP=2 (vocab shards, one holding only
    padding; megatron-core packs only with Transformer Engine): TP=2 trains as one rank does."""
    budget = make_cfg("torch")
    budget.actor.max_tokens_per_micro_batch = 24
    assert_same_training(torch_reference[1], train_two(budget, model_path, 1))
    assert_same_training(torch_reference[1], tp2_run.training)


@pytest.mark.parametrize(
    ("tp", "dist_opt"), [(2, False), (1, True)], ids=["tp2-to-tp1", "dp2-to-dp1-distributed-optimizer"]
)
def test_an_async_save_writes_the_snapshot_while_training_goes_on(
    ray_cluster: None, model_path: str, tmp_path: Path, tp: int, dist_opt: bool
) -> None:
    """The loop waits for the snapshot only. The shards are written later, on the ranks'
    checkpoint threads, here after one more step and then beside another (its collectives on
    the default group, the write's on the save's own): the checkpoint still holds the state
    at the snapshot, model and optimizer (a write of the live tensors would hold step 1's).
    It resumes on one rank: torch_dist reshards model *and* optimizer state (TP=2 -> TP=1 with
    the plain optimizer, DP=2 -> DP=1 with the distributed one). One optimizer step per
    rollout, so any data-parallel split steps on the same minibatch. (A blocking ``save`` is
    this snapshot and write on one thread.)"""
    ckpt = tmp_path / "ckpt"
    with Group(make_cfg(tp=tp, dist_opt=dist_opt, steps=1), model_path, 2) as g:
        g.train(0, make_batch(12, seed=0))
        g.snapshot(str(ckpt))
        saved = g.fingerprints()
        g.train(1, make_batch(12, seed=1))
        after_one = tensors(g)
        with ThreadPoolExecutor(1) as pool:
            writing = pool.submit(g.write_snapshot)
            g.train(2, make_batch(12, seed=2))
            summed = writing.result(timeout=300)
        assert set(g.fingerprints()).isdisjoint(saved)
    assert (ckpt / "actor" / "dist" / "metadata.json").is_file() and (ckpt / "actor" / "config.json").is_file()
    # the sums the manifest takes instead of reading the files back: every rank's shard file and
    # DCP's metadata, each the file's own
    written = sorted(p.relative_to(ckpt).as_posix() for p in (ckpt / "actor" / "dist").glob("*.distcp"))
    assert len(written) == 2 and set(written) <= set(summed) and "actor/dist/.metadata" in summed
    for rel, (size, crc) in summed.items():
        assert ((ckpt / rel).stat().st_size, file_crc32(ckpt / rel)) == (size, crc), rel
    assert_resumes(make_cfg(dist_opt=dist_opt, steps=1), model_path, 1, Run(([], after_one), ckpt, saved))


@pytest.mark.parametrize(
    ("tp", "pp", "dist_opt"),
    [(1, 1, True), (2, 1, True), (2, 1, False), (1, 2, True)],
    ids=["dp4-distributed-optimizer", "tp2-dp2-distributed-optimizer", "tp2-dp2", "pp2-dp2-distributed-optimizer"],
)
def test_a_resume_on_the_same_layout_is_bit_exact(
    torch_reference, model_path: str, tmp_path: Path, tp: int, pp: int, dist_opt: bool
) -> None:
    """Four ranks, two optimizer steps a rollout: the first rollout trained after a load gives
    the uninterrupted run's metrics and weights exactly (its ranks take that rollout as their
    second; with one model-parallel dimension, more than two data-parallel ranks, so a changed
    summation order would show). A checkpoint's distributed-optimizer state is refused at
    another TP or PP size.

    PP=2 x DP=2 (megatron-core's 1F1B schedule over gloo, the loss on the last stage, the
    no-grad passes through the pipeline too, two micro-batches a step) trains its first two
    rollouts as two PyTorch DDP ranks do: metrics (reported by rank 0, on the first stage) and
    the full weights gathered from both stages; the last stage's loss is scaled by the DP size
    as a single stage's is. (PP=2 alone is a part of this layout.)"""
    ckpt = tmp_path / "ckpt"
    cfg = make_pp_cfg(pp, tp=tp, dist_opt=dist_opt, steps=2)
    samples = 16  # 8 a step: 2 on each of DP=4's ranks
    if pp > 1:  # the PyTorch reference's batches; 3 samples a step on each DP rank, 2 micro-batches
        samples, cfg.actor.micro_batch_size = 12, 2
    with Group(cfg, model_path, 4) as g:
        first = g.train(0, make_batch(samples, seed=0))
        g.save(str(ckpt))
        uninterrupted = [g.train(1, make_batch(samples, seed=1))]
        after_one = tensors(g)
        uninterrupted.append(g.train(2, make_batch(samples, seed=2)))
        weights = g.fingerprints()
    with Group(cfg, model_path, 4) as g:
        g.load(str(ckpt))
        resumed = [g.train(r, make_batch(samples, seed=r)) for r in (1, 2)]
        assert g.fingerprints() == weights
    assert resumed == uninterrupted  # every float, exactly
    if pp > 1:
        assert_same_training(torch_reference[2], ([first, uninterrupted[0]], after_one))
    if dist_opt and (tp > 1 or pp > 1):  # the distributed optimizer's state resumes at the same TP and PP only
        with Group(make_cfg(dist_opt=True), model_path, 1) as g:
            assert f"at TP={tp} PP={pp}" in refusal(g, ckpt)


def test_a_checkpoint_before_the_first_step_resumes_exactly(torch_reference, model_path: str, tmp_path: Path) -> None:
    """A run stopped before its first optimizer step (preempted during the first rollout)
    saves with the distributed optimizer too, whose Adam state does not exist yet: the resumed
    run trains its first rollouts as the uninterrupted one, every float (Adam's step starts at
    0, not at a step the load made up). The uninterrupted run, DP=2 with the distributed
    optimizer (reduce-scatter, sharded Adam state), trains as two PyTorch DDP ranks do."""
    ckpt = tmp_path / "ckpt"
    cfg = make_cfg(dist_opt=True, steps=2)
    with Group(cfg, model_path, 2) as g:
        g.save(str(ckpt))
        initial = g.fingerprints()
        uninterrupted = [g.train(r, make_batch(12, seed=r)) for r in (0, 1)]
        weights = g.fingerprints()
        assert_same_training(torch_reference[2], (uninterrupted, tensors(g)))
    with Group(cfg, model_path, 2) as g:
        g.load(str(ckpt))
        assert g.fingerprints() == initial
        assert [g.train(r, make_batch(12, seed=r)) for r in (0, 1)] == uninterrupted
        assert g.fingerprints() == weights


def test_tied_embeddings_and_llama3_rope_train_as_in_pytorch_and_push_embed_tokens_once(
    ray_cluster: None, model_path: str, tmp_path: Path
) -> None:
    """Llama-3.2-1B's kind, tiny: tied embeddings (megatron's output layer multiplies by the
    vocab-parallel embedding, both uses' gradients in one parameter) and Llama 3 RoPE scaling.
    Megatron at TP=2 trains as the PyTorch actor does (metrics and weights); its HF view, which
    the push sends, holds ``model.embed_tokens.weight`` and no ``lm_head.weight``, and the engine
    (started from another model) ties its lm_head to what arrived, as SGLang does (issue 40)."""
    tied = str(build_variant(Path(model_path), tmp_path / "tied", TIED_LLAMA3, seed=3))
    other = str(build_variant(Path(model_path), tmp_path / "other", TIED_LLAMA3, seed=4))
    reference = train_two(make_cfg("torch"), tied, 1)
    assert "lm_head.weight" not in reference[1]  # named_parameters: the tied one once
    with cpu_engine(other, tmp_path / "logs") as url:
        got = train_and_push(make_cfg(tp=2), tied, 2, url)
        assert "lm_head.weight" not in got.training[1]
        assert_engine_holds(url, {"lm_head.weight": got.training[1]["model.embed_tokens.weight"]})
    assert_same_training(reference, got.training)


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A tiny Qwen3-MoE (4 experts) to train, and another (other seed) for an engine to start from."""
    root = tmp_path_factory.mktemp("moe")
    return tuple(
        str(build_tiny_model(root / f"s{s}", TinyModelConfig(architecture="qwen3_moe", seed=s))) for s in (3, 4)
    )


@contextlib.contextmanager
def cpu_engine(model_path: str, log_dir: Path) -> Iterator[str]:
    """A CPU engine serving ``model_path``; yields its URL."""
    from rlhpc.engine_server.host import EngineActor

    # no CPU of its own: a 4-rank group takes the test cluster's four
    engine = EngineActor.options(num_cpus=0).remote(model_path, str(log_dir), 0, 120.0, None)
    try:
        yield ray.get(engine.url.remote())
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine)


@pytest.fixture
def moe_engine(ray_cluster: None, moe_paths: tuple[str, str], tmp_path: Path) -> Iterator[str]:
    """A CPU engine serving the *other* MoE model: a weight the push leaves out keeps other bytes."""
    with cpu_engine(moe_paths[1], tmp_path / "logs") as url:
        yield url


def assert_engine_holds(url: str, expected: dict[str, torch.Tensor]) -> None:
    """The engine's every weight, by the names SGLang loads (each expert's projections on their
    own), equals ``expected`` (the same names) byte for byte."""
    from rlhpc.wire.client import EngineClient

    got = engine_weights(EngineClient(url), list(expected))
    for name, t in expected.items():
        assert torch.equal(got[name].view(torch.int32), t.float().view(torch.int32)), name


def train_and_push(cfg: Config, model_path: str, ranks: int, url: str, ckpt: Path | None = None) -> Run:
    """``train_saving`` (the save only with ``ckpt``), pushing to the engine at ``url`` before
    (the checkpoint's weights, read from its safetensors file) and after the two rollouts (the
    trainer's, gathered from its ranks). A push that leaves a rank out of a gather hangs: the
    call timeout makes that a failure."""
    cfg.actor.call_timeout_s = 300
    with Group(cfg, model_path, ranks) as g:
        g.connect_rollout([url], [1], False)
        g.update_weights(1)
        assert_engine_holds(url, load_file(str(Path(model_path) / "model.safetensors")))
        if ckpt is not None:
            run = train_saving(cfg, model_path, ranks, ckpt, g)
        else:
            metrics = [g.train(r, make_batch(12, seed=r)) for r in range(2)]
            run = Run((metrics, tensors(g)), Path(), [])
        g.update_weights(2)
        assert_engine_holds(url, dict(checkpoint_named(run.training[1].items())))
        return run


@pytest.fixture(scope="module")
def moe_ep1_run(ray_cluster: None, moe_paths: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Qwen3-MoE at EP=1 on two data-parallel ranks (plain optimizer)."""
    return train_saving(moe_cfg(1), moe_paths[0], 2, tmp_path_factory.mktemp("moe_ep1") / "ckpt")


@pytest.fixture(scope="module")
def moe_ep2_run(ray_cluster: None, moe_paths: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same at EP=2 (plain optimizer), pushing to a CPU engine that serves the *other* MoE
    model (a weight a push leaves out keeps other bytes) before and after training."""
    root = tmp_path_factory.mktemp("moe_ep2")
    with cpu_engine(moe_paths[1], root / "logs") as url:
        return train_and_push(moe_cfg(2), moe_paths[0], 2, url, root / "ckpt")


@dataclasses.dataclass
class FrozenRun:
    metrics: list[dict]
    ckpt: Path  # distributed-optimizer state at EP=2


@pytest.fixture(scope="module")
def moe_frozen_run(
    ray_cluster: None, moe_paths: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> FrozenRun:
    """The MoE model with zero router weights at EP=2, aux loss on, lr 0 (so the router stays
    uniform), distributed optimizer: two rollouts, saved after the first."""
    root = tmp_path_factory.mktemp("moe_frozen")
    uniform = root / "uniform"
    shutil.copytree(moe_paths[0], uniform)
    weights = load_file(uniform / "model.safetensors")
    gates = [name for name in weights if name.endswith(".mlp.gate.weight")]
    assert len(gates) == 2  # one router a layer
    save_file(
        {n: torch.zeros_like(t) if n in gates else t for n, t in weights.items()},
        uniform / "model.safetensors",
        {"format": "pt"},
    )
    frozen = moe_cfg(2, coeff=1e-2, dist_opt=True)
    frozen.actor.lr = 0.0
    run = train_saving(frozen, str(uniform), 2, root / "ckpt")
    return FrozenRun(run.training[0], run.ckpt)


def test_qwen3_moe_expert_parallel_actor(
    moe_paths: tuple[str, str], moe_ep1_run: Run, moe_ep2_run: Run, moe_frozen_run: FrozenRun
) -> None:
    """Qwen3-MoE (QK-norm, 4 experts) behind ActorGroup: EP=2 over the two data-parallel ranks
    trains as EP=1 does and its HF view (the weight push's: experts gathered over the EP group)
    is the EP=1 one; the router's load-balancing loss is logged. The equality runs without the
    aux loss (``moe_cfg``). The EP=2 actor pushes its weights to a CPU engine before and after
    training: every expert (DP rank 1 holds half of them and joins the push's gathers) and
    every other weight arrive byte for byte (issue 40: the push hung)."""
    on_disk = safe_open(str(Path(moe_paths[0]) / "model.safetensors"), framework="pt").keys()
    assert sum(".mlp.experts." in n for n in on_disk) == 2 * 4 * 3  # layers x experts x projections
    # EP pads micro-batches to the group's shape (other GEMM shapes): a near-zero pg_loss moved
    # 1.3e-5 relative; the weights keep the tight bound
    assert_same_training(moe_ep1_run.training, moe_ep2_run.training, rtol=1e-4)
    assert "moe_load_balancing_loss" not in moe_ep1_run.training[0][0]
    # A router with zero weights gives every expert 1/E of each token, and the Switch loss,
    # E * sum_i f_i * P_i with sum_i f_i = 1, is then exactly 1 whatever experts the tokens go to
    # (the pad tokens EP adds too): logged per layer and forward, so 1. lr 0 keeps it uniform.
    for metrics in moe_frozen_run.metrics:
        assert metrics["moe_load_balancing_loss"] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize(
    ("saved", "resumed_ep"), [("moe_ep2_run", 1), ("moe_ep1_run", 2)], ids=["ep2-to-ep1", "ep1-to-ep2"]
)
def test_a_moe_checkpoint_resumes_at_another_expert_parallel_size(
    request: pytest.FixtureRequest, moe_paths: tuple[str, str], saved: str, resumed_ep: int
) -> None:
    """Qwen3-MoE saved at one EP size (at EP=2 each rank saves its 2 of the 4 experts) resumes
    at another on the same two data-parallel ranks: torch_dist keys the experts by their global
    number and the optimizer is chained (dense, experts) at any EP size, so the resumed actor
    holds the saved weights bit for bit and continues the run (plain optimizer: its Adam
    moments reshard too). Aux loss off, as in the EP training test."""
    assert_resumes(moe_cfg(resumed_ep), moe_paths[0], 2, request.getfixturevalue(saved))


def test_distributed_optimizer_refuses_another_expert_parallel_size(
    moe_paths: tuple[str, str], moe_frozen_run: FrozenRun
) -> None:
    with Group(moe_cfg(1, dist_opt=True), moe_paths[0], 1) as g:
        assert "EP=2; this actor runs at TP=1 PP=1 EP=1" in refusal(g, moe_frozen_run.ckpt)


def test_a_checkpoint_resumes_at_another_pipeline_size(ray_cluster: None, model_path: str, tmp_path: Path) -> None:
    """torch_dist reshards model and (plain) optimizer state across pipeline stages (each stage
    saves its layers under their global numbers) and TP x PP changes: a TP=2 x PP=2 checkpoint
    resumes at TP=1 PP=1 (PP=2 -> 1 alone is a part of it) to the saved weights bit for bit and
    continues the run. One optimizer step per rollout, so any data-parallel split steps on the
    same minibatch."""
    run = train_saving(make_pp_cfg(2, tp=2, steps=1), model_path, 4, tmp_path / "ckpt")
    assert_resumes(make_cfg(steps=1), model_path, 1, run)


def test_a_one_rank_checkpoint_resumes_on_two_pipeline_stages(model_path: str, one_rank_run: OneRankRun) -> None:
    """The other way: PP=1 -> PP=2 (the same data-parallel size: two optimizer steps a rollout
    step on the same minibatches)."""
    assert_resumes(make_pp_cfg(2), model_path, 2, one_rank_run)


def test_qwen3_moe_pipeline_with_expert_parallelism(
    moe_paths: tuple[str, str], moe_ep1_run: Run, moe_engine: str
) -> None:
    """Qwen3-MoE at PP=2 x DP=2 with EP=2 on each stage trains as PP=1, EP=1 on two ranks: the
    MoE pipeline pads a step's micro-batches to one shape (its dispatcher gathers equal
    blocks), its stages' experts are gathered for the HF view. Without the aux loss, which
    counts the pad tokens' routing (as in the EP test above). Its pushes (each stage's experts
    gathered with DP rank 1's, broadcast over the pipeline) reach the engine byte for byte."""
    got = train_and_push(moe_cfg(2, pp=2), moe_paths[0], 4, moe_engine)
    assert_same_training(moe_ep1_run.training, got.training, rtol=1e-4)


def test_qwen3_moe_pipeline_with_expert_parallelism_trains_one_step_per_rollout(moe_paths: tuple[str, str]) -> None:
    """PP=2 x EP=2 with one optimizer step per rollout: its first train call is the pipeline
    schedule's first forward, which sets the MoE aux-loss scale into the one the step set (a
    0-dim scale there refused the schedule's [1] one and the first rollout crashed)."""
    cfg = moe_cfg(2, pp=2)
    cfg.actor.num_steps_per_rollout = 1
    with Group(cfg, moe_paths[0], 4) as g:
        assert math.isfinite(g.train(0, make_batch(12, seed=0))["pg_loss"])


def test_virtual_pipeline_stages_train_as_one_stage(tmp_path: Path, ray_cluster: None) -> None:
    """PP=2 with two virtual stages (megatron-core's interleaved 1F1B: rank 0 holds layers 0
    and 2, rank 1 layers 1 and 3) trains a 4-layer model as PP=1 on the same batches: metrics,
    the KL to the reference's chunks, the weights gathered from every chunk. Three micro-batches
    a step, which the schedule takes in groups of PP: one empty one is added. Its checkpoint
    names global layers: it resumes at PP=1 to the saved weights and the same next rollout."""
    path = str(build_tiny_model(tmp_path / "four", TinyModelConfig(num_hidden_layers=4, seed=3)))

    def cfg(pp: int, vp: int | None) -> Config:
        c = make_pp_cfg(pp)
        c.actor.micro_batch_size = 2  # 12 samples, 2 steps: 3 micro-batches a step
        c.actor.megatron.virtual_pipeline_model_parallel_size = vp
        c.algo.kl_coef = 0.1
        return c

    one_stage = train_two(cfg(1, None), path, 1)
    chunked = train_saving(cfg(2, 2), path, 2, tmp_path / "ckpt")
    assert_same_training(one_stage, chunked.training)
    for a, b in zip(one_stage[0], chunked.training[0]):
        assert a["kl"] > 0 and b["kl"] == pytest.approx(a["kl"], rel=METRIC_RTOL)
    assert_resumes(cfg(1, None), path, 1, chunked)
