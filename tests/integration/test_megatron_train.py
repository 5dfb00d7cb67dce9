"""Training steps through megatron-core's DDP + optimizer on CPU over gloo, checked against HF + torch AdamW."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
if torch.cuda.is_available():
    # These run megatron on the CPU through rlhpc.actor.megatron.cpu_shim, which refuses a GPU process.
    pytest.skip(
        "a CUDA device is present: a CPU/gloo test of megatron training; not written for GPU processes",
        allow_module_level=True,
    )

import torch.nn.functional as F  # noqa: E402

from rlhpc.actor.megatron.convert import hf_to_megatron, load_into, megatron_to_hf, model_state_dict  # noqa: E402
from rlhpc.model import TinyModelConfig, build_tiny_model, load_model  # noqa: E402

# Identical hyperparameters on both sides. Without apex/Transformer Engine, megatron's "adam" is
# torch.optim.AdamW itself (decoupled weight decay, eps added to sqrt(v_hat)), so with weight
# decay 0 the update rule is the same; what is under test is megatron's plumbing around it (DDP
# grad buffers, grad-norm + clipping, param groups, the converted weights).
STEPS = 3
LR = 1e-2
BETAS = (0.9, 0.999)
# eps 1e-6 rather than 1e-8: Adam's first step moves a weight by lr * g / (|g| + eps), whose
# sensitivity to the gradient is up to lr / eps at g ~ 0. HF and megatron gradients differ by
# fp32 rounding (~1e-9 absolute: different GEMM shapes for fused QKV / gate+up), so with
# eps=1e-8 a handful of near-zero-gradient weights (4 of 129k) land 6.7e-5 apart after one step,
# while with eps=1e-6 the bound is lr * 1e-9 / 1e-6 = 1e-5 (measured max 8.6e-6).
EPS = 1e-6
CLIP = 1.0
# Weights after STEPS steps: within 2x the bound above. Adam moves weights by up to
# LR * STEPS = 3e-2 here, so this is ~0.07% of the motion; a wrong step (missing clip, wrong
# lr/betas/bias correction, a grad left out of the buffer) is off by ~1e-3 or more.
WEIGHT_ATOL = 2e-5


def _rendezvous(where: Path) -> str:
    """An init_method through a file in ``where`` (fresh): no port to probe and lose before the
    ranks bind it (mp.spawn starts them after the probe)."""
    where.mkdir(parents=True, exist_ok=True)
    return f"file://{where / 'rendezvous'}"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("megatron_train") / "llama", TinyModelConfig(seed=5))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron_train_qwen3")
    return {a: build_tiny_model(root / a, TinyModelConfig(architecture=a, seed=5)) for a in ("qwen3", "qwen3_moe")}


@pytest.fixture(scope="module")
def megatron_tp1(tmp_path_factory):
    """This process as a gloo group of one with megatron's model-parallel state (TP=1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rlhpc.actor.megatron.cpu_shim import apply_cpu_shim, remove_cpu_shim

    apply_cpu_shim()
    dist.init_process_group("gloo", init_method=_rendezvous(tmp_path_factory.mktemp("rdzv")), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    remove_cpu_shim()


def _batch(vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab_size, (4, 16), generator=g)


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # Only the real vocab: megatron's padded rows must not enter the softmax (HF has none).
    logits = logits[:, :-1, :vocab_size]
    return F.cross_entropy(logits.reshape(-1, vocab_size), ids[:, 1:].reshape(-1))


def _train_hf(model_dir: Path, ids: torch.Tensor) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    hf = load_model(model_dir).train()
    vocab = hf.config.vocab_size
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses, grad_norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = _next_token_loss(hf(ids).logits, ids, vocab)
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    return losses, grad_norms, {k: v.detach().clone() for k, v in hf.state_dict().items()}


def _train_megatron(
    model_dir: Path, ids: torch.Tensor, tp_size: int = 1, tp_rank: int = 0, ep_size: int = 1, ep_rank: int = 0, **moe
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """STEPS megatron steps; returns losses, pre-clip grad norms and this rank's megatron weights."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from rlhpc.actor.megatron.model import build_gpt_model

    hf = load_model(model_dir)
    vocab = hf.config.vocab_size
    # Full-vocab logits on every rank (gathered over TP), so the loss is the plain HF one.
    if ep_size > 1:
        moe["expert_model_parallel_size"] = ep_size
    gpt = build_gpt_model(hf.config, tp_size=tp_size, parallel_output=False, **moe)
    load_into(gpt, hf_to_megatron(hf.state_dict(), hf.config, tp_size, tp_rank, ep_size, ep_rank))
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    model = DistributedDataParallel(gpt.config, ddp_config, gpt)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        weight_decay=0.0,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_eps=EPS,
        bf16=False,
        fp16=False,
        use_distributed_optimizer=False,
        clip_grad=CLIP,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    model.train()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    losses, grad_norms = [], []
    for _ in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = _next_token_loss(model(ids, pos, attention_mask=None), ids, vocab)
        loss.backward()
        model.finish_grad_sync()
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append(loss.item())
        grad_norms.append(grad_norm)
    return losses, grad_norms, model_state_dict(gpt)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_megatron_adam_steps_match_hf_adamw(tiny_llama, tiny_qwen3, megatron_tp1, arch):
    model_dir = tiny_llama if arch == "llama" else tiny_qwen3[arch]
    ids = _batch(load_model(model_dir).config.vocab_size)
    hf_losses, hf_grad_norms, hf_weights = _train_hf(model_dir, ids)
    # HF's loss has no load-balancing term (output_router_logits off): none on megatron's side either
    moe = {"moe_aux_loss_coeff": 0.0} if arch == "qwen3_moe" else {}
    mg_losses, mg_grad_norms, mg_state = _train_megatron(model_dir, ids, **moe)
    mg_weights = megatron_to_hf([mg_state], load_model(model_dir).config)

    assert mg_losses[-1] < mg_losses[0]
    assert hf_losses[-1] < hf_losses[0]
    # Same forward (logits match HF to 1e-5, test_megatron_convert) -> same losses; grad norms
    # (pre-clip; all > CLIP here, so clipping acts on every step) from megatron's optimizer.
    assert min(mg_grad_norms) > CLIP
    torch.testing.assert_close(torch.tensor(mg_losses), torch.tensor(hf_losses), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(mg_grad_norms), torch.tensor(hf_grad_norms), rtol=1e-5, atol=1e-5)
    assert set(mg_weights) == set(hf_weights)
    for name, ref in hf_weights.items():
        torch.testing.assert_close(mg_weights[name], ref, rtol=0, atol=WEIGHT_ATOL, msg=name)


def _two_rank_worker(rank: int, rendezvous_dir: str, out_dir: str, runs: list[tuple[str, str, int]]) -> None:
    """Each run (name, model, EP size; TP = 2 / EP) in turn on the same two processes (their start,
    torch and megatron-core's import, costs more than the training): a gloo group and megatron's
    parallel state of its own per run, torn down before the next."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rlhpc.actor.megatron.cpu_shim import apply_cpu_shim, remove_cpu_shim

    torch.set_num_threads(1)
    for name, model_dir, ep_size in runs:
        apply_cpu_shim()
        dist.init_process_group("gloo", init_method=_rendezvous(Path(rendezvous_dir) / name), rank=rank, world_size=2)
        try:
            tp_size = 2 // ep_size
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp_size, expert_model_parallel_size=ep_size
            )
            model_parallel_cuda_manual_seed(1234)
            ids = _batch(load_model(model_dir).config.vocab_size)
            moe = {"moe_aux_loss_coeff": AUX_COEFF} if ep_size > 1 else {}
            result = _train_megatron(Path(model_dir), ids, tp_size, rank % tp_size, ep_size, rank // tp_size, **moe)
            torch.save(result, os.path.join(out_dir, f"{name}_rank{rank}.pt"))
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            remove_cpu_shim()


@pytest.fixture(scope="module")
def two_rank_runs(tiny_llama, tiny_qwen3, tmp_path_factory) -> Path:
    """Two gloo ranks' training, as files: the llama at TP=2 (``tp2``), the MoE at EP=2 (``ep2``)."""
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("two_rank")
    runs = [("tp2", str(tiny_llama), 1), ("ep2", str(tiny_qwen3["qwen3_moe"]), 2)]
    mp.spawn(_two_rank_worker, args=(str(root / "rdzv"), str(root), runs), nprocs=2, join=True)
    return root


def test_tp2_steps_match_tp1(tiny_llama, megatron_tp1, two_rank_runs):
    config = load_model(tiny_llama).config
    ids = _batch(config.vocab_size)
    tp1_losses, tp1_grad_norms, tp1_state = _train_megatron(tiny_llama, ids)
    tp1 = megatron_to_hf([tp1_state], config)
    ranks = [torch.load(two_rank_runs / f"tp2_rank{r}.pt") for r in range(2)]
    for losses, grad_norms, _ in ranks:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(tp1_losses), rtol=1e-5, atol=1e-5)
        # The grad norm is reduced over the TP group (replicated norms counted once): the full model's.
        torch.testing.assert_close(torch.tensor(grad_norms), torch.tensor(tp1_grad_norms), rtol=1e-5, atol=1e-5)
    tp2 = megatron_to_hf([state for _, _, state in ranks], config)
    assert set(tp2) == set(tp1)
    # TP=2 vs TP=1 differ only by fp32 rounding of split GEMMs / reductions: same bound as vs HF.
    for name, ref in tp1.items():
        torch.testing.assert_close(tp2[name], ref, rtol=0, atol=WEIGHT_ATOL, msg=name)


AUX_COEFF = 1e-2  # large enough to move the router measurably in three steps


def test_ep2_steps_match_ep1(tiny_qwen3, megatron_tp1, two_rank_runs):
    """Qwen3-MoE with its experts split over two ranks (EP=2 over gloo, the allgather dispatcher;
    both ranks see the same batch, DP=2 for the dense weights) trains as one rank holding all
    four, the router's load-balancing loss included."""
    model_dir = tiny_qwen3["qwen3_moe"]
    config = load_model(model_dir).config
    ids = _batch(config.vocab_size)
    ep1_losses, ep1_grad_norms, ep1_state = _train_megatron(model_dir, ids, moe_aux_loss_coeff=AUX_COEFF)
    ep1 = megatron_to_hf([ep1_state], config)
    # the aux loss reaches the router (else this test would not see it scaled wrong under EP)
    without_aux = megatron_to_hf([_train_megatron(model_dir, ids, moe_aux_loss_coeff=0.0)[2]], config)
    router = "model.layers.0.mlp.gate.weight"
    assert (without_aux[router] - ep1[router]).abs().max() > 20 * WEIGHT_ATOL
    ranks = [torch.load(two_rank_runs / f"ep2_rank{r}.pt") for r in range(2)]
    for losses, grad_norms, _ in ranks:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ep1_losses), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(grad_norms), torch.tensor(ep1_grad_norms), rtol=1e-5, atol=1e-5)
    ep2 = megatron_to_hf([state for _, _, state in ranks], config, ep_size=2)
    assert set(ep2) == set(ep1)
    for name, ref in ep1.items():
        torch.testing.assert_close(ep2[name], ref, rtol=0, atol=WEIGHT_ATOL, msg=name)
