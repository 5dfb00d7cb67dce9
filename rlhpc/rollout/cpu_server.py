"""A CPU rollout engine that speaks SGLang's native HTTP protocol.

SGLang cannot run on CPU-only machines (CI), so this server stands in for it with the same
routes, request field names and response shapes (as of SGLang 0.5.x ``http_server.py`` /
``io_struct.py``), backed by a Hugging Face model and ``rlhpc.rollout.sampling.sample``.
The one client, ``rlhpc.rollout.client.EngineClient``, drives both.

    python -m rlhpc.rollout.cpu_server --model-path DIR --host HOST --port 0 --ready-file FILE

With ``--port 0`` the server binds a free port itself and writes ``{"host", "port", "pid"}`` to
the ready file (temp + rename) once it answers HTTP, so callers never race for ports.
``--device cuda`` puts the model on cuda:0 (GPU checks); weight update groups may then use
NCCL, and colocated senders may pass CUDA tensors by IPC handle.

Concurrency: one HTTP /generate request is one sampling batch, and batches run one at a time on
a single thread, so with fixed ``sampling_seed``s a request's tokens do not depend on other
traffic. Weight routes run on a second thread; a lock keeps them off the model while a batch
computes. ``/pause_generation`` holds new batches (and, in modes ``in_place``/``retract``, the
running one between decoding steps; ``abort``, SGLang's default, ends it) until
``/continue_generation``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from rlhpc.model import load_model, load_tokenizer
from rlhpc.rollout.sampling import sample
from rlhpc.rollout.weight_sync import init_custom_process_group

log = logging.getLogger("rlhpc.cpu_server")

SERVER_VERSION = "rlhpc-cpu-engine-0.1"
MEMORY_TAGS = ("weights", "kv_cache")
TOP_K_ALL = 1 << 30  # SGLang's "no top-k"


class EngineError(Exception):
    """A request the engine refuses; answered as HTTP 400 with SGLang's error body."""


