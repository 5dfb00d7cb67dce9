"""One data-parallel training rank: an HF causal LM wrapped in DDP, trained with the GRPO loss.

``TrainWorker`` is a Ray actor; ``ActorGroup`` (group.py) places one per actor slot and fans
calls out to all of them. Every method that runs a collective must be called on all ranks.

Gradients are the *global* token mean: each micro-batch loss (a token mean over its own
tokens) is weighted by ``its tokens / minibatch tokens of all ranks`` and by the world size,
because DDP averages gradients over ranks. So any split of a minibatch over ranks and
micro-batches gives the gradient of one big batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
from collections.abc import Iterable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rlhpc.algo.grpo import kl_k3, masked_mean, policy_loss
from rlhpc.batch import RolloutBatch
from rlhpc.config import Config
from rlhpc.errors import RlhpcError
from rlhpc.model import load_model, load_tokenizer

log = logging.getLogger(__name__)

ACTOR_SUBDIR = "actor"
OPTIM_FILE = "optim.pt"
META_FILE = "actor_meta.json"
PG_TIMEOUT = timedelta(minutes=30)


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(n)``, sizes differing by at most one."""
    return [(k * n // parts, (k + 1) * n // parts) for k in range(parts)]


def _rollout_logprob_tensor(batch: RolloutBatch, shape: torch.Size) -> torch.Tensor:
    """Engine logprobs laid out like ``loss_mask`` (position t predicts token t+1)."""
    out = torch.zeros(shape, dtype=torch.float32)
    for i, (p, lps) in enumerate(zip(batch.prompt_ids, batch.rollout_logprobs)):
        if lps:
            out[i, len(p) - 1 : len(p) - 1 + len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return out


def get_rng_state() -> dict[str, Any]:
    """All RNG states of this process as tensors/ints (loadable with ``weights_only=True``)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy_bit_generator": np_state["bit_generator"],
        "numpy_key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
        "numpy_pos": int(np_state["state"]["pos"]),
        "numpy_has_gauss": int(np_state["has_gauss"]),
        "numpy_gauss": float(np_state["gauss"]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(
        {
            "bit_generator": state["numpy_bit_generator"],
            "state": {"key": state["numpy_key"].numpy().astype(np.uint32), "pos": state["numpy_pos"]},
            "has_gauss": state["numpy_has_gauss"],
            "gauss": state["numpy_gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds CUDA


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of named tensors: names, shapes, dtypes and bytes."""
    h = hashlib.sha256()
    for name, t in named:
        t = t.cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def node_ip_address() -> str:
    """This node's address as Ray knows it (the Slurm NodeAddr); loopback outside a Ray worker."""
    try:
        import ray
    except ImportError:  # a rank driven without Ray (tools/gpu_check.py)
        return "127.0.0.1"
    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


class RankBase:
    """What every training backend's rank shares: device, seeding, rendezvous, weight-sync channel.

    Subclasses build their model in ``init_process_group`` and implement ``load``, ``save``,
    ``train``, ``_send_weights``, ``offload``, ``onload``, ``state_fingerprint`` and
    ``named_tensors``. Every method that runs a collective must be called on all ranks.
    """

    def __init__(self, cfg: Config, model_path: str, rank: int, world_size: int):
        logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        self.cfg = cfg
        self.model_path = model_path
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cpu":
            # CI machines have 2 cores shared by all ranks; oversubscription is slower, not faster.
            torch.set_num_threads(int(os.environ.get("RLHPC_TORCH_THREADS", "1")))
        else:
            torch.cuda.set_device(self.device)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
            torch.use_deterministic_algorithms(True)
        seed_everything(cfg.seed + rank)
        self._store: dist.TCPStore | None = None
        self.tokenizer = None
        self.pad_id = 0
        self.sender = None
        self.optimizer_steps = 0
        self.offloaded = False

    # ------------------------------------------------------------------ setup

    def node_ip(self) -> str:
        return node_ip_address()

    def master_addr_port(self) -> tuple[str, int]:
        """Rank 0: start the rendezvous store on a port the OS picks (no probe-then-bind race)."""
        assert self.rank == 0, "only rank 0 hosts the rendezvous store"
        if self._store is None:
            self._store = dist.TCPStore(
                self.node_ip(), 0, self.world_size, is_master=True, wait_for_workers=False, timeout=PG_TIMEOUT
            )
        return self.node_ip(), self._store.port

    def _join(self, master_addr: str, master_port: int) -> None:
        """Join the default torch.distributed group and load the tokenizer."""
        if self._store is None:
            self._store = dist.TCPStore(master_addr, master_port, self.world_size, is_master=False, timeout=PG_TIMEOUT)
        dist.init_process_group(
            self.backend, store=self._store, rank=self.rank, world_size=self.world_size, timeout=PG_TIMEOUT
        )
        self.tokenizer = load_tokenizer(self.model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))

    def _barrier(self) -> None:
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def _all_reduce_sum(self, values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=group)
        return t.tolist()

    def _micro_batches(self, batch: RolloutBatch) -> list[list[RolloutBatch]]:
        """Per optimizer step: the micro-batches of this rank's share of that minibatch."""
        steps = []
        for start, stop in split_even(len(batch), self.cfg.actor.num_steps_per_rollout):
            mbs = self.cfg.actor.micro_batch_size
            steps.append([batch.slice(i, min(i + mbs, stop)) for i in range(start, stop, mbs)])
        return steps

    # ------------------------------------------------------------------ loss and metrics

    def _grpo_loss(self, logprobs: torch.Tensor, item: dict[str, torch.Tensor], sums: dict[str, float]) -> torch.Tensor:
        """A micro-batch's loss (policy + KL penalty); adds its token-weighted terms to ``sums``."""
        algo = self.cfg.algo
        tokens = float(item["mask"].sum())
        pg, clipfrac = policy_loss(logprobs, item["old"], item["adv"], item["mask"], algo.eps_clip, algo.eps_clip_high)
        loss = pg
        if "ref" in item:
            kl = masked_mean(kl_k3(logprobs, item["ref"]), item["mask"])
            loss = loss + algo.kl_coef * kl
            sums["kl"] += float(kl.detach()) * tokens
        sums["pg_loss"] += float(pg.detach()) * tokens
        sums["clipfrac"] += float(clipfrac.detach()) * tokens
        return loss

    def _rollout_metrics(
        self, sums: dict[str, float], local_tokens: float, grad_norms: list[float], skipped: int, group=None
    ) -> dict[str, float]:
        """Token means over the whole rollout (summed over the data-parallel ``group``) + step stats."""
        keys = list(sums)
        totals = self._all_reduce_sum([sums[k] for k in keys] + [local_tokens], group=group)
        tokens = max(totals[-1], 1.0)
        # every token is in exactly one minibatch, so these are token means over the rollout
        metrics = {k: v / tokens for k, v in zip(keys, totals[:-1])}
        metrics["loss"] = metrics["pg_loss"] + self.cfg.algo.kl_coef * metrics["kl"]
        finite = [g for g in grad_norms if math.isfinite(g)]  # already global (post all-reduce)
        metrics["grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["tokens"] = totals[-1]
        metrics["optimizer_steps"] = float(self.optimizer_steps)
        metrics["skipped_steps"] = float(skipped)
        return metrics

    # ------------------------------------------------------------------ weight sync

    def connect_rollout(self, engine_urls: list[str], engine_world_sizes: list[int], colocate: bool) -> None:
        """Rank 0 opens the weight-sync channel to the engines; the other ranks have no part in it."""
        if self.rank != 0:
            return
        if self.sender is not None:  # reconnecting (e.g. after an engine restart): drop the old channel
            self._close_sender()
        from rlhpc.rollout.client import EngineClient  # late: training never needs the rollout side
        from rlhpc.rollout.weight_sync import make_weight_sender

        clients = [EngineClient(url) for url in engine_urls]
        self.sender = make_weight_sender(
            clients,
            engine_world_sizes,
            colocate=colocate,
            master_address=self.node_ip(),
            backend=self.backend,
            bucket_bytes=self.cfg.rollout.update_weight_buffer_mb * 2**20,
        )
        self.sender.connect()
        log.info("rank 0: weight sync connected to %d engine(s)", len(clients))

    def _send_device(self) -> torch.device:
        # gloo sends from host memory; nccl/CUDA IPC from the GPU. Offloaded weights travel to
        # the GPU one tensor at a time, so the peak is one bucket, not the model.
        return torch.device("cpu") if self.backend == "gloo" else self.device

    def update_weights(self, version: int) -> str | None:
        """Push the current weights (HF names) to all engines as ``version``. Works while offloaded.

        Returns None, or (rank 0) why the push failed on the engines' side (one died or
        refused): every rank still completes the call, so the caller can restart the engine,
        connect again and push again instead of leaving the other ranks stuck in a collective.
        """
        if self.rank == 0 and self.sender is None:
            raise RuntimeError("update_weights before connect_rollout: no weight sender")
        error = None
        try:
            self._send_weights(version)
        except RlhpcError as e:
            error = str(e)
            log.warning("rank %d: weight push %d failed: %s", self.rank, version, error)
        self._barrier()
        return error

    def _send_weights(self, version: int) -> None:
        raise NotImplementedError

    def _close_sender(self) -> None:
        try:
            self.sender.close()
        except Exception:  # closing is best effort: the engines may be gone already
            log.warning("rank %d: closing the weight sender failed", self.rank, exc_info=True)
        self.sender = None

    def shutdown(self) -> None:
        if self.sender is not None:
            self._close_sender()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None


class TrainWorker(RankBase):
    """Data-parallel rank ``rank`` of ``world_size`` (PyTorch DDP). Call order: (rank 0)
    ``master_addr_port``, (all) ``init_process_group``, ``load``, then ``train`` / ``save`` /
    ``update_weights``..."""

    def __init__(self, cfg: Config, model_path: str, rank: int, world_size: int):
        super().__init__(cfg, model_path, rank, world_size)
        self.module: torch.nn.Module | None = None  # the unwrapped HF model
        self.ddp: DDP | None = None
        self.ref: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def init_process_group(self, master_addr: str, master_port: int) -> None:
        """Join torch.distributed, load the model, wrap it in DDP, build AdamW (+ the ref model)."""
        self._join(master_addr, master_port)
        a = self.cfg.actor
        # eval(): no dropout, so the no-grad "old" pass and the training pass compute the same
        # function and the PPO ratio is exactly 1 before the first step.
        self.module = load_model(self.model_path, self.device).eval()
        self._wrap_ddp()
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=a.lr, betas=tuple(a.adam_betas), eps=a.adam_eps, weight_decay=a.weight_decay
        )
        if self.cfg.kl_needed:
            self.ref = load_model(self.model_path, self.device).eval().requires_grad_(False)
        log.info(
            "rank %d/%d: %s on %s, %d params%s",
            self.rank,
            self.world_size,
            self.backend,
            self.device,
            sum(p.numel() for p in self.module.parameters()),
            ", with reference model" if self.ref is not None else "",
        )

    def _wrap_ddp(self) -> None:
        ids = [self.device.index] if self.device.type == "cuda" else None
        # The only buffers (rotary tables) are equal on every rank; syncing them costs next to nothing.
        self.ddp = DDP(self.module, device_ids=ids)

    # ------------------------------------------------------------------ checkpoint

    def load(self, ckpt_dir: str | None) -> None:
        """Restore weights, optimizer and this rank's RNG from ``ckpt_dir/actor/`` (None: fresh).

        The reference model stays the initial model: KL is measured to where training started.
        """
        if ckpt_dir is None:
            return
        d = Path(ckpt_dir) / ACTOR_SUBDIR
        for name in ("config.json", OPTIM_FILE):
            if not (d / name).is_file():
                raise FileNotFoundError(f"checkpoint {d} has no {name}: incomplete or not an actor checkpoint")
        saved = load_model(d, "cpu")
        with torch.no_grad():
            self.module.load_state_dict(saved.state_dict())
        del saved
        self.optimizer.load_state_dict(torch.load(d / OPTIM_FILE, map_location=self.device, weights_only=True))
        if (d / META_FILE).is_file():
            self.optimizer_steps = int(json.loads((d / META_FILE).read_text()).get("optimizer_steps", 0))
        rng = d / rng_file(self.rank)
        if rng.is_file():
            set_rng_state(torch.load(rng, weights_only=True))
        else:
            # Resuming on more ranks than saved: this rank keeps its fresh seed (not bit-exact).
            log.warning("rank %d: %s has no RNG state for this rank; keeping the seeded RNG", self.rank, d)
        log.info("rank %d: restored actor state from %s", self.rank, d)

    def save(self, ckpt_dir: str) -> None:
        """Write ``ckpt_dir/actor/``: HF model + tokenizer, optimizer (rank 0), RNG (every rank)."""
        d = Path(ckpt_dir) / ACTOR_SUBDIR
        d.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self.module.save_pretrained(d)
            self.tokenizer.save_pretrained(d)
            torch.save(self.optimizer.state_dict(), d / OPTIM_FILE)
            meta = {
                "world_size": self.world_size,
                "optimizer_steps": self.optimizer_steps,
                "initial_model": self.model_path,
            }
            (d / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        torch.save(get_rng_state(), d / rng_file(self.rank))
        self._barrier()

    # ------------------------------------------------------------------ training

    def _logits_logprobs(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [N, L-1, V] (float32) and logprobs of the actual next tokens [N, L-1]."""
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return logits, logprobs

    def train(self, rollout_id: int, batch: RolloutBatch) -> dict[str, float]:
        """``num_steps_per_rollout`` optimizer steps on this rank's shard; returns global metrics."""
        self.onload()  # the driver may have offloaded us for generation; no-op otherwise
        a = self.cfg.actor
        steps = self._micro_batches(batch)
        # Tensors per micro-batch, padded once and reused by the old/ref pass and every step.
        prepared: list[list[dict[str, torch.Tensor]]] = []
        sums = {"entropy": 0.0, "rollout_logprob_abs_diff": 0.0}
        local_tokens = 0.0
        with torch.no_grad():
            for mbs in steps:
                prepared.append([])
                for mb in mbs:
                    ids, attn, mask = mb.to_padded(self.pad_id)
                    ids, attn, mask = ids.to(self.device), attn.to(self.device), mask.to(self.device)
                    logits, old = self._logits_logprobs(self.module, ids, attn)
                    item = {"ids": ids, "attn": attn, "mask": mask, "old": old, "adv": mb.advantages.to(self.device)}
                    if self.ref is not None:
                        item["ref"] = self._logits_logprobs(self.ref, ids, attn)[1]
                    entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
                    rollout_lp = _rollout_logprob_tensor(mb, mask.shape).to(self.device)
                    sums["entropy"] += float((entropy * mask).sum())
                    sums["rollout_logprob_abs_diff"] += float(((old - rollout_lp).abs() * mask).sum())
                    local_tokens += float(mask.sum())
                    prepared[-1].append(item)
                    del logits, entropy

        step_tokens = self._all_reduce_sum([sum(float(it["mask"].sum()) for it in mbs) for mbs in prepared])
        loss_sums = {"pg_loss": 0.0, "kl": 0.0, "clipfrac": 0.0}
        grad_norms: list[float] = []
        skipped = 0
        for k, mbs in enumerate(prepared):
            self.optimizer.zero_grad(set_to_none=True)
            global_tokens = max(step_tokens[k], 1.0)
            if not mbs:
                self._dummy_backward()  # this rank has no sample in this minibatch; DDP still reduces
            for j, it in enumerate(mbs):
                tokens = float(it["mask"].sum())
                with self.ddp.no_sync() if j < len(mbs) - 1 else nullcontext():
                    _, logprobs = self._logits_logprobs(self.ddp, it["ids"], it["attn"])
                    loss = self._grpo_loss(logprobs, it, loss_sums)
                    # token share of the global minibatch, times world size to undo DDP's averaging
                    (loss * (tokens * self.world_size / global_tokens)).backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), a.grad_clip))
            grad_norms.append(grad_norm)
            if math.isfinite(grad_norm):
                self.optimizer.step()
                self.optimizer_steps += 1
            else:
                # the norm is computed after DDP's all-reduce, so every rank skips the same step
                skipped += 1
                log.warning(
                    "rank %d: rollout %d step %d: grad norm %s, step skipped", self.rank, rollout_id, k, grad_norm
                )

        metrics = self._rollout_metrics({**loss_sums, **sums}, local_tokens, grad_norms, skipped)
        if self.rank == 0:
            log.debug("rollout %d: %s", rollout_id, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        return metrics

    def _dummy_backward(self) -> None:
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        logits = self.ddp(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        (logits.float().sum() * 0.0).backward()

    # ------------------------------------------------------------------ weight sync

    def _send_weights(self, version: int) -> None:
        if self.rank == 0:
            device = self._send_device()
            named = ((n, p.detach().to(device).contiguous()) for n, p in self.module.named_parameters())
            self.sender.send(named, version)

    # ------------------------------------------------------------------ memory

    def offload(self) -> None:
        """Move model, reference model and optimizer state to host memory (CUDA only).

        On CPU there is nothing to free, so this is a no-op. The DDP wrapper is dropped too:
        its gradient buckets are a full model-sized GPU buffer. ``update_weights``, ``save`` and
        ``state_fingerprint`` work while offloaded; ``train`` onloads by itself.
        """
        if self.device.type != "cuda" or self.offloaded:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.ddp = None
        self._move(torch.device("cpu"))
        torch.cuda.empty_cache()
        self.offloaded = True

    def onload(self) -> None:
        """Undo ``offload`` (all ranks together: re-wrapping DDP is a collective)."""
        if self.device.type != "cuda" or not self.offloaded:
            return
        self._move(self.device)
        self._wrap_ddp()
        self.offloaded = False

    def _move(self, device: torch.device) -> None:
        self.module.to(device)
        if self.ref is not None:
            self.ref.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ inspection

    def state_fingerprint(self) -> str:
        """SHA-256 of all parameters (names, shapes, dtypes and bytes)."""
        return fingerprint((n, p.detach()) for n, p in self.module.named_parameters())

    def named_tensors(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """CPU copies of the parameters (or of the last step's gradients): for tests and debugging."""
        out = {}
        for name, p in self.module.named_parameters():
            t = p.grad if grads else p
            out[name] = None if t is None else t.detach().cpu().clone()
        return out
