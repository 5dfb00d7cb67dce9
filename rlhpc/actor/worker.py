"""The PyTorch training backend: an HF causal LM, data-parallel over its ranks, trained with AdamW.

``TrainWorker`` is a Ray actor; ``ActorGroup`` (group.py) places one per actor slot and fans
calls out to all of them. The training loop, rendezvous and weight sync are ``RankBase``'s
(rank.py); this class supplies the model, its checkpoint format (an HF model directory plus
the optimizer state) and the data-parallel steps of the loop. Every rank is a data-parallel
rank; gradients are reduced in one fixed layout (``FlatGrads``), not by DDP, whose bucket
layout changes after a process's first step and with it the rounding of the sum.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from rlhpc import moe_routing
from rlhpc.actor import lora
from rlhpc.actor.checkpoint_dir import ACTOR_SUBDIR, RNG_PREFIX, read_meta, rng_file, write_meta
from rlhpc.actor.flat_grads import FlatGrads
from rlhpc.actor.rank import MicroBatch, RankBase, Rendezvous, fingerprint
from rlhpc.actor.rng import get_rng_state
from rlhpc.actor.snapshot import (
    FlatTensors,
    fits,
    fsync_files,
    read_safetensors,
    read_safetensors_into,
    safetensors_header,
)
from rlhpc.actor.spec import ActorSpec
from rlhpc.batch import RolloutBatch
from rlhpc.data.images import Vision, load_vision
from rlhpc.errors import RlhpcError
from rlhpc.model import load_model, mrope_positions, vision_language_logits
from rlhpc.weights.tensor_transport import flatten_parameters, share_memory_by_name

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.safetensors"  # the optimizer's tensors; the rest of its state dict is in the metadata
OLD_OPTIM_FILE = "optim.pt"  # torch.save of the whole state dict, written before 2026-12
# The reference model once reset to the policy (algo.ref_update_interval): the policy at the last
# reset is in no other file (checkpoints are not kept at resets), so it travels with each save.
REF_FILE = "reference.safetensors"


def flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state dict as tensors named ``state.<param>.<key>`` and the rest (JSON-able)."""
    tensors, values = {}, {}
    for idx, state in sd["state"].items():
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{idx}.{key}"] = v
            else:
                values.setdefault(str(idx), {})[key] = v
    return tensors, {"state": values, "param_groups": sd["param_groups"]}


def read_optimizer(actor_dir: Path, current: dict | None = None) -> dict:
    """The optimizer state dict of an actor checkpoint (tensors on the CPU). ``current``: the
    optimizer's own state dict; where its tensors have the file's names, dtypes and shapes (a
    rank that has trained), the file is read into them in place: no new memory to fault in."""
    path = actor_dir / OPTIM_FILE
    if not path.is_file():
        return torch.load(actor_dir / OLD_OPTIM_FILE, map_location="cpu", weights_only=True)
    entries, metadata = safetensors_header(path)
    tensors = flatten_optimizer(current)[0] if current else {}
    if tensors and fits(entries, tensors):
        read_safetensors_into(path, tensors)
    else:
        tensors, _ = read_safetensors(path)
    rest = json.loads(metadata["optimizer"])
    state: dict[int, dict] = {int(idx): dict(values) for idx, values in rest["state"].items()}
    for name, t in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = t
    return {"state": state, "param_groups": rest["param_groups"]}