def error_response(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


# ------------------------------------------------------------------ request bodies (SGLang names)


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang clients may send fields we do not use


class InitWeightsUpdateGroupReq(_Req):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReq(_Req):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReq(_Req):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class UpdateWeightsFromTensorReq(_Req):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class MemoryOccupationReq(_Req):
    tags: list[str] | None = None


class GetWeightsByNameReq(_Req):
    name: str
    truncate_size: int = 100


class AbortReq(_Req):
    rid: str | None = ""
    abort_all: bool = False


class PauseGenerationReq(_Req):
    mode: str = "abort"


# ------------------------------------------------------------------ generate requests


@dataclass
class Item:
    """One row of a /generate batch, normalised."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_ids: set[int]
    return_logprob: bool
    skip_special_tokens: bool
    no_stop_trim: bool


# Sampling parameters we accept only at their neutral values (anything else changes the
# distribution, and silently ignoring it would make CPU and GPU runs differ).
_NEUTRAL = {
    "min_p": (0.0,),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "min_new_tokens": (0,),
    "stop": ([], ""),
    "stop_regex": ([], ""),
    "json_schema": (),
    "regex": (),
    "ebnf": (),
    "structural_tag": (),
    "logit_bias": ({},),
}
_HARMLESS = {"n", "spaces_between_special_tokens", "stream_interval", "custom_params"}
_USED = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "sampling_seed",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
}


def _per_item(value: Any, num: int, what: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != num:
            raise EngineError(f"{what} has {len(value)} entries for a batch of {num}")
        return value
    return [value] * num


# ------------------------------------------------------------------ the engine


class Engine:
    def __init__(self, model_path: str, weight_version: str, device: str = "cpu"):
        self.model_path = model_path
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        self.model = load_model(model_path, self.device).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(model_path)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = self._eos_ids()
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)  # padded rows are masked anyway
        self.weight_version = weight_version

        self.model_lock = threading.Lock()  # held while a batch computes or weights change
        self.running = threading.Event()  # cleared while paused
        self.running.set()
        self.pause_mode = "abort"
        self.released: set[str] = set()
        self.stale: set[str] = set()  # parameters re-allocated but not re-sent since a resume
        self._shapes: dict[str, torch.Size] = {}  # of released parameters
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.group_devices: dict[str, torch.device] = {}  # where a group's broadcasts land
        self.busy = False

        self._seq = itertools.count()
        self._abort_lock = threading.Lock()
        self._abort_before = -1  # batches numbered below this are aborted (abort_all)
        self._abort_rids: set[str] = set()
        log.info(
            "loaded %s on %s (%d params, vocab %d)",
            model_path,
            self.device,
            sum(p.numel() for p in self.model.parameters()),
            self.vocab_size,
        )

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # -------------------------------------------------------------- generation

    def next_seq(self) -> int:
        return next(self._seq)

    def normalize(self, body: dict[str, Any]) -> tuple[list[Item], bool]:
        """GenerateReqInput -> rows, following SGLang's batching and parallel-sampling rules."""
        for unsupported in ("input_embeds", "image_data", "video_data", "audio_data", "lora_path"):
            if body.get(unsupported) is not None:
                raise EngineError(f"{unsupported} is not supported by the CPU engine")
        if body.get("stream"):
            raise EngineError("stream=true is not supported by the CPU engine")
        if body.get("top_logprobs_num"):
            raise EngineError("top_logprobs_num is not supported by the CPU engine")
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise EngineError("Either text or input_ids should be provided.")
        if input_ids is not None:
            if not isinstance(input_ids, list) or not input_ids:
                raise EngineError("input_ids cannot be empty.")
            single = isinstance(input_ids[0], int)
            prompts = [input_ids] if single else input_ids
        else:
            single = isinstance(text, str)
            texts = [text] if single else text
            prompts = [self.tokenizer.encode(t) for t in texts]
        for p in prompts:
            if not isinstance(p, list) or not p or not all(isinstance(t, int) for t in p):
                raise EngineError("every prompt must be a non-empty list of token ids")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise EngineError(f"token id out of range [0, {self.vocab_size})")
            if len(p) >= self.context_len:
                raise EngineError(f"prompt of {len(p)} tokens does not fit the context length {self.context_len}")

        params = body.get("sampling_params")
        params = {} if params is None else params
        batch_size = len(prompts)
        if isinstance(params, list):
            if not params or not all(isinstance(p, dict) for p in params):
                raise EngineError("sampling_params must be a dict or a list of dicts")
            ns = {int(p.get("n") or 1) for p in params}
            if len(ns) != 1:
                raise EngineError("The parallel_sample_num should be the same for all samples in sample params.")
            n = ns.pop()
        elif isinstance(params, dict):
            n = int(params.get("n") or 1)
        else:
            raise EngineError("sampling_params must be a dict or a list of dicts")
        if n > 1 and single:
            single = False
        num = batch_size * n
        # SGLang repeats the whole batch n times: [p0, p1, p0, p1, ...]
        prompts = prompts * n
        param_list = (
            [params] * num if isinstance(params, dict) else _per_item(params, batch_size, "sampling_params") * n
        )
        logprob_flags = _per_item(body.get("return_logprob") or False, batch_size, "return_logprob") * n

        rid = body.get("rid")
        if single:
            rids = [rid if isinstance(rid, str) else uuid.uuid4().hex]
        elif rid is None:
            rids = [uuid.uuid4().hex for _ in range(num)]
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(num)]
        else:
            base = _per_item(rid, batch_size, "rid")
            rids = base if n == 1 else [f"{r}_{k}" for k in range(n) for r in base]
        items = [self._item(r, p, sp, bool(lp)) for r, p, sp, lp in zip(rids, prompts, param_list, logprob_flags)]
        return items, single

    def _item(self, rid: str, prompt: list[int], sp: dict[str, Any], return_logprob: bool) -> Item:
        for key, value in sp.items():
            if key in _USED or key in _HARMLESS or value is None:
                continue
            if key in _NEUTRAL:
                if value not in _NEUTRAL[key]:
                    raise EngineError(f"sampling param {key}={value!r} is not supported by the CPU engine")
                continue
            raise EngineError(f"unknown sampling param {key!r}")
        temperature = 1.0 if sp.get("temperature") is None else float(sp["temperature"])
        top_p = 1.0 if sp.get("top_p") is None else float(sp["top_p"])
        top_k = -1 if sp.get("top_k") is None else int(sp["top_k"])
        if temperature < 0 or not 0 < top_p <= 1:
            raise EngineError(f"bad sampling params: temperature={temperature}, top_p={top_p}")
        if top_k == 1 or temperature < 1e-6:  # SGLang: both mean greedy
            temperature = 0.0
        elif top_k not in (-1, TOP_K_ALL):
            raise EngineError(f"top_k={top_k} is not supported by the CPU engine (only -1 or 1)")
        room = self.context_len - len(prompt)
        max_new = sp.get("max_new_tokens", 128)
        max_new = room if max_new is None else int(max_new)
        if max_new < 0:
            raise EngineError(f"max_new_tokens must be at least 0, got {max_new}")
        stops = set() if sp.get("ignore_eos") else set(self.eos_ids)
        stops.update(int(t) for t in sp.get("stop_token_ids") or ())
        seed = sp.get("sampling_seed")
        return Item(
            rid=rid,
            prompt=prompt,
            max_new_tokens=max_new,
            temperature=temperature,
            top_p=top_p,
            seed=None if seed is None else int(seed),
            stop_ids=stops,
            return_logprob=return_logprob,
            skip_special_tokens=sp.get("skip_special_tokens", True) is not False,
            no_stop_trim=bool(sp.get("no_stop_trim")),
        )

    def _aborted(self, seq: int, rids: list[str]) -> bool:
        with self._abort_lock:
            if seq < self._abort_before:
                return True
            hit = self._abort_rids.intersection(rids)
            self._abort_rids.difference_update(hit)
            return bool(hit)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        with self._abort_lock:
            if abort_all:
                self._abort_before = next(self._seq)  # everything that arrived before now
            elif rid:
                if len(self._abort_rids) > 10_000:  # rids of long-finished requests
                    self._abort_rids.clear()
                self._abort_rids.add(rid)

    def require_usable(self) -> None:
        if self.released:
            raise EngineError(
                f"engine memory is released (tags {sorted(self.released)}); call resume_memory_occupation "
                "and re-send the weights before generating"
            )
        if self.stale:
            raise EngineError(
                f"{len(self.stale)} parameter(s) not re-sent since resume_memory_occupation "
                f"(e.g. {sorted(self.stale)[:3]}); update the weights before generating"
            )

    def _step_hook(self, seq: int, rids: list[str]) -> bool:
        """Between decoding steps: abort, wait out a pause (off the model lock), check weights."""
        if self._aborted(seq, rids):
            return True
        if not self.running.is_set():
            aborted = False
            self.model_lock.release()
            try:
                while not self.running.wait(0.05):
                    if self._aborted(seq, rids):
                        aborted = True
                        break
            finally:
                self.model_lock.acquire()
            if aborted or self._aborted(seq, rids):
                return True
        self.require_usable()
        return False

    def generate(self, items: list[Item], seq: int) -> list[dict[str, Any]]:
        """Run one batch (called on the single generation thread)."""
        t0 = time.perf_counter()
        rids = [it.rid for it in items]
        with self.model_lock:
            self.busy = True
            try:
                samples = sample(
                    self.model,
                    [it.prompt for it in items],
                    [it.max_new_tokens for it in items],
                    [it.temperature for it in items],
                    [it.top_p for it in items],
                    [it.seed for it in items],
                    eos_id=min(self.eos_ids, default=-1),  # unused: stop_ids decides per row
                    pad_id=self.pad_id,
                    stop_ids=[it.stop_ids for it in items],
                    step_hook=lambda: self._step_hook(seq, rids),
                )
            finally:
                self.busy = False
            version = self.weight_version
        latency = time.perf_counter() - t0
        return [self._output(it, s, version, latency) for it, s in zip(items, samples)]

    def _output(self, it: Item, s: Any, version: str, latency: float) -> dict[str, Any]:
        if s.finish_reason == "stop":
            finish: dict[str, Any] = {"type": "stop", "matched": s.output_ids[-1]}
        elif s.finish_reason == "length":
            finish = {"type": "length", "length": it.max_new_tokens}
        else:
            finish = {"type": "abort", "message": "Abort in waiting queue" if not s.output_ids else "Aborted"}
        text_ids = s.output_ids
        if s.finish_reason == "stop" and not it.no_stop_trim:
            text_ids = text_ids[:-1]  # SGLang trims the matched stop token from the text only
        meta: dict[str, Any] = {
            "id": it.rid,
            "finish_reason": finish,
            "prompt_tokens": len(it.prompt),
            "weight_version": version,
            "completion_tokens": len(s.output_ids),
            "cached_tokens": 0,
            "e2e_latency": latency,
        }
        if it.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(s.output_logprobs, s.output_ids)]
        return {
            "text": self.tokenizer.decode(text_ids, skip_special_tokens=it.skip_special_tokens),
            "output_ids": s.output_ids,
            "meta_info": meta,
        }

    # -------------------------------------------------------------- weights

    def _param_table(self) -> dict[str, torch.nn.Parameter]:
        # with duplicates: a tied lm_head is addressable by either name
        return dict(self.model.named_parameters(remove_duplicate=False))

    def load_weights(self, named: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        """Validate every tensor first, then copy all: an update applies fully or not at all."""
        table = self._param_table()
        problems = []
        for name, t in named:
            p = table.get(name)
            if p is None:
                problems.append(f"unknown parameter {name!r}")
            elif tuple(t.shape) != tuple(p.shape):
                problems.append(f"{name}: shape {tuple(t.shape)} != engine's {tuple(p.shape)}")
        if problems:
            raise EngineError(f"{len(problems)} bad tensor(s): " + "; ".join(problems[:5]))
        with self.model_lock:
            if "weights" in self.released:
                raise EngineError("weights are released; resume_memory_occupation(['weights']) before updating")
            with torch.no_grad():
                for name, t in named:
                    table[name].copy_(t)  # casts if the trainer's dtype differs
            if self.device.type == "cuda":
                # copy_ is asynchronous on CUDA; the sender frees (or reuses) its IPC/broadcast
                # memory as soon as we answer, so the copies must be done first.
                torch.cuda.synchronize(self.device)
            self.stale.difference_update(name for name, _ in named)
            if version is not None:
                self.weight_version = version
        log.info("loaded %d tensor(s)%s", len(named), f"; weight_version {version}" if version is not None else "")

    def init_group(self, req: InitWeightsUpdateGroupReq) -> str:
        if req.group_name in self.groups:
            raise EngineError(f"weight update group {req.group_name!r} already exists")
        if req.backend == "nccl" and self.device.type != "cuda":
            raise EngineError("backend 'nccl' needs an engine on CUDA (--device cuda); a CPU engine joins with 'gloo'")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL uses the calling (control) thread's current device
        self.groups[req.group_name] = init_custom_process_group(
            req.backend,
            req.master_address,
            req.master_port,
            req.rank_offset,  # this engine is one rank (TP=1)
            req.world_size,
            req.group_name,
        )
        # NCCL broadcasts into GPU buffers; gloo into CPU ones, copied onto the model's device after
        self.group_devices[req.group_name] = self.device if req.backend == "nccl" else torch.device("cpu")
        return f"joined {req.group_name} as rank {req.rank_offset} of {req.world_size}"

    def destroy_group(self, group_name: str) -> str:
        pg = self.groups.pop(group_name, None)
        self.group_devices.pop(group_name, None)
        if pg is None:
            raise EngineError(f"no weight update group {group_name!r}")
        dist.destroy_process_group(pg)
        return f"destroyed {group_name}"

    def update_from_distributed(self, req: UpdateWeightsFromDistributedReq) -> str:
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise EngineError("names, dtypes and shapes differ in length")
        pg = self.groups.get(req.group_name)
        if pg is None:
            raise EngineError(f"no weight update group {req.group_name!r}; call init_weights_update_group first")
        if req.abort_all_requests:
            self.abort(abort_all=True)
        device = self.group_devices[req.group_name]
        if device.type == "cuda":
            torch.cuda.set_device(device)
        received = []
        # Receive every tensor even if some will be refused: skipping one would desynchronise
        # the broadcast sequence for the trainer and every other engine in the group.
        for name, dtype, shape in zip(req.names, req.dtypes, req.shapes):
            buf = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(buf, group_src=0, group=pg)
            received.append((name, buf))
        self.load_weights(received, req.weight_version)
        return f"updated {len(received)} tensor(s)"

    def update_from_tensor(self, req: UpdateWeightsFromTensorReq) -> str:
        if req.load_format not in (None, "direct", "default"):
            raise EngineError(f"load_format {req.load_format!r} is not supported by the CPU engine")
        if not req.serialized_named_tensors:
            raise EngineError("serialized_named_tensors is empty")
        if req.abort_all_requests:
            self.abort(abort_all=True)
        # this engine is TP rank 0 of 1; CUDA IPC handles only open on a GPU engine
        named = loads_named_tensors(req.serialized_named_tensors[0], allow_cuda=self.device.type == "cuda")
        self.load_weights(named, req.weight_version)
        return f"updated {len(named)} tensor(s)"

    def get_weights_by_name(self, name: str, truncate_size: int) -> list:
        with self.model_lock:
            if "weights" in self.released:
                raise EngineError("weights are released")
            if name in self.stale:
                raise EngineError(f"{name} not re-sent since resume_memory_occupation")
            p = self._param_table().get(name)
            if p is None:
                raise EngineError(f"unknown parameter {name!r}")
            return p.detach()[:truncate_size].tolist()

    # -------------------------------------------------------------- memory

    def release(self, tags: list[str] | None) -> None:
        tags = _check_tags(tags)
        with self.model_lock:
            if "weights" in tags and "weights" not in self.released:
                # Swap each parameter's storage for an empty one (the Parameter objects, and so
                # tied weights, stay). Buffers such as rotary tables stay too: nobody re-sends them.
                for name, p in self.model.named_parameters():
                    self._shapes[name] = p.shape
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            # kv_cache: sample() builds its cache per batch and frees it after, so nothing is
            # resident between requests; the tag is recorded to refuse generation like SGLang.
            self.released.update(tags)
            if self.device.type == "cuda":
                # freed blocks stay reserved by torch's caching allocator; hand them back to the
                # driver so a colocated trainer can use the memory
                torch.cuda.empty_cache()
        log.info("released %s (weights bytes now %d)", tags, self.weights_bytes())

    def resume(self, tags: list[str] | None) -> None:
        tags = _check_tags(tags)
        with self.model_lock:
            if "weights" in tags and "weights" in self.released:
                for name, p in self.model.named_parameters():
                    p.data = torch.empty(self._shapes.pop(name), dtype=p.dtype, device=p.device)
                    self.stale.add(name)
            self.released.difference_update(tags)
        log.info("resumed %s; %d parameter(s) await new weights", tags, len(self.stale))

    def weights_bytes(self) -> int:
        return sum(p.untyped_storage().nbytes() for p in self.model.parameters())

    # -------------------------------------------------------------- info

    def model_info(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        }

    def server_info(self, host: str, port: int) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "host": host,
            "port": port,
            "device": self.device.type,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "context_length": self.context_len,
            "weight_version": self.weight_version,
            "version": SERVER_VERSION,
            "status": "ready",
            "internal_states": [
                {
                    "paused": not self.running.is_set(),
                    "pause_mode": self.pause_mode,
                    "released_tags": sorted(self.released),
                    "weights_bytes": self.weights_bytes(),
                    "weight_update_groups": sorted(self.groups),
                    **(
                        {"cuda_memory_reserved_bytes": torch.cuda.memory_reserved(self.device)}
                        if self.device.type == "cuda"
                        else {}
                    ),
                }
            ],
        }


