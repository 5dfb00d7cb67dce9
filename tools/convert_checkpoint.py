#!/usr/bin/env python3
"""HF <-> Megatron weight conversion for checkpoints of the megatron actor (actor.backend: megatron).

  python tools/convert_checkpoint.py to-hf CKPT_DIR OUT_DIR
      CKPT_DIR: a checkpoint directory (RUN_DIR/checkpoints/rollout_000012) or its actor/
      directory, written at any TP size. OUT_DIR: a plain HF model directory (config.json,
      model.safetensors, tokenizer files) in the dtype the actor trained in (fp32, or bf16 with
      actor.megatron.bf16).

  python tools/convert_checkpoint.py from-hf HF_DIR OUT_DIR [--tp N] [--dtype bfloat16]
      OUT_DIR: a weights-only megatron checkpoint directory, OUT_DIR/actor/ holding dist/ (a
      torch_dist checkpoint of the model, no optimizer), actor_meta.json (backend megatron,
      "weights_only": true), config.json and the tokenizer: the layout the actor writes,
      minus optimizer and RNG state. It is for other megatron tooling (and round trips through
      to-hf); the rlhpc actor itself starts from HF directories directly (model.path), and
      does not resume a run from a weights-only checkpoint.
      torch_dist checkpoints are resharded on load, so it is written once at TP=1 and loads at
      any TP; --tp N only checks that the model splits N ways (heads, kv heads, ffn size).

  python tools/convert_checkpoint.py merge-lora CKPT_DIR OUT_DIR [--base HF_DIR]
      CKPT_DIR: a checkpoint of a run with actor.lora (the torch actor), or its actor/ directory,
      which holds the adapter in PEFT's format (adapter_config.json, adapter_model.safetensors).
      OUT_DIR: the base model with the adapter merged in, a plain HF model directory. --base:
      the run's base model (default: the adapter's base_model_name_or_path; for a tiny model,
      RUN_DIR/base_model).

to-hf and from-hf: one process: a torch.distributed world of size 1 (gloo on CPU, nccl on a GPU) on a loopback
port, megatron's parallel state at TP=1, the model built from the HF config. OUT_DIR is written
to a temporary directory next to it and renamed into place, so it is complete or absent; an
existing non-empty OUT_DIR is refused.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from rlhpc.actor.checkpoint_dir import (
    ACTOR_SUBDIR,
    DIST_SUBDIR,
    MEGATRON_BACKEND,
    META_FILE,
    read_meta,
    write_meta,
)
from rlhpc.errors import RlhpcError

log = logging.getLogger("convert_checkpoint")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------- checks


def actor_dir(ckpt: Path) -> Path:
    """The actor/ directory of a megatron-actor checkpoint (``ckpt`` may be it, or hold it)."""
    d = ckpt / ACTOR_SUBDIR if (ckpt / ACTOR_SUBDIR).is_dir() else ckpt
    if not d.is_dir():
        raise RlhpcError(f"{ckpt} is not a directory", "pass a checkpoint directory (RUN_DIR/checkpoints/rollout_N)")
    meta_path = d / META_FILE
    if not meta_path.is_file() or not (d / "config.json").is_file():
        raise RlhpcError(
            f"{ckpt} is not an rlhpc actor checkpoint (no {ACTOR_SUBDIR}/{META_FILE} and config.json)",
            "pass a checkpoint directory such as RUN_DIR/checkpoints/rollout_000012, or its actor/ directory",
        )
    backend = read_meta(d).get("backend", "torch")
    if backend != MEGATRON_BACKEND:
        raise RlhpcError(
            f"checkpoint {d} was not written by the megatron actor (backend {backend!r})",
            f"a {backend}-backend checkpoint's actor/ directory is already an HF model directory: "
            f"use {d} as it is (model.path, transformers' from_pretrained)",
        )
    if not (d / DIST_SUBDIR / "metadata.json").is_file():
        raise RlhpcError(
            f"checkpoint {d} has no complete torch_dist checkpoint ({DIST_SUBDIR}/metadata.json missing)",
            "the save was interrupted: use an earlier checkpoint",
        )
    return d


def check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RlhpcError(f"output directory {out} already exists and is not empty", "choose a new OUT_DIR")


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """A temporary directory next to ``out``, renamed to ``out`` when the block succeeds."""
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's is 0700; OUT_DIR gets the usual permissions
    try:
        yield tmp
        check_out_dir(out)  # nobody wrote it meanwhile
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------- megatron process state


@contextmanager
def megatron_tp1() -> Iterator[torch.device]:
    """This process as a torch.distributed world of one with megatron's parallel state at TP=1."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():
        device, backend = torch.device("cuda", 0), "nccl"
        torch.cuda.set_device(device)
    else:
        from rlhpc.actor.megatron.cpu_shim import apply_cpu_shim

        apply_cpu_shim()
        device, backend = torch.device("cpu"), "gloo"
    # Port 0: the OS picks a free one as the store binds it (no probe-then-bind race).
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        model_parallel_cuda_manual_seed(0)
        yield device
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build(hf_config, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from rlhpc.actor.megatron.model import build_gpt_model

    # No random init: every weight is overwritten. One dtype for all parameters, as the actor has.
    gpt = build_gpt_model(hf_config, tp_size=1, dtype=dtype, perform_initialization=False)
    return gpt.to(device, dtype).eval()


def checkpoint_dtype(dist_dir: Path) -> torch.dtype:
    """The dtype the actor's parameters were saved in (fp32, or bf16 with actor.megatron.bf16)."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(dist_dir))
    key = "embedding.word_embeddings.weight"
    if key not in meta:
        raise RlhpcError(f"{dist_dir} holds no model weights ({key} missing)", "pass a megatron actor checkpoint")
    return meta[key].dtype


# ---------------------------------------------------------------------- conversions


def to_hf(ckpt: Path, out: Path) -> None:
    check_out_dir(out)
    d = actor_dir(ckpt)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhpc.actor.megatron import torch_dist_load
    from rlhpc.actor.megatron.convert import megatron_full_to_hf, model_state_dict

    hf_config = AutoConfig.from_pretrained(d)
    dtype = checkpoint_dtype(d / DIST_SUBDIR)
    with megatron_tp1() as device:
        gpt = build(hf_config, dtype, device)
        # Only the model's keys: a checkpoint that also holds optimizer state loads the same
        # (keys in the checkpoint but not asked for are ignored). torch_dist reshards from the
        # TP size that wrote it to TP=1.
        state = torch_dist_load.load({"model": gpt.sharded_state_dict()}, str(d / DIST_SUBDIR))
        gpt.load_state_dict(state["model"], strict=False)
        del state
        hf_sd = {k: v.cpu().contiguous() for k, v in megatron_full_to_hf(model_state_dict(gpt), hf_config).items()}
        del gpt
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if tied:  # megatron's tied model has no output layer: lm_head is the embedding
        hf_sd["lm_head.weight"] = hf_sd["model.embed_tokens.weight"]
    model.load_state_dict(hf_sd, strict=True, assign=True)
    if tied:  # assign gave each name its tensor: make them one parameter again
        model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(d)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    log.info("wrote HF model (%s) from %s to %s", str(dtype).removeprefix("torch."), d, out)


def from_hf(hf_dir: Path, out: Path, tp: int, dtype: torch.dtype) -> None:
    check_out_dir(out)
    if not (hf_dir / "config.json").is_file():
        raise RlhpcError(f"{hf_dir} is not an HF model directory (no config.json)", "pass an HF model directory")
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhpc.actor.megatron.convert import _check_tp, hf_to_megatron, load_into

    hf_config = AutoConfig.from_pretrained(hf_dir)
    try:
        _check_tp(hf_config, tp)
    except ValueError as e:
        raise RlhpcError(f"{hf_dir} cannot be split for --tp {tp}: {e}", "choose a TP size that divides them") from e
    hf_sd = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).state_dict()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    with atomic_dir(out) as tmp, megatron_tp1() as device:
        gpt = build(hf_config, dtype, device)
        load_into(gpt, {k: v.to(device) for k, v in hf_to_megatron(hf_sd, hf_config).items()})
        del hf_sd
        d = tmp / ACTOR_SUBDIR
        (d / DIST_SUBDIR).mkdir(parents=True)
        hf_config.save_pretrained(d)
        tokenizer.save_pretrained(d)
        dist_checkpointing.save({"model": gpt.sharded_state_dict()}, str(d / DIST_SUBDIR))
        meta = {
            "backend": MEGATRON_BACKEND,
            "world_size": 1,
            "tensor_model_parallel_size": 1,
            "weights_only": True,  # no optimizer / RNG state
            "optimizer_steps": 0,
            "initial_model": str(hf_dir),
        }
        write_meta(d, meta)
    log.info("wrote megatron torch_dist weights (%s) from %s to %s", str(dtype).removeprefix("torch."), hf_dir, out)


def merge_lora(ckpt: Path, out: Path, base: Path | None) -> None:
    """A LoRA checkpoint's adapter merged into its base model, written to ``out`` atomically."""
    import json

    from rlhpc.actor import lora

    d = ckpt / ACTOR_SUBDIR if (ckpt / ACTOR_SUBDIR).is_dir() else ckpt
    if not lora.is_adapter_dir(d):
        raise RlhpcError(
            f"{ckpt} holds no LoRA adapter ({lora.ADAPTER_CONFIG} and {lora.ADAPTER_WEIGHTS})",
            "pass a checkpoint of a run with actor.lora (RUN_DIR/checkpoints/rollout_N), or its actor/ directory",
        )
    if base is None:
        base = Path(json.loads((d / lora.ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or "")
        if not (base / "config.json").is_file():
            raise RlhpcError(
                f"the adapter's base model ({base}) is not there (a node-local copy, or moved)",
                "pass the run's base model with --base (its model.path, or RUN_DIR/base_model for a tiny model)",
            )
    check_out_dir(out)
    with atomic_dir(out) as tmp:
        lora.merge_to_hf(d, base, tmp)
    log.info("merged the LoRA adapter of %s into %s: %s", d, base, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-hf", help="megatron actor checkpoint -> HF model directory")
    a.add_argument("ckpt_dir", type=Path)
    a.add_argument("out_dir", type=Path)
    b = sub.add_parser("from-hf", help="HF model directory -> weights-only megatron torch_dist checkpoint")
    b.add_argument("hf_dir", type=Path)
    b.add_argument("out_dir", type=Path)
    b.add_argument("--tp", type=int, default=1, help="check that the model splits this many ways (default 1)")
    b.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype (default float32)")
    c = sub.add_parser("merge-lora", help="LoRA checkpoint (torch actor) -> HF model directory, adapter merged")
    c.add_argument("ckpt_dir", type=Path)
    c.add_argument("out_dir", type=Path)
    c.add_argument("--base", type=Path, default=None, help="the base model (default: the adapter's own record)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        if args.command == "to-hf":
            to_hf(args.ckpt_dir, args.out_dir)
        elif args.command == "merge-lora":
            merge_lora(args.ckpt_dir, args.out_dir, args.base)
        else:
            if args.tp < 1:
                raise RlhpcError(f"--tp {args.tp}", "pass a positive TP size")
            from_hf(args.hf_dir, args.out_dir, args.tp, DTYPES[args.dtype])
    except RlhpcError as e:
        print(f"error: {e.problem}\n  fix: {e.fix}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # needed: dist_checkpointing.save starts a spawn multiprocessing Manager
    sys.exit(main())