def _untied(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with tied weights (an output layer sharing the embeddings) once,
    under their first name, as transformers saves them."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t
    return out


class TrainWorker(RankBase):
    """Data-parallel rank ``rank`` of ``world_size``. Call order: (rank 0)
    ``rendezvous``, (all) ``init_process_group``, ``load``, then ``train`` / ``save`` /
    ``update_weights``..."""

    can_pack = True

    def __init__(self, spec: ActorSpec, model_path: str, rank: int, world_size: int):
        super().__init__(spec, model_path, rank, world_size)
        self.module: torch.nn.Module | None = None  # the unwrapped HF model
        self.grads: FlatGrads | None = None  # None while offloaded
        self.vision: Vision | None = None  # a vision-language model's image processor
        self.peft = None  # actor.lora: the PeftModel around ``module`` (whose layers it wrapped in place)
        self._lora_dropouts: list[torch.nn.Module] = []  # on in training forwards only
        # the checkpoint snapshot: host buffers kept between saves, and what the next write needs
        self._model_snap = FlatTensors(pin=self.device.type == "cuda")
        self._optim_snap = FlatTensors(pin=self.device.type == "cuda")
        self._ref_snap = FlatTensors(pin=self.device.type == "cuda")
        self._snapshot: dict | None = None

    def init_process_group(self, rendezvous: Rendezvous) -> None:
        """Join torch.distributed, load the model, lay out its gradients, build AdamW (+ the ref model)."""
        self._join(rendezvous)
        a = self.spec.actor
        # eval(): no dropout, so the no-grad "old" pass and the training pass compute the same
        # function and the PPO ratio is exactly 1 before the first step.
        self.module = load_model(self.model_path, self.device).eval()
        # back to back in the order they are sent: a weight-sync bucket is then a view, not a copy
        flatten_parameters(self.module)
        self.vision = load_vision(self.model_path)
        if self.vision is not None and a.freeze_vision_tower:
            self.module.model.visual.requires_grad_(False)  # before FlatGrads: no gradient buffer for it
            log.info("rank %d: the vision tower is frozen (actor.freeze_vision_tower)", self.rank)
        params = list(self.module.parameters())
        if a.lora is not None:  # the base frozen; gradients, Adam state and the optimizer for the adapters only
            # peft draws A at random: from the run's seed, the same on every rank (each rank's own
            # RNG, seeded per rank, is left as it was)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.spec.seed)
                self.peft = lora.wrap(self.module, a.lora)
            params = [p for p in self.module.parameters() if p.requires_grad]
            self._lora_dropouts = [m for n, m in self.module.named_modules() if isinstance(m, torch.nn.Dropout)
                                   and ".lora_dropout." in f"{n}."]  # fmt: skip
        self.grads = FlatGrads(self.module)
        self.optimizer = torch.optim.AdamW(
            params, lr=a.lr, betas=tuple(a.adam_betas), eps=a.adam_eps, weight_decay=a.weight_decay
        )
        if self.spec.needs_reference:
            # LoRA: the reference is the same model with its adapters off (no second copy)
            self.ref = (
                lora.AdaptersOff(self.peft)
                if self.peft is not None
                else load_model(self.model_path, self.device).eval().requires_grad_(False)
            )
        log.info(
            "rank %d/%d: %s on %s, %d params%s",
            self.rank,
            self.world_size,
            self.backend,
            self.device,
            sum(p.numel() for p in self.module.parameters()),
            ", with reference model" if self.ref is not None else "",
        )
        if self.peft is not None:
            log.info(
                "rank %d: LoRA rank %d on %s: %d trained parameters",
                self.rank, a.lora.rank, a.lora.target_modules, sum(p.numel() for p in params),
            )  # fmt: skip

    # ------------------------------------------------------------------ checkpoint

    def load(self, ckpt_dir: str | None) -> None:
        """Restore weights, optimizer and this rank's RNG from ``ckpt_dir/actor/`` (None: fresh).

        Each file is read once, in one pass; the weights straight into the parameters of the
        model built at start (no second model, no copy). The reference model stays the initial
        model (KL is measured to where training started), unless it was reset to the policy
        (``algo.ref_update_interval``): then it is the one saved.
        """
        if ckpt_dir is None:
            return
        d = Path(ckpt_dir) / ACTOR_SUBDIR
        if not (d / "config.json").is_file() or not any((d / f).is_file() for f in (OPTIM_FILE, OLD_OPTIM_FILE)):
            raise FileNotFoundError(f"checkpoint {d} has no config.json or optimizer state: not an actor checkpoint")
        if lora.is_adapter_dir(d) != (self.peft is not None):
            saved = "LoRA adapters" if lora.is_adapter_dir(d) else "full weights"
            raise RlhpcError(
                f"checkpoint {d} holds {saved}, but this run has actor.lora "
                f"{'set' if self.peft is not None else 'unset'}",
                "resume with the actor.lora the run was started with (or start a new run from a merged "
                "model: tools/convert_checkpoint.py merge-lora)",
            )
        if self.peft is not None:
            self._load_adapter(d)
        else:
            self._load_weights(d)
        self.optimizer.load_state_dict(read_optimizer(d, self.optimizer.state_dict()))
        meta = read_meta(d)
        self.optimizer_steps = int(meta.get("optimizer_steps", 0))
        self.ref_reset_at = int(meta.get("ref_reset_at", 0))
        if self.ref is not None and self.ref_reset_at:
            if not (d / REF_FILE).is_file():
                raise RlhpcError(
                    f"checkpoint {d} says its reference model was reset after rollout {self.ref_reset_at - 1}, "
                    f"but has no {REF_FILE}",
                    "resume from an intact checkpoint (an older one under checkpoints/), or start the run afresh",
                )
            read_safetensors_into(d / REF_FILE, _untied(self.ref))
        self._restore_rng(d)  # on more ranks than saved, the extra ranks keep their fresh seed
        log.info("rank %d: restored actor state from %s", self.rank, d)

    def _load_weights(self, d: Path) -> None:
        """Read the HF safetensors file(s) of ``d`` into the parameters."""
        files = sorted(d.glob("*.safetensors"))
        if not (d / MODEL_FILE).is_file():  # written by another tool: sharded, or pytorch_model.bin
            saved = load_model(d, "cpu")
            with torch.no_grad():
                self.module.load_state_dict(saved.state_dict())
            return
        targets = self.module.state_dict()
        saved, _ = safetensors_header(d / MODEL_FILE)
        unknown = [n for n in saved if n not in targets]
        # Tied weights (an output layer sharing the embeddings) are saved once.
        stored = {targets[n].data_ptr() for n in saved if n in targets}
        missing = [n for n in targets if n not in saved and targets[n].data_ptr() not in stored]
        # checked before the first byte lands in a parameter: a misfit leaves the model as it was
        reshaped = [
            f"{n} {e['shape']} (the model's {list(targets[n].shape)})"
            for n, e in saved.items()
            if n in targets and e["shape"] != list(targets[n].shape)
        ]
        if unknown or missing or reshaped:
            raise RlhpcError(
                f"checkpoint {d} does not fit the model: {len(unknown)} unknown tensors "
                f"({', '.join(unknown[:3])}), {len(missing)} missing ({', '.join(missing[:3])}), "
                f"{len(reshaped)} of another shape ({', '.join(reshaped[:3])}); files {files}",
                "resume with the model the run was started with",
            )
        read_safetensors_into(d / MODEL_FILE, targets)  # straight into the parameters

    def _load_adapter(self, d: Path) -> None:
        """Read ``d``'s adapter (PEFT's file) into the adapter parameters, after checking it fits."""
        targets = lora.adapter_tensors(self.peft)
        saved, _ = safetensors_header(d / lora.ADAPTER_WEIGHTS)
        if not fits(saved, targets):
            theirs = json.loads((d / lora.ADAPTER_CONFIG).read_text())
            raise RlhpcError(
                f"the adapter in {d} (rank {theirs.get('r')}, {len(saved)} tensors) does not fit this run's "
                f"actor.lora (rank {self.spec.actor.lora.rank}, {len(targets)} tensors)",
                "resume with the actor.lora (rank, target_modules) and model the run was started with",
            )
        read_safetensors_into(d / lora.ADAPTER_WEIGHTS, targets)  # straight into the parameters

    def snapshot(self, ckpt_dir: str) -> None:
        """Host copies of the weights, optimizer state (rank 0) and this rank's RNG."""
        d = Path(ckpt_dir) / ACTOR_SUBDIR
        d.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            weights = _untied(self.module) if self.peft is None else lora.adapter_tensors(self.peft)
            self._model_snap.fill(weights, {"format": "pt"})
            if self.ref is not None and self.ref_reset_at:
                self._ref_snap.fill(_untied(self.ref), {"format": "pt"})
            tensors, rest = flatten_optimizer(self.optimizer.state_dict())
            self._optim_snap.fill(tensors, {"format": "pt", "optimizer": json.dumps(rest)})
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # the copies were non-blocking
        self._snapshot = {
            "dir": d,
            "rng": get_rng_state(),
            "meta": {
                "world_size": self.world_size,
                "optimizer_steps": self.optimizer_steps,
                "initial_model": self.model_path,
                "ref_reset_at": self.ref_reset_at,
                "lora": self.peft is not None,
            },
        }

    def write_snapshot(self) -> dict[str, tuple[int, int]]:
        """``actor/``: HF model + tokenizer, optimizer (rank 0), RNG (every rank); each file fsynced.
        With LoRA the adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``)
        instead of the model's weights (the base model's config.json stays, for the merge).
        Returns the size and CRC-32 of the large files, for the manifest."""
        snap, self._snapshot = self._snapshot, None
        if snap is None:
            raise RuntimeError("write_snapshot without a snapshot")
        d = snap["dir"]
        sums, small = {}, []
        if self.rank == 0:
            weights = MODEL_FILE if self.peft is None else lora.ADAPTER_WEIGHTS
            files = [(weights, self._model_snap), (OPTIM_FILE, self._optim_snap)]
            if snap["meta"]["ref_reset_at"] and self.ref is not None:
                files.append((REF_FILE, self._ref_snap))
            for name, flat in files:
                sums[f"{ACTOR_SUBDIR}/{name}"] = flat.write(d / name)
            self.module.config.save_pretrained(d)
            if self.peft is not None:
                lora.write_adapter_config(lora.adapter_config(self.peft), d)
            if self.module.can_generate():
                self.module.generation_config.save_pretrained(d)
            self.tokenizer.save_pretrained(d)
            write_meta(d, snap["meta"])
            small = [p for p in d.iterdir() if p.is_file() and not p.name.startswith(RNG_PREFIX)]
            small = [p for p in small if f"{ACTOR_SUBDIR}/{p.name}" not in sums]
        rng = d / rng_file(self.rank)
        torch.save(snap["rng"], rng)
        fsync_files([*small, rng])
        return sums

    # ------------------------------------------------------------------ train-step hooks (RankBase.train)

    def _policy(self, train: bool) -> torch.nn.Module:
        for dropout in self._lora_dropouts:  # actor.lora.dropout: in training forwards only
            dropout.train(train)
        return self.module

    def _logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        if mb.vision is not None:
            v = mb.vision
            positions = mb.positions if mb.positions is not None else v["position_ids"]
            logits = vision_language_logits(
                model, mb.ids, positions, mb.attention, v["pixel_values"], v["image_grid_thw"], v["images"]
            )
            return logits[:, :-1].float()
        # algo.routing_replay: every token goes to the experts the engine chose (the router sees
        # the tokens flattened batch-major, as the micro-batch's routing is laid out)
        routing = mb.routed_experts.flatten(0, 1) if mb.routed_experts is not None else None
        with moe_routing.replayed(model, routing):
            if mb.positions is not None:
                # Packed: with no attention mask, transformers makes the attention block-diagonal
                # where the position ids restart, but only without a KV cache (with one it ignores them).
                return model(input_ids=mb.ids, position_ids=mb.positions, use_cache=False).logits[:, :-1].float()
            return model(input_ids=mb.ids, attention_mask=mb.attention).logits[:, :-1].float()

    def _with_images(self, mb: MicroBatch, rmb: RolloutBatch, ids: torch.Tensor, attention: torch.Tensor) -> None:
        """The micro-batch's images, each distinct one processed once (a group's samples share it),
        in sample order as the forward takes them; the 3-D positions from the model's own
        ``get_rope_index``. Packed: each sample's positions as padded, laid out as the packed row,
        under a row of text positions from which transformers builds the block-diagonal mask."""
        if self.vision is None:
            raise RlhpcError(
                f"a rollout has images but {self.model_path} is not a vision-language model",
                "train a vision-language model on image data (model.tiny.architecture: qwen2_5_vl, or a Qwen2.5-VL)",
            )
        done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for refs in rmb.images:
            for ref in refs:
                if id(ref) not in done:
                    done[id(ref)] = self.vision.pixels([ref])
        rows = [done[id(ref)] for refs in rmb.images for ref in refs]
        grid = torch.cat([g for _, g in rows]).to(self.device)
        ids, attention = ids.to(self.device), attention.to(self.device)
        # the prompts' image tokens: one the policy sampled in a response is text (as in SGLang)
        prompt = (
            torch.arange(ids.shape[1], device=self.device)[None]
            < torch.tensor([len(p) for p in rmb.prompt_ids], device=self.device)[:, None]
        )
        images = (ids == self.module.config.image_token_id) & prompt
        padded = mrope_positions(self.module, ids, attention, grid, images)
        mb.vision = {"pixel_values": torch.cat([p for p, _ in rows]).to(self.device), "image_grid_thw": grid}
        if mb.positions is None:
            mb.vision |= {"position_ids": padded, "images": images}
        else:
            keep = attention.bool()
            mb.positions = torch.cat([mb.positions[None], padded[:, keep][:, None]], dim=0)
            mb.vision["images"] = images[keep][None]

    def _token_logprobs(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)

    def _zero_grad(self) -> None:
        self.grads.zero()

    def _reset_reference(self) -> None:
        with torch.no_grad():
            for r, p in zip(self.ref.parameters(), self.module.parameters(), strict=True):
                r.copy_(p)

    def reference_fingerprint(self) -> str | None:
        """SHA-256 of the reference model's weights, named as ``state_fingerprint``'s (None: no reference)."""
        if self.ref is None:
            return None
        return fingerprint(lora.base_named(self.module) if self.peft is not None else self.ref.named_parameters())

    def _finish_grad_sync(self, empty: bool) -> None:
        # the micro-batches' backwards only accumulated; a rank with no sample adds its zeros
        self.grads.all_reduce_mean(self.dp_group)

    def _clip_and_step(self) -> tuple[float, bool]:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.spec.actor.grad_clip))
        # the norm is computed after the all-reduce, so every rank skips the same step
        if not math.isfinite(grad_norm):
            return grad_norm, False
        self.optimizer.step()
        return grad_norm, True

    def _share_weights_with_colocated_engines(self) -> None:
        # On CPU the parameters' one flat storage moves into shared memory (the views stay): a
        # colocated push then sends handles to the weights as they are, and each engine copies
        # them once, with no staging copy here. (On GPUs a push sends CUDA IPC handles anyway.)
        if self.device.type == "cpu":
            share_memory_by_name(self.module)

    def _hf_named(self, grads: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        if self.peft is not None:  # LoRA: the merged weights under the base's names; the adapters' gradients
            if not grads:
                yield from lora.merged_named(self.module)
                return
            for name, p in self.module.named_parameters():
                if p.requires_grad:
                    yield name, p.grad
            return
        for name, p in self.module.named_parameters():
            yield name, (p.grad if grads else p.detach())

    def _write_push_adapter(self, version: int) -> str:
        """This push's adapter under ``spec.lora_push_dir`` (``v<version>``); the older pushes'
        directories go (each was loaded when it was pushed; an engine restarted later gets the
        current version pushed again)."""
        root = Path(self.spec.lora_push_dir)
        d = lora.write_adapter(self.peft, root / f"v{version:06d}")
        for old in root.glob("v*"):
            if old != d:
                shutil.rmtree(old, ignore_errors=True)
        return str(d)

    def lora_adapter(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """The adapter alone in PEFT's format: its config as ``adapter_config.json`` holds it, and
        CPU copies of its tensors under PEFT's names (an adapter-only push; tests)."""
        if self.peft is None:
            raise RlhpcError("the adapter was asked for, but this actor trains no LoRA", "set actor.lora")
        tensors = {n: t.detach().cpu().clone() for n, t in lora.adapter_tensors(self.peft).items()}
        return lora.adapter_config(self.peft), tensors

    # ------------------------------------------------------------------ memory

    def offload(self) -> None:
        """Move model, reference model and optimizer state to host memory (CUDA only).

        On CPU there is nothing to free, so this is a no-op. The gradient buffers are dropped
        too: they are a full model-sized GPU buffer. ``update_weights``, ``save`` and
        ``state_fingerprint`` work while offloaded; ``train`` onloads by itself.
        """
        if self.device.type != "cuda" or self.offloaded:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.grads = None
        self._move(torch.device("cpu"))
        torch.cuda.empty_cache()
        self.offloaded = True

    def onload(self) -> None:
        """Undo ``offload``."""
        if self.device.type != "cuda" or not self.offloaded:
            return
        self._move(self.device)
        self.grads = FlatGrads(self.module)
        self.offloaded = False

    def _move(self, device: torch.device) -> None:
        self.module.to(device)
        if self.ref is not None and self.peft is None:  # LoRA's reference is the module itself
            self.ref.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