def _check_tags(tags: list[str] | None) -> list[str]:
    if tags is None:
        return list(MEMORY_TAGS)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise EngineError(f"unknown memory tag(s) {bad}; use {list(MEMORY_TAGS)}")
    return list(tags)


# ------------------------------------------------------------------ colocated tensor payloads

# Only what torch's ForkingPickler emits for CPU tensors shared through the "file_system"
# strategy (see rlhpc.rollout.weight_sync.serialize_named_tensors), and for CUDA tensors on a
# GPU engine, may be unpickled: the body arrives over HTTP, and plain pickle would run whatever
# it names.
_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
}
_REFUSED_GLOBALS = {
    "rebuild_storage_fd": "the sender shared tensors by file descriptor, which only its own child "
    "processes can open; serialise with the 'file_system' sharing strategy",
    "rebuild_cuda_tensor": "CUDA tensors cannot be loaded by the CPU engine (start it with --device cuda)",
}
_CUDA_GLOBAL = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, allow_cuda: bool):
        super().__init__(file)
        self.allow_cuda = allow_cuda

    def find_class(self, module: str, name: str) -> Any:
        if (
            (module, name) in _ALLOWED_GLOBALS
            or (self.allow_cuda and (module, name) == _CUDA_GLOBAL)
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        ):
            return super().find_class(module, name)
        if name in _REFUSED_GLOBALS:
            raise EngineError(_REFUSED_GLOBALS[name])
        raise EngineError(f"refusing to unpickle {module}.{name} from a weight payload")


