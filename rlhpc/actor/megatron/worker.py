"""One training rank on megatron-core: GPTModel (TP-sharded), Megatron DDP + optimizer, GRPO loss.

The same calls as the PyTorch ``TrainWorker`` (``rlhpc.actor.worker``), so ``ActorGroup`` and
the driver do not know which backend trains; the training loop is ``RankBase.train``
(``rlhpc.actor.rank``) with this backend's forward, gradient reduction and optimizer step.
Ranks are laid out TP-fastest (megatron's order): ranks ``[k*TP, (k+1)*TP)`` form
tensor-parallel group ``k`` = data-parallel rank ``k``, and all ranks of one TP group get the
same data shard.

* Loss: logprobs come from the vocab-parallel logits with megatron's
  ``vocab_parallel_cross_entropy`` (no rank ever holds the full vocab); the padded vocab rows
  are masked out so the softmax is over the real vocab, as in the engines. The gradient is the
  global token mean, as in the PyTorch backend (loss weights over the data-parallel group;
  megatron DDP averages over it).
* Checkpoints: ``megatron.core.dist_checkpointing`` (torch_dist) of model + optimizer under
  ``actor/dist/``, so a checkpoint written at one TP size loads at another; plus the HF config,
  tokenizer and per-rank RNG state. Saved asynchronously (``async_save``): the loop waits for
  host copies of the shards, the rank's checkpoint thread writes them.
  ``tools/convert_checkpoint.py`` turns one into HF weights.
* Weight sync: one layer at a time, TP shards are gathered inside the TP group, converted to
  HF names and handed to the sender on rank 0 (which buckets them), so the peak extra memory
  is one layer, not the model.
* MoE (Qwen3-MoE): experts over ``actor.megatron.expert_model_parallel_size`` ranks of the
  data-parallel group (megatron's EP; the allgather token dispatcher), the router's
  load-balancing loss from megatron's router (in train mode only, so the MoE model trains in
  train mode: dropout is off, the function is the same) averaged over the step's micro-batches,
  and logged as ``moe_load_balancing_loss``. Weight sync gathers the experts over the EP group,
  whose other data-parallel ranks join DP rank 0's push for it (``_send_weights``).
* Pipeline parallelism (``actor.megatron.pipeline_model_parallel_size``): each stage holds
  layers / PP of the layers (megatron numbers them from 0 on every stage); a step's
  micro-batches, and the no-grad passes', go through megatron-core's schedule
  (``_pipeline``), the loss and the metric sums on the last stage. Weight sync broadcasts
  each layer from its stage over the pipeline group (``_from_every_stage``): one model.
* On a machine without a GPU the megatron CPU shim (``cpu_shim.py``) is applied first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig

from rlhpc import moe_routing
from rlhpc.actor.checkpoint_dir import ACTOR_SUBDIR, DIST_SUBDIR, MEGATRON_BACKEND, read_meta, write_meta
from rlhpc.actor.megatron import torch_dist_load
from rlhpc.actor.megatron.async_save import TorchDistSave
from rlhpc.actor.megatron.convert import (
    expert_index,
    gather_ep_shards,
    gather_tp_shards,
    layer_index,
    load_into,
    megatron_full_to_hf,
    model_state_dict,
    renumber_layer,
    shard_tensor,
    to_global,
)
from rlhpc.actor.megatron.hf_reader import HFReader
from rlhpc.actor.megatron.model import build_gpt_model, is_moe, num_experts
from rlhpc.actor.offload import StorageOffloader
from rlhpc.actor.rank import MicroBatch, RankBase, Rendezvous
from rlhpc.actor.spec import ActorSpec
from rlhpc.algo.grpo import AggNorm
from rlhpc.errors import RlhpcError

log = logging.getLogger(__name__)

# The distributed optimizer's torch_dist format: "dp_reshardable" (Megatron-LM's default) saves
# its buffers as they are, fully parallel, and loads at another DP size but not another TP
# size. ("fully_reshardable" would allow both, but in megatron-core 0.16 it fails to load
# with torch's own Adam: KeyError 'step'.) The plain optimizer's state loads at any TP/DP.
SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _saved_steps(loaded: Any) -> set[float]:
    """The ``step`` values of every optimizer param group in a loaded optimizer state dict (the
    distributed optimizer keeps the common step there, not in the per-parameter state)."""
    steps: set[float] = set()
    if isinstance(loaded, dict):
        groups = loaded.get("param_groups")
        if isinstance(groups, list):
            steps.update(float(g["step"]) for g in groups if isinstance(g, dict) and g.get("step") is not None)
        for value in loaded.values():
            steps |= _saved_steps(value)
    elif isinstance(loaded, list):
        for value in loaded:
            steps |= _saved_steps(value)
    return steps


class MegatronTrainWorker(RankBase):
    """Rank ``rank`` of ``world_size`` = TP x PP x DP. Same call order as ``TrainWorker``."""

    def __init__(self, spec: ActorSpec, model_path: str, rank: int, world_size: int):
        super().__init__(spec, model_path, rank, world_size)
        self.mcfg = spec.actor.megatron
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.gpt = None  # megatron GPTModel (this rank's TP shard; with virtual stages, chunk 0)
        self.model = None  # the same, wrapped in megatron DDP
        self.chunks: list[torch.nn.Module] = []  # every model chunk of this stage (one without virtual stages)
        self.models: list[torch.nn.Module] = []  # the same, each wrapped in megatron DDP
        self.ref_chunks: list[torch.nn.Module] = []
        self.offloader = StorageOffloader()
        self._snapshot_meta: tuple[Path, int] | None = None  # the last snapshot's dir and step count
        self.moe = is_moe(self.hf_config)
        self._moe_forwards = 0  # training forwards since the last train() (the aux-loss tracker's count)

    # ------------------------------------------------------------------ setup

    def init_process_group(self, rendezvous: Rendezvous) -> None:
        """Join torch.distributed, set up megatron's parallel state, build model, DDP and optimizer."""
        self._join(rendezvous)
        if self.device.type == "cpu":
            from rlhpc.actor.megatron.cpu_shim import apply_cpu_shim

            apply_cpu_shim()
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        # bf16 where the hardware has it (actor.megatron.bf16: null), else as configured
        has_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.bf16 = self.mcfg.uses_bf16(has_bf16)
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        tp, ep = self.mcfg.tensor_model_parallel_size, self.mcfg.expert_model_parallel_size
        pp = self.mcfg.pipeline_model_parallel_size
        if ep > 1 and not self.moe:
            raise RlhpcError(
                f"actor.megatron.expert_model_parallel_size = {ep} for a {self.hf_config.model_type} model, which has no experts",
                "set actor.megatron.expert_model_parallel_size: 1, or train a MoE model (qwen3_moe)",
            )
        layers = self.hf_config.num_hidden_layers
        vp = self.mcfg.virtual_pipeline_model_parallel_size if pp > 1 else None
        if layers % (pp * (vp or 1)):
            raise RlhpcError(
                f"actor.megatron.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp} x {vp or 1} "
                f"does not divide the model's {layers} layers",
                f"choose a pipeline size (times the virtual stages) that divides {layers}",
            )
        if vp is not None and self.moe:
            raise RlhpcError(
                f"actor.megatron.virtual_pipeline_model_parallel_size = {vp} for a MoE model: virtual pipeline "
                "stages are built for dense models only (a step's micro-batches are padded to a multiple of PP "
                "with empty ones, which the router's load-balancing loss would count)",
                "set actor.megatron.virtual_pipeline_model_parallel_size: null for MoE models",
            )
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            expert_model_parallel_size=ep,
        )
        model_parallel_cuda_manual_seed(self.spec.seed)
        self.tp_size, self.tp_rank = tp, mpu.get_tensor_model_parallel_rank()
        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.ep_size, self.ep_rank = ep, mpu.get_expert_model_parallel_rank()
        self.ep_group = mpu.get_expert_model_parallel_group()
        self.etp_group = mpu.get_expert_tensor_parallel_group()  # the TP group of the experts (same size as TP)
        # EP groups are carved out of the data-parallel ranks: the replicas of expert-data-parallel
        # rank 0 (DP ranks 0 .. EP-1) hold DP rank 0's missing experts and join its weight gathers
        self.edp_rank = mpu.get_expert_data_parallel_rank()
        self.dp_group = mpu.get_data_parallel_group()
        self.dp_size, self.dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        # Pipeline stages: megatron's rank order puts PP outermost, so this rank's stage is
        # rank // (TP x DP); each holds layers / PP layers (in VP chunks with virtual stages).
        self.pp_size, self.pp_rank = pp, mpu.get_pipeline_model_parallel_rank()
        self.pp_group = mpu.get_pipeline_model_parallel_group()
        # Virtual stages: chunk v of stage s holds layers [(v x PP + s) x n, ... + n), n = layers / (PP x VP)
        self.vp_size = vp or 1
        self.layers_per_chunk = layers // (pp * self.vp_size)
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == pp - 1

        # each rank reads only its own part of the checkpoint, tensor by tensor, in its dtype
        reader = HFReader(self.model_path)
        self.chunks = [self._load(self._build(v), reader, v) for v in range(self.vp_size)]
        reader.close()
        log.info("rank %d: read %.1f MB of the checkpoint (this rank's shard)", self.rank, reader.bytes_read / 2**20)
        if self.spec.needs_reference:  # the same weights: copied from the policy, not read again
            self.ref_chunks = [self._build(v).requires_grad_(False) for v in range(self.vp_size)]
            for ref, chunk in zip(self.ref_chunks, self.chunks):
                load_into(ref, model_state_dict(chunk))
            self.ref = self.ref_chunks[0]
        self.gpt = self.chunks[0]
        if self.moe:
            # Experts count as expert-parallel (megatron's allreduce=False) at EP=1 too: their
            # grads then reduce over the expert data-parallel group, at EP=1 the DP group, and
            # the optimizer chains a dense and an expert part at every EP size. Its checkpoint
            # keys (chained_0./chained_1.) are then the same at any EP size, so they reshard.
            for name, p in self.gpt.named_parameters():
                if expert_index(name) is not None:
                    p.allreduce = False
        a = self.spec.actor
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.mcfg.use_distributed_optimizer,
        )
        # one DDP (grad buffer) per chunk, as Megatron-LM wraps them; only chunk 0's is bucketed
        self.models = [
            DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=v > 0)
            for v, chunk in enumerate(self.chunks)
        ]
        self.model = self.models[0]
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=a.lr,
                weight_decay=a.weight_decay,
                adam_beta1=a.adam_betas[0],
                adam_beta2=a.adam_betas[1],
                adam_eps=a.adam_eps,
                clip_grad=a.grad_clip,
                bf16=self.bf16,
                params_dtype=self.dtype,
                use_distributed_optimizer=self.mcfg.use_distributed_optimizer,
            ),
            self.models,
        )
        self.saver = TorchDistSave()
        if self.rank == 0:
            if self.mcfg.bf16 is not None:
                why = f"actor.megatron.bf16: {str(self.mcfg.bf16).lower()}"
            else:
                why = "actor.megatron.bf16: null, " + ("the GPU has bf16" if has_bf16 else f"no bf16 on {self.device}")
            log.info("megatron actor: %s weights, compute and pushes (%s)", "bf16" if self.bf16 else "fp32", why)
        log.info(
            "rank %d/%d: megatron TP %d/%d PP %d/%d (%d chunks) DP %d/%d EP %d/%d, %s on %s, %d params in this shard%s",
            self.rank,
            self.world_size,
            self.tp_rank,
            self.tp_size,
            self.pp_rank,
            self.pp_size,
            self.vp_size,
            self.dp_rank,
            self.dp_size,
            self.ep_rank,
            self.ep_size,
            self.backend,
            self.device,
            sum(p.numel() for chunk in self.chunks for p in chunk.parameters()),
            ", with reference model" if self.ref is not None else "",
        )
        a = self.spec.actor
        if self.rank == 0 and a.max_tokens_per_micro_batch is not None and a.sequence_packing:
            # megatron-core packs (PackedSeqParams, thd) only in Transformer Engine's attention;
            # the local spec's DotProductAttention asserts packed_seq_params is None.
            log.info(
                "megatron actor: micro-batches of <= %d tokens are padded, not packed", a.max_tokens_per_micro_batch
            )

    def _first_layer(self, chunk: int) -> int:
        """The global index of model chunk ``chunk``'s first layer on this stage."""
        return (chunk * self.pp_size + self.pp_rank) * self.layers_per_chunk

    def _build(self, chunk: int = 0) -> torch.nn.Module:
        """Model chunk ``chunk`` of this rank (its TP/PP/EP part), in the actor's dtype, on its device."""
        dtype = self.dtype
        moe: dict[str, Any] = {}
        if self.moe:
            moe = dict(
                expert_model_parallel_size=self.ep_size,
                moe_router_load_balancing_type=self.mcfg.moe_router_load_balancing_type,
            )
            if self.mcfg.moe_aux_loss_coeff is not None:
                moe["moe_aux_loss_coeff"] = self.mcfg.moe_aux_loss_coeff
            if self.spec.algo.routing_replay:
                moe["moe_enable_routing_replay"] = True  # each router gets a RouterReplay (_replay)
        full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        gpt = build_gpt_model(
            self.hf_config,
            self.tp_size,
            pp_size=self.pp_size,
            vp_stage=chunk if self.vp_size > 1 else None,
            dtype=dtype,
            **moe,
            **(full if self.mcfg.recompute else {}),
        )
        if self.moe and self.spec.algo.routing_replay:
            from megatron.core.transformer.moe.router_replay import RouterReplay

            # megatron keeps every RouterReplay ever made in a class-wide list (for its static
            # setters, which would mix the policy's, the reference's and each chunk's): each
            # forward sets its own model's (_replay), so the list only leaks
            RouterReplay.global_router_replay_instances.clear()
        if self.pp_size > 1:
            # activations reach the last stage's loss scaled by this: the DP size, as the
            # single-stage backward scales its loss (MoE's aux loss takes it from here too)
            gpt.config.grad_scale_func = lambda t: t * self.dp_size
        # All parameters in one dtype, as megatron's Float16Module does: the local spec's norms
        # are created in fp32 even for a bf16 model, and the optimizers' checkpoint mapping
        # assumes one dtype per model (mixed, it pairs Adam states with the wrong tensors).
        # eval(): no dropout, so the no-grad "old" pass and the training pass compute the same
        # function and the PPO ratio is exactly 1 before the first step.
        return gpt.to(self.device, dtype).eval()

    def _load(self, gpt: torch.nn.Module, reader: HFReader, chunk: int) -> torch.nn.Module:
        """Copy the checkpoint's weights into model chunk ``chunk``: each parameter's part
        (``convert.shard_tensor``), read and copied one at a time, so the host holds one
        tensor's slice beside the model, never the whole checkpoint."""
        first_expert = self.ep_rank * num_experts(self.hf_config) // self.ep_size
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                where = to_global(name, self._first_layer(chunk), first_expert)
                try:
                    t = shard_tensor(reader, self.hf_config, where, self.tp_size, self.tp_rank)
                except KeyError as e:
                    raise RlhpcError(
                        f"{self.model_path}: no weights for {where} ({e.args[0]})",
                        "point model.path at a complete HF checkpoint whose config.json matches its safetensors",
                    ) from e
                if t.shape != p.shape:
                    raise RlhpcError(
                        f"{self.model_path}: {name} of this rank has shape {tuple(t.shape)} in the checkpoint, "
                        f"the model's is {tuple(p.shape)}",
                        "check that config.json matches the checkpoint's weights",
                    )
                p.copy_(t)
        return gpt

    # ------------------------------------------------------------------ checkpoint

    def _sharded_state_dict(self, is_loading: bool) -> dict[str, Any]:
        if not is_loading:
            self._first_step_adam_state()
        # the keys name global layers: a chunked stage's checkpoint loads at any PP/VP layout
        model_sd = self._model_sharded_state_dict()
        optim_sd = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=SHARDING_METADATA)
        return {"model": model_sd, "optimizer": optim_sd}

    def _model_sharded_state_dict(self) -> dict[str, Any]:
        if self.vp_size == 1:
            return self.gpt.sharded_state_dict()
        return {f"chunk{v}": chunk.sharded_state_dict() for v, chunk in enumerate(self.chunks)}

    def snapshot(self, ckpt_dir: str) -> None:
        """Plan the torch_dist save of model + optimizer into ``ckpt_dir/actor/`` with a host copy of
        this rank's shards, and write megatron's small common file and this rank's RNG: what the
        loop waits for. ``write_snapshot`` writes the rest."""
        d = Path(ckpt_dir) / ACTOR_SUBDIR
        if self.rank == 0:
            (d / DIST_SUBDIR).mkdir(parents=True, exist_ok=True)
        self._barrier()
        with self._onloaded():
            self.saver.plan(self._sharded_state_dict(is_loading=False), str(d / DIST_SUBDIR))
        self._save_rng(d)
        self._snapshot_meta = (d, self.optimizer_steps)

    def write_snapshot(self) -> dict[str, tuple[int, int]]:
        """Write and fsync this rank's shards of the last snapshot; rank 0 adds the metadata (the
        save's collectives run on its own gloo group: see ``async_save``), HF config, tokenizer and
        ``meta.json``. Returns the size and CRC-32 of the torch_dist files, summed as written."""
        if self._snapshot_meta is None:
            raise RuntimeError("write_snapshot without a snapshot")
        (d, optimizer_steps), self._snapshot_meta = self._snapshot_meta, None
        written = self.saver.write()
        if self.rank == 0:
            self.hf_config.save_pretrained(d)
            self.tokenizer.save_pretrained(d)
            meta = {
                "backend": MEGATRON_BACKEND,
                "world_size": self.world_size,
                "tensor_model_parallel_size": self.tp_size,
                "pipeline_model_parallel_size": self.pp_size,
                "virtual_pipeline_model_parallel_size": self.vp_size,
                "expert_model_parallel_size": self.ep_size,
                "use_distributed_optimizer": self.mcfg.use_distributed_optimizer,
                "optimizer_steps": optimizer_steps,
                "initial_model": self.model_path,
            }
            write_meta(d, meta)
        ckpt_dir = d.parent
        return {p.relative_to(ckpt_dir).as_posix(): summed for p, summed in written.items()}

    def load(self, ckpt_dir: str | None) -> None:
        """Restore model, optimizer and this rank's RNG from ``ckpt_dir/actor/`` (None: fresh).

        The checkpoint may come from another TP/DP layout: torch_dist reshards on load.
        """
        if ckpt_dir is None:
            return
        d = Path(ckpt_dir) / ACTOR_SUBDIR
        meta = read_meta(d)
        if meta.get("backend") != MEGATRON_BACKEND or not (d / DIST_SUBDIR).is_dir():
            raise RlhpcError(
                f"checkpoint {d} was not written by the megatron actor (backend {meta.get('backend', 'torch')!r})",
                "resume with the actor.backend that wrote it, or start a new run directory",
            )
        if meta.get("weights_only"):
            raise RlhpcError(
                f"{d} holds weights only (tools/convert_checkpoint.py from-hf), not a run to resume",
                "start a run from the HF model with model.path, or convert it back with to-hf",
            )
        saved_tp = meta.get("tensor_model_parallel_size")
        saved_pp = meta.get("pipeline_model_parallel_size", 1)  # written before pipeline parallelism: 1
        saved_ep = meta.get("expert_model_parallel_size", 1)
        saved_vp = meta.get("virtual_pipeline_model_parallel_size", 1)
        saved = (saved_tp, saved_pp, saved_ep, saved_vp)
        asked = (self.tp_size, self.pp_size, self.ep_size, self.vp_size)
        # the distributed optimizer's experts are sharded over the expert data-parallel group,
        # which an EP change resizes: resharded like a TP change, i.e. not at all; its buffers
        # are per model chunk, which a VP change regroups
        if meta.get("use_distributed_optimizer") and saved != asked:
            chunks = lambda n: f" VP={n}" if n > 1 else ""  # noqa: E731
            raise RlhpcError(
                f"checkpoint {d} holds distributed-optimizer state at TP={saved_tp} PP={saved_pp} EP={saved_ep}"
                f"{chunks(saved_vp)}; this actor runs at TP={self.tp_size} PP={self.pp_size} EP={self.ep_size}"
                f"{chunks(self.vp_size)}",
                "resume at the same actor.megatron.tensor_model_parallel_size, pipeline_model_parallel_size, "
                "virtual_pipeline_model_parallel_size and expert_model_parallel_size (the data-parallel size may "
                "change), or convert the weights (tools/convert_checkpoint.py) and start a new run",
            )
        self._create_optimizer_state()
        state = torch_dist_load.load(self._sharded_state_dict(is_loading=True), str(d / DIST_SUBDIR))
        if self.vp_size == 1:
            self.gpt.load_state_dict(state["model"], strict=False)
        else:
            for v, chunk in enumerate(self.chunks):
                chunk.load_state_dict(state["model"][f"chunk{v}"], strict=False)
        with torch.no_grad():  # it copies into fp32 main params that are views of leaf params
            self.optimizer.load_state_dict(state["optimizer"])
        self._restore_adam_steps(state["optimizer"])
        self.optimizer_steps = int(meta.get("optimizer_steps", 0))
        self._restore_rng(d, same_layout=meta.get("world_size") == self.world_size)
        log.info(
            "rank %d: restored megatron actor state from %s (saved at TP=%s PP=%s VP=%s EP=%s)",
            self.rank,
            d,
            saved_tp,
            saved_pp,
            saved_vp,
            saved_ep,
        )

    def _first_step_adam_state(self) -> None:
        """Before the first optimizer step, give torch's Adam the state it creates at that step
        (step 0, zero moments), so that a checkpoint can be saved then.

        megatron-core 0.16's distributed optimizer with torch's Adam (no Transformer Engine or
        apex) reads the common ``step`` from the per-parameter state when it saves and asserts
        there is exactly one: a run stopped before its first step could not save. Adam creates
        this state lazily, only where it is empty, so a run that goes on trains exactly as it
        would have, and one resumed from here restores step 0 and zero moments, the same.
        (megatron's own ``_init_optimizer_states_with_dummy_values`` takes a real step, which
        decays the weights when ``actor.weight_decay`` > 0.)
        """
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or inner.state:
                continue
            # torch's own choice of the step's dtype and device (torch.optim.Adam._init_group)
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            for group in inner.param_groups:
                on_device = group.get("capturable") or group.get("fused")
                for p in group["params"]:
                    state = inner.state[p]
                    state["step"] = (
                        torch.zeros((), dtype=torch.float32 if group.get("fused") else scalar, device=p.device)
                        if on_device
                        else torch.tensor(0.0, dtype=scalar, device="cpu")
                    )
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _create_optimizer_state(self) -> None:
        """Give a fresh distributed optimizer its Adam state before it describes a checkpoint to load.

        With torch's Adam (no Transformer Engine/apex) megatron reads the common ``step`` from
        that state and fails on an empty one; megatron's own helper creates it with a zero-grad
        step, whose values the load then overwrites.
        """
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()

    def _restore_adam_steps(self, loaded_optimizer: Any) -> None:
        """Each parameter's Adam ``step`` as saved, in a tensor of its own, after a load.

        megatron-core 0.16's distributed optimizer with torch's Adam restores the common step
        from the saved param groups as *one* tensor shared by every parameter (Adam increments
        each parameter's step in place: a resumed job would count every step N times), and its
        ``dp_reshardable`` load then copies the step the optimizer held *before* the load (the
        dummy step of ``_create_optimizer_state``, 1) over it: a resumed run restarted Adam's
        bias correction at step 1. The saved param groups hold the step: set it from there.
        """
        saved = _saved_steps(loaded_optimizer)
        if len(saved) > 1:
            raise RlhpcError(
                f"the checkpoint's optimizer param groups hold different Adam steps {sorted(saved)}",
                "resume from another checkpoint (keep_last keeps the ones before it)",
            )
        step = next(iter(saved)) if saved else None  # None: the plain optimizer's own load set it
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            for state in getattr(inner, "state", {}).values():
                old = state.get("step")
                if isinstance(old, torch.Tensor):
                    state["step"] = old.clone() if step is None else torch.full_like(old, step)

    # ------------------------------------------------------------------ train-step hooks (RankBase.train)

    def _policy(self, train: bool) -> torch.nn.Module:
        if self.moe:
            # megatron's router adds its load-balancing loss in train mode only; dropout is
            # off, so train and eval compute the same function
            self.gpt.train(train)
        return self.model if train else self.gpt

    def _stages(self, train: bool) -> list[torch.nn.Module]:
        """This stage's model chunks for the pipeline schedule (``_policy``'s, chunk by chunk)."""
        if self.vp_size == 1:
            return [self._policy(train)]
        return self.models if train else self.chunks

    def _begin_step(self, micro_batches: int) -> None:
        """The aux loss's gradient is added once per forward, times megatron's scale: make it the
        mean over this rank's micro-batches, as DDP then averages over the data-parallel ranks
        (the policy loss is backpropagated times the DP size for the same reason)."""
        if self.moe and micro_batches:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(self.dp_size / micro_batches, device=self.device))
            self._moe_forwards += micro_batches

    def train(self, rollout_id: int, batch: Any) -> dict[str, float]:
        if self.moe and self.ep_size > 1:
            # every forward is a collective over the EP group: its ranks must run as many
            counts = torch.tensor([len(mbs) for mbs in self._micro_batches(batch)], dtype=torch.float64)
            low, high = counts.clone(), counts.clone()
            dist.all_reduce(low, dist.ReduceOp.MIN, group=self.ep_group)
            dist.all_reduce(high, dist.ReduceOp.MAX, group=self.ep_group)
            if not torch.equal(low, high):
                raise RlhpcError(
                    f"rollout {rollout_id}: the expert-parallel ranks got {low.tolist()} to {high.tolist()} "
                    "micro-batches per step; expert parallelism needs the same number on each",
                    "make rollout samples per step a multiple of data-parallel size x actor.micro_batch_size, "
                    "or set actor.megatron.expert_model_parallel_size: 1",
                )
        metrics = super().train(rollout_id, batch)
        if self.moe:
            metrics.update(self._moe_metrics())
        self.gpt.eval()
        return metrics

    def _moe_metrics(self) -> dict[str, float]:
        """The router's load-balancing loss (unscaled by its coefficient): megatron's tracker,
        reduced over the ranks by megatron, per layer and training forward; then cleared."""
        from megatron.core.transformer.moe import moe_utils

        forwards = self._all_reduce_sum([float(self._moe_forwards)], group=self.dp_group)[0] / self.dp_size
        self._moe_forwards = 0
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if not tracker or forwards == 0:
            return {}
        moe_utils.reduce_aux_losses_tracker_across_ranks()
        out = {
            f"moe_{name}": float(entry["values"].sum()) / self.hf_config.num_hidden_layers / forwards
            for name, entry in tracker.items()
        }
        moe_utils.clear_aux_losses_tracker()
        return out

    def _logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """This rank's vocab shard of the logits [N, L-1, V/TP] (float32), padded vocab at -inf.

        Right-padded ids and causal attention: no mask needed, a real token never sees a pad.
        """
        return self._vocab_logits(self._forward(model, mb), mb)

    def _forward(self, model: torch.nn.Module, mb: MicroBatch, shape: tuple[int, int] | None = None) -> torch.Tensor:
        """The model's output for ``mb``: the logits on the last pipeline stage, the hidden
        states to send on elsewhere (a later stage's input comes from megatron's schedule).
        ``shape``: right-pad the ids to these rows and columns first."""
        ids = mb.ids
        rows, cols = ids.shape
        if shape is not None:
            ids = torch.nn.functional.pad(ids, (0, shape[1] - cols, 0, shape[0] - rows), value=self.pad_id)
        elif self.moe and self.ep_size > 1:
            # megatron's allgather dispatcher gathers the tokens of the EP group as equal blocks:
            # every EP rank's micro-batch gets the group's largest shape (pad rows and columns,
            # cut off in _vocab_logits; they pass through the router like right-padding already does)
            shape = torch.tensor([rows, cols], device=ids.device)
            dist.all_reduce(shape, dist.ReduceOp.MAX, group=self.ep_group)
            ids = torch.nn.functional.pad(ids, (0, int(shape[1]) - cols, 0, int(shape[0]) - rows), value=self.pad_id)
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        if self.moe and self.spec.algo.routing_replay:
            self._replay(model, mb, ids.shape)
        return model(ids, pos, attention_mask=None)

    def _replay(self, model: torch.nn.Module, mb: MicroBatch, shape: torch.Size) -> None:
        """algo.routing_replay: the routers of ``model`` (this stage's layers) take the engine's
        experts for this forward (megatron-core's RouterReplay, REPLAY_FORWARD: its own top-k
        replaced, the weights gathered from its scores); a micro-batch without them routes as
        usual. Each layer's ids go in the router's token order, sequence-major ([s, b] flattened);
        pad rows and columns (and the last token, which no engine ran) get experts 0..k-1: no
        logprob reads them, as a real token never attends to a later one."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction
        from megatron.core.transformer.transformer_layer import TransformerLayer

        layers = [
            (m.layer_number - 1, m.mlp.router.router_replay)  # megatron's layer_number: global, from 1
            for m in model.modules()
            if isinstance(m, TransformerLayer) and getattr(getattr(m.mlp, "router", None), "router_replay", None)
        ]
        routed = mb.routed_experts
        for _, replay in layers:
            replay.clear_indices()
            replay.clear_router_replay_action()
        if routed is None:
            return
        rows, cols = routed.shape[:2]
        routed = torch.nn.functional.pad(
            routed, (0, 0, 0, 0, 0, shape[1] - cols, 0, shape[0] - rows), value=moe_routing.UNKNOWN
        )
        top_k = routed.shape[-1]
        routed = torch.where(routed == moe_routing.UNKNOWN, torch.arange(top_k, device=routed.device), routed)
        for layer, replay in layers:
            replay.set_target_indices(routed[:, :, layer].transpose(0, 1).reshape(-1, top_k))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _vocab_logits(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The last stage's output -> ``_logits``'s answer (padding rows, columns and vocab cut or masked)."""
        rows, cols = mb.ids.shape
        logits = output[:rows, : cols - 1].float()
        shard = logits.shape[-1]
        first = self.tp_rank * shard
        if first + shard > self.hf_config.vocab_size:
            pad = torch.arange(first, first + shard, device=logits.device) >= self.hf_config.vocab_size
            logits = logits.masked_fill(pad, float("-inf"))
        return logits

    def _token_logprobs(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        # It subtracts the max in place: give it its own copy (``logits`` may be needed after).
        return -vocab_parallel_cross_entropy(logits.clone(), ids[:, 1:])

    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Entropy of the full-vocab softmax from the vocab shards (a reduction in the TP group).

        Differentiable (``algo.entropy_coef``): the max only shifts for stability, so it is a
        constant; the sums' all-reduce passes the gradient through unchanged (megatron's
        reduce-from-TP region), as every TP rank computes the same loss from them.
        """
        m = logits.detach().max(-1).values
        dist.all_reduce(m, dist.ReduceOp.MAX, group=self.tp_group)
        e = (logits - m.unsqueeze(-1)).exp()
        sums = torch.stack([e.sum(-1), (e * logits.nan_to_num(neginf=0.0)).sum(-1)])
        if sums.requires_grad:
            from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

            sums = reduce_from_tensor_model_parallel_region(sums)
        else:
            dist.all_reduce(sums, group=self.tp_group)
        return m + sums[0].log() - sums[1] / sums[0]

    # ------------------------------------------------------------------ pipeline parallelism

    def _pipeline(
        self, chunks: list[torch.nn.Module], mbs: list[MicroBatch], on_logits: Any, forward_only: bool
    ) -> None:
        """Run ``mbs`` through the pipeline stages with megatron-core's schedule (1F1B, or the
        interleaved 1F1B over ``chunks`` with virtual stages; forward only for the no-grad
        passes). On the last stage ``on_logits(mb, logits)`` gets each micro-batch's logits
        (``_logits``'s answer) and returns its loss (forward only: None).

        The schedule divides each loss by the number of micro-batches (its mean over them):
        ours are already shares of the minibatch's loss, so they go in times that number.
        The DP-size factor comes from ``config.grad_scale_func`` (``_build``).

        The interleaved schedule takes the micro-batches in groups of PP and refuses a
        remainder: fewer or a count that PP does not divide get empty micro-batches (one pad
        row, no loss and a zero gradient) added up to the next multiple of PP.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not mbs:  # every stage of this replica has the same micro-batches: all skip together
            return
        empty: set[int] = set()
        if self.vp_size > 1 and len(mbs) % self.pp_size:
            pad = torch.full((1, 2), self.pad_id, dtype=mbs[0].ids.dtype, device=self.device)
            extra = [dataclasses.replace(mbs[0], ids=pad) for _ in range(self.pp_size - len(mbs) % self.pp_size)]
            empty = {id(mb) for mb in extra}
            mbs = [*mbs, *extra]
        n = len(mbs)
        rows, cols = max(mb.ids.shape[0] for mb in mbs), max(mb.ids.shape[1] for mb in mbs)
        shape = None
        if not self.gpt.config.variable_seq_lengths:
            # activations travel in one shape (MoE: see transformer_config): every micro-batch
            # is right-padded to the step's largest, over the EP group too (its dispatcher
            # gathers equal blocks); cut off again in _vocab_logits
            if self.ep_size > 1:
                t = torch.tensor([rows, cols], device=self.device)
                dist.all_reduce(t, dist.ReduceOp.MAX, group=self.ep_group)
                rows, cols = int(t[0]), int(t[1])
            shape = (rows, cols)

        def loss_func(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            if id(mb) in empty:  # a zero that reaches every parameter the forward used
                return output.sum() * 0.0, {}
            loss = on_logits(mb, self._vocab_logits(output, mb))
            # a fresh tensor either way: the schedule divides it in place
            return (torch.ones((), device=self.device) if loss is None else loss * n), {}

        def forward_step(data: Iterator[MicroBatch], stage: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            return self._forward(stage, mb, shape), functools.partial(loss_func, mb)

        get_forward_backward_func()(
            forward_step_func=forward_step,
            # each chunk takes the micro-batches in order (the first chunk's ids are the
            # input, the last's are the loss's; between, the activations come from the schedule)
            data_iterator=[iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs),
            model=chunks,
            num_microbatches=n,
            # with variable_seq_lengths the shapes travel with the activations: only the largest
            seq_length=cols,
            micro_batch_size=rows,
            forward_only=forward_only,
        )

    def _forward_backward(
        self, mbs: list[MicroBatch], norm: AggNorm, loss_sums: dict[str, float], sums: dict[str, float]
    ) -> None:
        if self.pp_size == 1:
            return super()._forward_backward(mbs, norm, loss_sums, sums)

        def loss(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            return self._micro_batch_loss(logits, mb, norm, loss_sums, sums)

        self._pipeline(self._stages(train=True), mbs, loss, forward_only=False)

    def _no_grad_passes(self, mbs: list[MicroBatch], old: bool, sums: dict[str, float]) -> None:
        if self.pp_size == 1:
            return super()._no_grad_passes(mbs, old, sums)
        # Only the last stage sees logits: the logprobs exist there, where the loss is computed.
        if self.ref is not None and not self.spec.algo.kl_in_reward:  # else: in the reward

            def ref(mb: MicroBatch, logits: torch.Tensor) -> None:
                mb.ref_logprobs = mb.per_sample(self._token_logprobs(logits, mb.ids))

            self._pipeline(self.ref_chunks, mbs, ref, forward_only=True)
        if old:

            def old_policy(mb: MicroBatch, logits: torch.Tensor) -> None:
                self._old_policy(mb, logits, mb.per_sample(self._token_logprobs(logits, mb.ids)), sums)

            self._pipeline(self._stages(train=False), mbs, old_policy, forward_only=True)

    def _rollout_metrics(
        self, sums: dict[str, float], local_tokens: float, grad_norms: list[float], skipped: int
    ) -> dict[str, float]:
        if self.pp_size > 1:
            # the loss terms were summed on the last stage only (the others hold zeros): every
            # stage reports them (local_tokens is every stage's own count already)
            keys = list(sums)
            sums = dict(zip(keys, self._all_reduce_sum([sums[k] for k in keys], group=self.pp_group)))
        return super()._rollout_metrics(sums, local_tokens, grad_norms, skipped)

    def _zero_grad(self) -> None:
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _finish_grad_sync(self, empty: bool) -> None:
        # the data-parallel all-reduce (or reduce-scatter) of the grad buffers; an empty rank's are zeros
        for model in self.models:
            model.finish_grad_sync()

    def _clip_and_step(self) -> tuple[float, bool]:
        if not self._grads_finite():
            return float("nan"), False
        ok, grad_norm, _ = self.optimizer.step()  # clips to actor.grad_clip itself
        return (float(grad_norm) if grad_norm is not None else float("nan")), bool(ok)

    def _grads_finite(self) -> bool:
        """Every rank agrees: are all reduced gradients finite?"""
        bad = torch.zeros(1, device=self.device)
        for p in (p for chunk in self.chunks for p in chunk.parameters()):
            g = getattr(p, "main_grad", None)
            if g is not None and not torch.isfinite(g).all():
                bad.fill_(1)
                break
        dist.all_reduce(bad, dist.ReduceOp.MAX)
        return not bool(bad.item())

    # ------------------------------------------------------------------ HF view of the weights

    def _layers(self) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
        """This stage's parameters in the order every gather takes them: the non-layer tensors
        (embedding, final norm, output layer), then layer 0, 1, ... of the whole model (empty
        where another stage holds the layer), each named by its global layer number."""
        groups: dict[int | None, list[tuple[str, torch.nn.Parameter]]] = {}
        for v, chunk in enumerate(self.chunks):
            offset = self._first_layer(v)
            for name, p in chunk.named_parameters():
                i = layer_index(name)
                # megatron numbers a chunk's layers from 0: the global index names them
                groups.setdefault(None if i is None else i + offset, []).append(
                    (name if i is None else renumber_layer(name, i + offset), p)
                )
        for key in [None, *range(self.hf_config.num_hidden_layers)]:
            yield groups.get(key, [])

    def _hf_named(self, grads: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights (or reduced gradients) in HF names, one layer at a time: the TP
        shards are gathered within each TP group, the experts over the EP group and the
        pipeline stages' parts sent to every stage, so peak extra memory is one layer. The same
        names in the same order at any TP/PP/EP layout (the fingerprint compares across layouts)."""
        for params in self._layers():
            part = self._gathered(params, grads)
            if self.pp_size > 1:
                part = self._from_every_stage(part)
            yield from megatron_full_to_hf(part, self.hf_config).items()

    def _send_weights(self, version: int) -> None:
        """DP rank 0's replica gathers and rank 0 sends (``RankBase``). Its experts are gathered
        over the EP group, which spans DP ranks 0 .. EP-1: those replicas take part in each of
        these gathers, in the same order, and in nothing else (their dense weights are DP rank
        0's; the TP gathers and pipeline broadcasts stay within DP rank 0's replica)."""
        if self.dp_rank == 0:
            return super()._send_weights(version)
        if self.moe and self.ep_size > 1 and self.edp_rank == 0:
            for params in self._layers():
                self._gathered(params, grads=False, experts_only=True)

    def _from_every_stage(self, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The union of every pipeline stage's ``part`` (in the pipeline group; each stage
        broadcasts its own: names, shapes and dtypes first, then the tensors)."""
        out: dict[str, torch.Tensor] = {}
        ranks = dist.get_process_group_ranks(self.pp_group)
        for stage, src in enumerate(ranks):
            mine = stage == self.pp_rank
            meta = [[(n, tuple(t.shape), t.dtype) for n, t in part.items()] if mine else None]
            dist.broadcast_object_list(meta, src=src, group=self.pp_group)
            for name, shape, dtype in meta[0]:
                t = part[name] if mine else torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(t, src=src, group=self.pp_group)
                out[name] = t
        return out

    def _gathered(
        self, params: list[tuple[str, torch.nn.Parameter]], grads: bool, experts_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """This stage's ``params`` (one layer, or the non-layer tensors) gathered over TP and EP
        (``experts_only``: the experts alone, for a replica that only helps DP rank 0 gather them)."""
        full, experts = {}, {}
        for name, p in params:
            expert = expert_index(name) is not None
            if experts_only and not expert:
                continue
            t = self.offloader.host_view(p.main_grad if grads else p.detach()).to(self.device).contiguous()
            if self.tp_size > 1:
                shards = [torch.empty_like(t) for _ in range(self.tp_size)]
                dist.all_gather(shards, t, group=self.etp_group if expert else self.tp_group)
                t = gather_tp_shards([{name: s} for s in shards])[name]
            (experts if expert else full)[name] = t
        if experts and self.ep_size > 1:
            # every EP rank's experts of this layer, renumbered from its local to the global index
            per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(self.ep_size)]
            for name, t in experts.items():
                gathered = [torch.empty_like(t) for _ in range(self.ep_size)]
                dist.all_gather(gathered, t, group=self.ep_group)
                for r, g in enumerate(gathered):
                    per_rank[r][name] = g
            experts = gather_ep_shards(per_rank)
        return {**full, **experts}

    # ------------------------------------------------------------------ memory

    def _owned_tensors(self) -> Iterator[torch.Tensor]:
        """Everything this rank keeps on the GPU between steps: weights, grad buffers, optimizer state."""
        for module in (*self.chunks, *self.ref_chunks):
            for p in module.parameters():
                yield p
                if getattr(p, "main_grad", None) is not None:
                    yield p.main_grad
        for buffer in (b for model in self.models for b in model.buffers):
            for t in (buffer.param_data, buffer.grad_data):
                if t is not None:
                    yield t
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:
                yield from group["params"]
            for state in inner.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)

    def offload(self) -> None:
        """Free this rank's GPU memory (weights, grads, optimizer state) for the engines (CUDA only)."""
        if self.device.type != "cuda" or self.offloaded:
            return
        freed = self.offloader.offload(self._owned_tensors())
        self.offloaded = True
        log.info("rank %d: offloaded %.1f MB to host memory", self.rank, freed / 2**20)

    def onload(self) -> None:
        if not self.offloaded:
            return
        self.offloader.onload()
        self.offloaded = False

    @contextlib.contextmanager
    def _onloaded(self) -> Iterator[None]:
        """Checkpointing reads every tensor: onload for its duration, then restore the state."""
        was = self.offloaded
        self.onload()
        try:
            yield
        finally:
            if was:
                self.offload()

    def shutdown(self) -> None:
        from megatron.core import parallel_state as mpu

        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        super().shutdown()
