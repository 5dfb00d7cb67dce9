"""What every training backend's rank shares: setup, the GRPO train step, checkpoint RNG, weight sync.

A backend (``TrainWorker``: PyTorch; ``MegatronTrainWorker``: megatron-core TP x DP)
subclasses ``RankBase``: it builds its model in ``init_process_group``, writes and reads its
own checkpoint format, offloads its own way, and supplies the few backend steps of the shared
training loop (forward, gradient reduction, clip + optimizer step; see ``train``) and its
weights in HF names. Every method that runs a collective must be called on all ranks.

Gradients are those of the whole minibatch's loss (``algo.loss_agg_mode``): each micro-batch's
loss is its share of that loss, normalised by the minibatch's token and sample counts summed
over all data-parallel ranks (``AggNorm``), and multiplied by the data-parallel size, because
both backends average gradients over those ranks. So any split of a minibatch over ranks and
micro-batches gives the gradient of one big batch. Both reduce them
in a layout fixed by the model (``FlatGrads``; megatron's contiguous grad buffer), never by
the history of the process, so a resumed rank sums in the same order as the rank it replaces.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rlhpc import moe_routing
from rlhpc.actor.checkpoint_dir import rng_file
from rlhpc.actor.lr_schedule import lr_at
from rlhpc.actor.packing import first_fit_decreasing, micro_batch_groups, pack_rows, sample_lengths, select
from rlhpc.actor.rng import get_rng_state, seed_everything, set_rng_state
from rlhpc.actor.spec import ActorSpec
from rlhpc.algo.grpo import (
    AggNorm,
    agg_counts,
    agg_loss,
    distill_advantages,
    kl_estimate,
    policy_loss_per_token,
    sequence_kl,
    truncated_is_weights,
)
from rlhpc.batch import RolloutBatch
from rlhpc.errors import RlhpcError
from rlhpc.model import load_tokenizer
from rlhpc.util.files import node_tmp_dir
from rlhpc.weights.expert_names import checkpoint_named
from rlhpc.weights.fp8 import quantized_named

log = logging.getLogger(__name__)

PG_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Rendezvous:
    """Where the actor's ranks meet to form their group (``RankBase.rendezvous``): in rank 0's
    process (one rank), a file (``where``) on their one node, or ``where:port`` over TCP."""

    kind: str  # "process", "file" or "tcp"
    where: str = ""
    port: int = 0


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(n)``, sizes differing by at most one."""
    return [(k * n // parts, (k + 1) * n // parts) for k in range(parts)]


def _rollout_logprob_tensor(
    batch: RolloutBatch, shape: torch.Size, logprobs: list[list[float]] | None = None
) -> torch.Tensor:
    """Engine logprobs (or ``logprobs``, the teacher's) laid out like ``loss_mask`` (position t
    predicts token t+1)."""
    width = shape[1]
    rows = []
    for p, lps in zip(batch.prompt_ids, batch.rollout_logprobs if logprobs is None else logprobs):
        before = len(p) - 1 if lps else 0
        rows.append([0.0] * before + list(lps) + [0.0] * (width - before - len(lps)))
    return torch.tensor(rows, dtype=torch.float32)


def _routing_tensor(routed: list[torch.Tensor], width: int) -> torch.Tensor:
    """Each sample's engine routing [its tokens - 1, layers, top-k] as the right-padded rows
    [N, width, layers, top-k] of the micro-batch's ids; ``UNKNOWN`` where none was given."""
    layers, top_k = routed[0].shape[1:]
    out = torch.full((len(routed), width, layers, top_k), moe_routing.UNKNOWN, dtype=torch.long)
    for i, r in enumerate(routed):
        out[i, : r.shape[0]] = r.long()
    return out


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


@dataclass
class MicroBatch:
    """One micro-batch on the device, padded (or packed) once and reused by the no-grad passes
    and its step. Packed, the forward runs on one row of all its samples (``ids``,
    ``positions``) and ``per_sample`` lays its per-position results out as the padded rows
    [N, L-1] that every per-token tensor below has, so the loss is computed as padded."""

    ids: torch.Tensor  # [N, L] right-padded (causal attention never lets a real token see a pad); packed: [1, T]
    attention: torch.Tensor | None  # [N, L]; packed: None (the position ids delimit the samples)
    mask: torch.Tensor  # [N, L-1] 1 where position t predicts a response token
    advantages: torch.Tensor  # [N]
    rollout_logprobs: torch.Tensor | None = None  # [N, L-1] the engines' logprobs (the behaviour policy)
    old_logprobs: torch.Tensor | None = None  # [N, L-1] the policy before this rollout's steps
    ref_logprobs: torch.Tensor | None = None  # [N, L-1] the reference model (KL penalty in the loss only)
    tis_weights: torch.Tensor | None = None  # [N, L-1] truncated importance weights (algo.tis only)
    teacher_logprobs: torch.Tensor | None = None  # [N, L-1] the teacher's (a teacher section only)
    positions: torch.Tensor | None = None  # packed: [1, T] position ids, from 0 in each sample
    unpack_index: torch.Tensor | None = None  # packed: [N, L-1] into the packed row's positions
    # A vision-language model's further forward inputs: its images' pixels and grid sizes (and
    # padded, its 3-D positions); packed, ``positions`` holds the text and 3-D ones [4, 1, T].
    vision: dict[str, torch.Tensor] | None = None
    # algo.routing_replay: the experts the engine routed each token to, [N, L, layers, top-k]
    # (packed: [1, T, ...]); ``moe_routing.UNKNOWN`` where no engine routed it (pads, the last token)
    routed_experts: torch.Tensor | None = None

    def per_sample(self, x: torch.Tensor) -> torch.Tensor:
        """A per-position result of the forward ([rows, width-1]) as the padded [N, L-1]."""
        return x if self.unpack_index is None else x.reshape(-1)[self.unpack_index]

    @property
    def tokens(self) -> float:
        return float(self.mask.sum())

    @property
    def seqs(self) -> float:
        """Samples with at least one response token (the ``seq-mean-*`` aggregations' count)."""
        return agg_counts(self.mask)[1]


class RankBase:
    """One training rank. Subclasses implement ``init_process_group``, ``load``, ``snapshot``,
    ``write_snapshot``, ``offload``, ``onload``, ``_hf_named`` and the train-step hooks below ``train``."""

    # The backend's ``_logits`` runs a packed micro-batch (``MicroBatch.positions``).
    can_pack = False

    def __init__(self, spec: ActorSpec, model_path: str, rank: int, world_size: int):
        logging.basicConfig(level=spec.log_level, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        self.spec = spec
        if spec.actor.lr_schedule != "constant" and spec.lr_decay_steps == 0:
            raise RlhpcError(
                f"actor.lr_schedule = {spec.actor.lr_schedule!r} decays to the run's last step, which is not known here",
                "set actor.lr_decay_steps (or rollout.num_rollout)",
            )
        self.model_path = model_path
        self.rank = rank
        self.world_size = world_size
        # Data parallelism: every rank by default; megatron narrows it once its parallel state is up.
        self.dp_size, self.dp_rank = world_size, rank
        self.dp_group: dist.ProcessGroup | None = None  # None: the default group
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cpu":
            # CI machines have 2 cores shared by all ranks; oversubscription is slower, not faster.
            torch.set_num_threads(int(os.environ.get("RLHPC_TORCH_THREADS", "1")))
        else:
            torch.cuda.set_device(self.device)
        if spec.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
            torch.use_deterministic_algorithms(True)
        seed_everything(spec.seed + rank)
        self._store: dist.TCPStore | None = None
        self.tokenizer = None
        self.pad_id = 0
        self.sender = None
        self.ref: torch.nn.Module | None = None  # frozen reference model, when the KL penalty is on
        # rollouts trained when the reference was last reset to the policy (algo.ref_update_interval); 0: the initial model
        self.ref_reset_at = 0
        self.optimizer = None
        self.optimizer_steps = 0
        self.offloaded = False

    # ------------------------------------------------------------------ setup

    def node_ip(self) -> str:
        return node_ip_address()

    def rendezvous(self, one_node: bool) -> Rendezvous:
        """Rank 0: the store the ranks form their group through, made here; where it is.

        Whoever reaches a torch ``TCPStore`` can read and write its keys, with no key of its own
        (torch has none), for as long as the group lives: the actor's store listened on every
        address for the whole run, even with one rank (issue 43, item 7). So: one rank keeps an
        in-process store; ranks that all run on one node meet in a ``FileStore`` in this node's
        private dir (0700: no other user, no port); only ranks on several nodes need a
        ``TCPStore``, bound to this node's address alone (not every address) on a port the OS
        picks, reachable from the network for the run (torch offers no authentication)."""
        assert self.rank == 0, "only rank 0 makes the rendezvous store"
        if self.world_size == 1:
            self._store = dist.HashStore()
            return Rendezvous("process")
        if one_node:
            path = node_tmp_dir("rlhpc-rendezvous-") / "store"
            self._store = dist.FileStore(str(path), self.world_size)
            self._store.set_timeout(PG_TIMEOUT)
            return Rendezvous("file", str(path))
        ip = self.node_ip()
        sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, 0))  # port 0: no probe-then-bind race with other jobs on the node
        sock.listen(1024)
        port = sock.getsockname()[1]
        self._store = dist.TCPStore(
            ip, port, self.world_size, is_master=True, wait_for_workers=False, timeout=PG_TIMEOUT,
            master_listen_fd=sock.detach(),  # the store's now: torch has no bind address of its own
        )  # fmt: skip
        return Rendezvous("tcp", ip, port)

    def _join(self, rendezvous: Rendezvous) -> None:
        """Join the default torch.distributed group and load the tokenizer."""
        if self._store is None:  # rank 0 made it
            if rendezvous.kind == "file":
                self._store = dist.FileStore(rendezvous.where, self.world_size)
                self._store.set_timeout(PG_TIMEOUT)
            elif rendezvous.kind == "tcp":
                self._store = dist.TCPStore(
                    rendezvous.where, rendezvous.port, self.world_size, is_master=False, timeout=PG_TIMEOUT
                )
            else:
                raise RlhpcError(f"rank {self.rank} cannot join a {rendezvous.kind} store", "report this as a bug")
        dist.init_process_group(
            self.backend, store=self._store, rank=self.rank, world_size=self.world_size, timeout=PG_TIMEOUT
        )
        self.tokenizer = load_tokenizer(self.model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))

    def _barrier(self) -> None:
        if self.world_size == 1:  # nobody to wait for (gloo's barrier still costs a round of its own)
            return
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def _all_reduce_sum(self, values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
        if dist.get_world_size(group) == 1:  # the sum over one rank: no tensor, no collective
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=group)
        return t.tolist()

    # ------------------------------------------------------------------ checkpoint

    # A save is two calls: ``snapshot`` copies this rank's state to host memory (the only part
    # the train loop waits for; it may run collectives), then ``write_snapshot`` writes and
    # fsyncs it. The group runs ``write_snapshot`` on the rank's checkpoint thread (a Ray
    # concurrency group of one thread, alive as long as the rank) while training goes on, so
    # it must never run a collective.

    def snapshot(self, ckpt_dir: str) -> None:
        """Copy what ``write_snapshot`` will write into ``ckpt_dir/actor/`` to host memory."""
        raise NotImplementedError

    def write_snapshot(self) -> dict[str, tuple[int, int]] | None:
        """Write and fsync the last snapshot (no collectives: this runs beside training). May
        return the (size, CRC-32) of files it summed from memory, by path under the checkpoint."""
        raise NotImplementedError

    def save(self, ckpt_dir: str) -> None:
        """A blocking save: snapshot, then write, on this thread."""
        self.snapshot(ckpt_dir)
        self.write_snapshot()

    # ------------------------------------------------------------------ checkpoint (RNG)

    def _save_rng(self, actor_dir: Path) -> None:
        torch.save(get_rng_state(), actor_dir / rng_file(self.rank))

    def _restore_rng(self, actor_dir: Path, same_layout: bool = True) -> None:
        """This rank's saved RNG state; a rank without one (or another layout) keeps its fresh
        seed, so a resume on another layout is not bit-exact."""
        path = actor_dir / rng_file(self.rank)
        if same_layout and path.is_file():
            set_rng_state(torch.load(path, weights_only=True))
        else:
            log.warning(
                "rank %d: %s has no RNG state for this rank and layout; keeping the seeded RNG", self.rank, actor_dir
            )

    # ------------------------------------------------------------------ training

    def train(self, rollout_id: int, batch: RolloutBatch) -> dict[str, float]:
        """``num_steps_per_rollout`` optimizer steps on this rank's data-parallel shard; returns
        metrics over the whole rollout (the same on every rank).

        Every data-parallel rank takes every step together: a rank without a sample in a
        minibatch still joins the gradient reduction, and a step whose reduced gradients are
        not finite is skipped on every rank.
        """
        self.onload()  # the driver may have offloaded us for generation; no-op otherwise
        steps, sums, local_tokens = self._prepare(batch)
        # One all-reduce of every step's counts (in a fixed order: deterministic) for the loss normalisation.
        counts = self._all_reduce_sum(
            [sum(mb.tokens for mb in mbs) for mbs in steps] + [sum(mb.seqs for mb in mbs) for mbs in steps],
            group=self.dp_group,
        )
        loss_sums = {"pg_loss": 0.0, "kl": 0.0, "clipfrac": 0.0}
        if self.spec.algo.distill_coef > 0:
            loss_sums["distill/kl"] = 0.0
        grad_norms: list[float] = []
        skipped = 0
        for k, mbs in enumerate(steps):
            self._zero_grad()
            self._begin_step(len(mbs))
            norm = AggNorm(counts[k], counts[len(steps) + k], float(self.spec.max_response_len))
            self._forward_backward(mbs, norm, loss_sums, sums)
            self._finish_grad_sync(empty=not mbs)
            self._set_lr()
            grad_norm, stepped = self._clip_and_step()
            grad_norms.append(grad_norm)
            if stepped:
                self.optimizer_steps += 1
            else:
                skipped += 1
                log.warning(
                    "rank %d: rollout %d step %d: grad norm %s, step skipped", self.rank, rollout_id, k, grad_norm
                )

        metrics = self._rollout_metrics({**loss_sums, **sums}, local_tokens, grad_norms, skipped)
        interval = self.spec.algo.ref_update_interval
        if interval and (rollout_id + 1) % interval == 0:
            self._reset_reference()
            self.ref_reset_at = rollout_id + 1
            log.info("rank %d: the reference model is now the policy after rollout %d", self.rank, rollout_id)
        if self.rank == 0:
            log.debug("rollout %d: %s", rollout_id, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        return metrics

    def _forward_backward(
        self, mbs: list[MicroBatch], norm: AggNorm, loss_sums: dict[str, float], sums: dict[str, float]
    ) -> None:
        """A step's forwards and backwards, one micro-batch after the other; gradients accumulate."""
        for j, mb in enumerate(mbs):
            with self._grad_sync(last=j == len(mbs) - 1):
                logits = self._logits(self._policy(train=True), mb)
                loss = self._micro_batch_loss(logits, mb, norm, loss_sums, sums)
                # the micro-batch's share of the minibatch loss, times the DP size to undo the averaging
                (loss * self.dp_size).backward()

    def _micro_batch_loss(
        self, logits: torch.Tensor, mb: MicroBatch, norm: AggNorm, loss_sums: dict[str, float], sums: dict[str, float]
    ) -> torch.Tensor:
        """A training forward's logits -> the micro-batch's share of the minibatch loss."""
        logprobs = mb.per_sample(self._token_logprobs(logits, mb.ids))
        if mb.old_logprobs is None:  # the first step: no update yet, so this forward is the old policy's
            with torch.no_grad():
                self._old_policy(mb, logits.detach(), logprobs.detach(), sums)
        return self._grpo_loss(logits, logprobs, mb, norm, loss_sums)

    def _set_lr(self) -> None:
        """The rate of the step about to be taken (``actor.lr_schedule``), on every param group
        (times megatron's per-group ``lr_mult``). A skipped step does not advance the schedule."""
        a = self.spec.actor
        lr = lr_at(self.optimizer_steps, a.lr, a.lr_schedule, a.lr_warmup_steps, self.spec.lr_decay_steps, a.min_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    @property
    def packs(self) -> bool:
        """Micro-batches are packed rows (``actor.sequence_packing``, where the backend can)."""
        a = self.spec.actor
        return a.max_tokens_per_micro_batch is not None and a.sequence_packing and self.can_pack

    def _micro_batches(self, batch: RolloutBatch) -> list[list[RolloutBatch]]:
        """Per optimizer step: the micro-batches of this rank's share of that minibatch.

        Ranks may hold different numbers of them (uneven shards and lengths): neither backend
        runs a data-parallel collective per micro-batch (gradients are reduced once per step,
        ``_finish_grad_sync``), and the tensor-parallel ranks of a replica share its data, so
        they form the same micro-batches.
        """
        steps = []
        a = self.spec.actor
        for start, stop in split_even(len(batch), a.num_steps_per_rollout):
            if a.max_tokens_per_micro_batch is not None:
                minibatch = batch.slice(start, stop)
                steps.append(micro_batch_groups(minibatch, a.max_tokens_per_micro_batch, padded=not self.packs))
            else:
                steps.append(
                    [batch.slice(i, min(i + a.micro_batch_size, stop)) for i in range(start, stop, a.micro_batch_size)]
                )
        return steps

    def _prepare(self, batch: RolloutBatch) -> tuple[list[list[MicroBatch]], dict[str, float], float]:
        """Per step, this rank's micro-batches on the device with their reference logprobs and,
        after the first step, their no-grad "old" logprobs (the first step's come from its own
        forward: ``train``); the entropy and engine-mismatch sums so far; this rank's tokens."""
        steps: list[list[MicroBatch]] = []
        sums = {"entropy": 0.0, "rollout_logprob_abs_diff": 0.0}
        if self.spec.algo.tis:
            sums.update({"tis_clipfrac": 0.0, "tis_weight": 0.0})
        local_tokens = 0.0
        with torch.no_grad():
            for k, rollout_mbs in enumerate(self._micro_batches(batch)):
                steps.append([])
                for rmb in rollout_mbs:
                    mb = self._on_device(rmb)
                    if rmb.teacher_logprobs:
                        teacher = _rollout_logprob_tensor(rmb, mb.mask.shape, rmb.teacher_logprobs).to(self.device)
                        mb.teacher_logprobs = teacher
                        if self.spec.algo.kl_target == "teacher" and self.spec.algo.kl_loss_coef > 0:
                            mb.ref_logprobs = teacher  # the KL penalty pulls toward the teacher instead
                    local_tokens += mb.tokens
                    steps[-1].append(mb)
                self._no_grad_passes(steps[-1], old=k > 0, sums=sums)
        return steps, sums, local_tokens

    def _no_grad_passes(self, mbs: list[MicroBatch], old: bool, sums: dict[str, float]) -> None:
        """A step's micro-batches get their reference logprobs (KL penalty) and, when ``old``,
        their old-policy logprobs (``_old_policy``): one no-grad forward each."""
        for mb in mbs:
            if self.ref is not None and not self.spec.algo.kl_in_reward:  # else: in the reward
                mb.ref_logprobs = mb.per_sample(self._token_logprobs(self._logits(self.ref, mb), mb.ids))
            if old:
                logits = self._logits(self._policy(train=False), mb)
                self._old_policy(mb, logits, mb.per_sample(self._token_logprobs(logits, mb.ids)), sums)
                del logits

    def _on_device(self, rmb: RolloutBatch) -> MicroBatch:
        """A micro-batch's samples padded (or packed) on the device, with the engines' logprobs."""
        ids, attention, mask = (t.to(self.device) for t in rmb.to_padded(self.pad_id))
        mb = MicroBatch(ids, attention, mask, rmb.advantages.to(self.device))
        if rmb.routed_experts:
            mb.routed_experts = _routing_tensor(rmb.routed_experts, ids.shape[1]).to(self.device)
        if self.packs:  # the loss still sees padded rows (``MicroBatch.per_sample``)
            mb.ids, mb.positions, mb.unpack_index = pack_rows(ids, attention)
            if mb.routed_experts is not None:  # laid out as pack_rows lays out the ids
                mb.routed_experts = mb.routed_experts[attention.bool()][None]
            mb.attention = None
        mb.rollout_logprobs = _rollout_logprob_tensor(rmb, mask.shape).to(self.device)
        if any(rmb.images):
            self._with_images(mb, rmb, ids, attention)
        return mb

    def _with_images(self, mb: MicroBatch, rmb: RolloutBatch, ids: torch.Tensor, attention: torch.Tensor) -> None:
        """Give ``mb`` its samples' images as the backend's forward takes them (``MicroBatch.vision``)."""
        raise RlhpcError(
            f"the {self.spec.actor.backend} actor cannot train a vision-language model",
            "use actor.backend: torch",
        )

    def kl_to_reference(self, batch: RolloutBatch) -> list[float]:
        """Per sample of this rank's shard, sum_t KL_t of the current policy (the one ``train``
        is about to start from) to the reference over its response tokens (``algo.kl_estimator``;
        ``algo.kl_in_reward``). No grad; micro-batches as ``train`` forms them, over the whole shard."""
        if self.ref is None:
            raise RlhpcError(
                "the KL to the reference was asked for, but this actor has no reference model",
                "set algo.kl_coef > 0 (the reference model is loaded then)",
            )
        self.onload()
        a = self.spec.actor
        if a.max_tokens_per_micro_batch is not None:
            groups = first_fit_decreasing(sample_lengths(batch), a.max_tokens_per_micro_batch, padded=not self.packs)
        else:
            groups = [
                list(range(i, min(i + a.micro_batch_size, len(batch))))
                for i in range(0, len(batch), a.micro_batch_size)
            ]
        out = [0.0] * len(batch)
        with torch.no_grad():
            for g in groups:
                mb = self._on_device(select(batch, g))
                logprobs = mb.per_sample(self._token_logprobs(self._logits(self._policy(train=False), mb), mb.ids))
                ref = mb.per_sample(self._token_logprobs(self._logits(self.ref, mb), mb.ids))
                for i, kl in zip(g, sequence_kl(logprobs, ref, mb.mask, self.spec.algo.kl_estimator).tolist()):
                    out[i] = kl
        return out

    def _old_policy(self, mb: MicroBatch, logits: torch.Tensor, logprobs: torch.Tensor, sums: dict[str, float]) -> None:
        """Record the policy before this rollout's steps (no grad): ``mb``'s old logprobs and TIS
        weights; its entropy, engine mismatch and TIS terms added to ``sums``."""
        algo = self.spec.algo
        mb.old_logprobs = logprobs
        sums["entropy"] += float((mb.per_sample(self._entropy(logits)) * mb.mask).sum())
        sums["rollout_logprob_abs_diff"] += float(((logprobs - mb.rollout_logprobs).abs() * mb.mask).sum())
        if algo.tis:  # the engines' logprobs are the behaviour policy
            mb.tis_weights, clipped = truncated_is_weights(logprobs, mb.rollout_logprobs, mb.mask, algo.tis_clip)
            sums["tis_clipfrac"] += float(clipped) * mb.tokens
            sums["tis_weight"] += float(mb.tis_weights.sum())

    def _grpo_loss(
        self, logits: torch.Tensor, logprobs: torch.Tensor, mb: MicroBatch, norm: AggNorm, sums: dict[str, float]
    ) -> torch.Tensor:
        """A micro-batch's share of the minibatch loss (policy + KL penalty - entropy bonus, per
        token, aggregated once by ``algo.loss_agg_mode``); adds its token sums to ``sums`` (the
        metrics are token means whatever the aggregation, so runs with different modes compare)."""
        algo = self.spec.algo
        if algo.policy_loss == "gspo":
            eps_low, eps_high = algo.gspo_eps_clip, algo.gspo_eps_clip_high
        else:
            eps_low, eps_high = algo.eps_clip, algo.eps_clip_high
        advantages = mb.advantages
        if algo.distill_coef > 0 and mb.teacher_logprobs is not None:
            advantages, reverse_kl = distill_advantages(
                mb.advantages, mb.old_logprobs, mb.teacher_logprobs, mb.mask, algo.distill_coef
            )
            sums["distill/kl"] += float((reverse_kl * mb.mask).sum())
        pg, clipped = policy_loss_per_token(
            algo.policy_loss, logprobs, mb.old_logprobs, advantages, mb.mask, eps_low, eps_high, mb.tis_weights
        )
        per_token = pg
        if mb.ref_logprobs is not None:
            kl = kl_estimate(logprobs, mb.ref_logprobs, algo.kl_estimator)
            per_token = per_token + algo.kl_loss_coef * kl
            sums["kl"] += float((kl.detach() * mb.mask).sum())
        if algo.entropy_coef > 0:  # the entropy with its gradient (the logged one is the old policy's)
            per_token = per_token - algo.entropy_coef * mb.per_sample(self._entropy(logits))
        sums["pg_loss"] += float((pg.detach() * mb.mask).sum())
        sums["clipfrac"] += float((clipped * mb.mask).sum())
        return agg_loss(per_token, mb.mask, algo.loss_agg_mode, norm)

    def _rollout_metrics(
        self, sums: dict[str, float], local_tokens: float, grad_norms: list[float], skipped: int
    ) -> dict[str, float]:
        """Token means over the whole rollout (summed over the data-parallel group) + step stats."""
        keys = list(sums)
        totals = self._all_reduce_sum([sums[k] for k in keys] + [local_tokens], group=self.dp_group)
        tokens = max(totals[-1], 1.0)
        # every token is in exactly one minibatch, so these are token means over the rollout
        metrics = {k: v / tokens for k, v in zip(keys, totals[:-1])}
        algo = self.spec.algo
        metrics["loss"] = (
            metrics["pg_loss"] + algo.kl_loss_coef * metrics["kl"] - algo.entropy_coef * metrics["entropy"]
        )
        finite = [g for g in grad_norms if math.isfinite(g)]  # already global (post all-reduce)
        metrics["grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["tokens"] = totals[-1]
        metrics["optimizer_steps"] = float(self.optimizer_steps)
        metrics["skipped_steps"] = float(skipped)
        return metrics

    # The backend's part of a train step. Logits and logprobs are float32 and aligned with
    # ``MicroBatch.mask`` (position t predicts token t+1).

    def _policy(self, train: bool) -> torch.nn.Module:
        """The policy as the forward runs it: a training wrapper (megatron's DDP), or the bare model for no-grad passes."""
        raise NotImplementedError

    def _logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """``model``'s logits [N, L-1, V] (or this rank's vocab shard of them)."""
        raise NotImplementedError

    def _token_logprobs(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logprobs [N, L-1] of the actual next tokens ``ids[:, 1:]`` (over the full vocab)."""
        raise NotImplementedError

    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Entropy [N, L-1] of the full-vocab softmax: a metric (no grad), and with its gradient
        in the loss when ``algo.entropy_coef`` > 0."""
        raise NotImplementedError

    def _reset_reference(self) -> None:
        """Make the reference model the current policy (``algo.ref_update_interval``)."""
        raise RlhpcError(
            f"the {self.spec.actor.backend} actor cannot reset its reference model",
            "set algo.ref_update_interval: 0, or use actor.backend: torch",
        )

    def _begin_step(self, micro_batches: int) -> None:
        """Before a step's forwards: how many micro-batches this rank runs in it (MoE aux-loss scale)."""

    def _zero_grad(self) -> None:
        raise NotImplementedError

    def _grad_sync(self, last: bool) -> AbstractContextManager:
        """Around a micro-batch's forward and backward; ``last``: the step's final micro-batch.
        Default: nothing (the backward only accumulates; ``_finish_grad_sync`` reduces)."""
        return nullcontext()

    def _finish_grad_sync(self, empty: bool) -> None:
        """After a step's backwards: every data-parallel rank holds the reduced gradients.
        ``empty``: this rank had no sample in the minibatch (it must still join the reduction)."""
        raise NotImplementedError

    def _clip_and_step(self) -> tuple[float, bool]:
        """Clip to ``actor.grad_clip`` and step unless the gradients are not finite (the same
        decision on every rank). Returns (global grad norm, or NaN if unknown; stepped)."""
        raise NotImplementedError

    def _share_weights_with_colocated_engines(self) -> None:
        """Make the weights cheap for a colocated push to hand over (default: nothing to do)."""

    # ------------------------------------------------------------------ the weights in HF names

    def _hf_named(self, grads: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The full weights (or the last step's gradients) in HF names. A collective where a
        backend gathers shards: every rank of its group must consume it to the end."""
        raise NotImplementedError

    def state_fingerprint(self) -> str:
        """SHA-256 of the full weights in HF names (names, shapes, dtypes and bytes; same on every rank)."""
        return fingerprint(self._hf_named(grads=False))

    def named_tensors(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """CPU copies of the full weights (or the last step's gradients) in HF names: for tests and debugging."""
        return {n: None if t is None else t.detach().cpu().clone() for n, t in self._hf_named(grads)}

    # ------------------------------------------------------------------ weight sync

    def connect_rollout(
        self, engine_urls: list[str], engine_world_sizes: list[int], colocate: bool, key_file: str | None = None
    ) -> None:
        """Rank 0 opens the weight-sync channel to the engines; the other ranks have no part in it.
        ``key_file``: the job's engine key (``rlhpc.wire.engine_key``), sent on every engine call."""
        if self.rank != 0:
            return
        if self.sender is not None:  # reconnecting (e.g. after an engine restart): drop the old channel
            self._close_sender()
        from rlhpc.weights.sender import engine_clients, make_weight_sender  # late: training never needs it

        clients = engine_clients(engine_urls, key_file)
        if colocate:
            self._share_weights_with_colocated_engines()
        self.sender = make_weight_sender(
            clients,
            engine_world_sizes,
            # a shared fleet takes adapters alone, by name: no broadcast group (each run would open one)
            colocate=colocate or self.spec.shared_engines,
            master_address=self.node_ip(),
            backend=self.backend,
            bucket_bytes=self.spec.weight_bucket_mb * 2**20,
            pause_mode=self.spec.weight_pause_mode,
        )
        self.sender.connect()
        log.info("rank 0: weight sync connected to %d engine(s)", len(clients))

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

    def train_and_push(
        self, rollout_id: int, batch: RolloutBatch, version: int
    ) -> tuple[dict[str, float], str | None, float]:
        """``train``, then ``update_weights(version)`` in the same call: the synchronous loop's
        step with one trip from the driver to the ranks fewer. Returns the metrics, the push's
        error (as ``update_weights``) and its seconds."""
        metrics = self.train(rollout_id, batch)
        start = time.perf_counter()
        error = self.update_weights(version)
        return metrics, error, time.perf_counter() - start

    def _send_weights(self, version: int) -> None:
        """Data-parallel rank 0's replica gathers the weights (a collective within its TP group)
        and rank 0 hands them to the sender, which buckets them."""
        if self.dp_rank != 0:
            return  # the other replicas hold the same weights
        if self.spec.lora_push_dir is not None:  # actor.lora.push: adapter: the adapter's files alone
            if self.rank == 0:
                self.sender.send_adapter(
                    self.spec.lora_adapter, self._write_push_adapter(version), version, self.spec.shared_engines
                )
            return
        # gloo sends from host memory; nccl/CUDA IPC from the GPU. Offloaded weights travel to
        # the GPU one tensor at a time, so the peak is one bucket, not the model.
        device = torch.device("cpu") if self.backend == "gloo" else self.device
        # experts in the checkpoint's per-expert names: SGLang ignores HF's fused in-memory ones
        named = ((n, t.to(device).contiguous()) for n, t in checkpoint_named(self._hf_named(grads=False)))
        # rollout.quantization: fp8: quantized here, one tensor at a time, as the engines hold it
        sent = quantized_named(named) if self.spec.push_quantization == "fp8" else named
        try:
            if self.rank == 0:
                self.sender.send(sent, version)
        finally:
            for _ in named:  # take part in the TP gathers (rank 0 too, after a failed send)
                pass

    def _write_push_adapter(self, version: int) -> str:
        """The adapter alone, as PEFT files under ``spec.lora_push_dir``, for the engines to load
        (the torch actor's; other actors refuse LoRA at submit)."""
        raise RlhpcError(f"{type(self).__name__} pushes no LoRA adapter", "use actor.backend: torch with actor.lora")

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