def loads_named_tensors(payload: str, allow_cuda: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Unpickle [(name, tensor), ...]; ``allow_cuda`` lets CUDA IPC handles through (GPU engine)."""
    try:
        raw = base64.b64decode(payload, validate=True)
        named = _TensorUnpickler(io.BytesIO(raw), allow_cuda).load()
    except EngineError:
        raise
    except Exception as e:
        raise EngineError(f"cannot read serialized_named_tensors: {type(e).__name__}: {e}") from e
    if not isinstance(named, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor) for x in named
    ):
        raise EngineError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return named


# ------------------------------------------------------------------ HTTP


def build_app(engine: Engine, address: dict[str, Any]) -> FastAPI:
    """FastAPI app with SGLang's native routes. ``address`` holds host/port once bound."""
    app = FastAPI(openapi_url=None)
    gen_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")  # one batch at a time
    ctl_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="control")  # weight/memory ops in order
    state = {"shutting_down": False}
    app.state.engine = engine
    app.state.flags = state

    async def on(pool: ThreadPoolExecutor, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def success_route(fn: Any, *args: Any) -> JSONResponse:
        try:
            message = await on(ctl_pool, fn, *args)
        except Exception as e:  # SGLang answers these routes with success=false, not a raise
            log.warning("%s failed: %s", getattr(fn, "__name__", fn), e)
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"}, status_code=400)
        return JSONResponse({"success": True, "message": message})

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(f"invalid request to {request.url.path}: {exc.errors()}")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if state["shutting_down"] else 200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if state["shutting_down"]:
            return Response(status_code=503)
        if engine.busy or not engine.running.is_set() or engine.released or engine.stale:
            return Response(status_code=200)  # like SGLang: a busy or paused engine is alive
        items, _ = engine.normalize({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        try:
            await on(gen_pool, engine.generate, items, engine.next_seq())
        except Exception as e:
            log.error("health_generate failed: %s", e)
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> dict[str, Any]:
        return engine.server_info(address.get("host", ""), address.get("port", 0))

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        seq = engine.next_seq()  # arrival order decides what an abort_all covers
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise EngineError("the request body must be a JSON object")
            items, single = engine.normalize(body)
            outs = await on(gen_pool, engine.generate, items, seq)
        except EngineError as e:
            return error_response(str(e))
        except ValueError as e:  # bad JSON, bad numbers
            return error_response(f"{type(e).__name__}: {e}")
        except Exception as e:
            log.exception("generate failed")
            return error_response(f"{type(e).__name__}: {e}", status=500)
        return JSONResponse(outs[0] if single else outs)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # Nothing is cached between requests (no radix cache), so this always succeeds.
        return Response(content="Cache flushed.\n", status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        raw = await request.body()
        req = PauseGenerationReq.model_validate_json(raw) if raw.strip() else PauseGenerationReq()
        if req.mode not in ("abort", "retract", "in_place"):
            return error_response(f"unknown pause mode {req.mode!r}")
        engine.pause_mode = req.mode
        engine.running.clear()
        if req.mode == "abort":
            engine.abort(abort_all=True)
        # (retract is served like in_place: the running batch keeps its cache and resumes
        # with whatever weights are loaded by then.)
        log.info("generation paused (%s)", req.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        engine.running.set()
        log.info("generation continued")
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(req: AbortReq) -> Response:
        engine.abort(req.rid, req.abort_all)
        return Response(status_code=200)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitWeightsUpdateGroupReq) -> JSONResponse:
        return await success_route(engine.init_group, req)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyWeightsUpdateGroupReq) -> JSONResponse:
        return await success_route(engine.destroy_group, req.group_name)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateWeightsFromDistributedReq) -> JSONResponse:
        return await success_route(engine.update_from_distributed, req)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(req: UpdateWeightsFromTensorReq) -> JSONResponse:
        return await success_route(engine.update_from_tensor, req)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(req: GetWeightsByNameReq) -> Any:
        try:
            return JSONResponse(await on(ctl_pool, engine.get_weights_by_name, req.name, req.truncate_size))
        except EngineError as e:
            return error_response(str(e))

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(req: MemoryOccupationReq) -> Any:
        try:
            await on(ctl_pool, engine.release, req.tags)
        except EngineError as e:
            return error_response(str(e))
        return None

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(req: MemoryOccupationReq) -> Any:
        try:
            await on(ctl_pool, engine.resume, req.tags)
        except EngineError as e:
            return error_response(str(e))
        return None

    return app


# ------------------------------------------------------------------ process


def _write_ready_file(path: Path, info: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)  # readers see the whole file or none


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))  # port 0: the kernel picks a free port, no probe-then-bind race
    sock.set_inheritable(False)
    return sock


def _watch_parent(parent_pid: int, server: uvicorn.Server) -> None:
    """Exit when the parent dies, so a killed Ray actor leaves no orphan server."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            log.warning("parent %d is gone; shutting down", parent_pid)
            server.should_exit = True
            time.sleep(10)
            os._exit(1)  # graceful shutdown stuck (e.g. a broadcast that never completes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = pick a free port (see --ready-file)")
    p.add_argument("--ready-file", type=Path, help='written as {"host", "port", "pid"} once serving')
    p.add_argument("--weight-version", default="default")
    p.add_argument("--parent-pid", type=int, help="exit when this process is no longer our parent")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the model on cuda:0")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device (a CPU build of torch, or no GPU visible)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s cpu_server[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    torch.set_num_threads(max(1, args.threads))
    stop_requested = threading.Event()
    # Our own handler outlives uvicorn's: after its graceful shutdown uvicorn re-raises the
    # signal, which would otherwise kill us with status -15 instead of a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())

    engine = Engine(args.model_path, args.weight_version, args.device)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    address = {"host": args.host, "port": port}
    app = build_app(engine, address)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=3, lifespan="off")
    server = uvicorn.Server(config)
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, server), daemon=True).start()

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            log.info("serving %s on %s:%d (weight_version %s)", args.model_path, host, port, engine.weight_version)
            if args.ready_file:
                _write_ready_file(args.ready_file, {"host": args.host, "port": port, "pid": os.getpid()})
        await task

    code = 0
    try:
        asyncio.run(serve())
    except Exception:
        log.exception("server failed")
        code = 1
    finally:
        app.state.flags["shutting_down"] = True
        if args.ready_file is not None:
            args.ready_file.unlink(missing_ok=True)
        log.info("exiting (%s)", "SIGTERM" if stop_requested.is_set() else f"code {code}")
        logging.shutdown()
        # Worker threads may sit in a gloo broadcast that will never complete; do not join them.
        os._exit(code)


if __name__ == "__main__":
    main()
