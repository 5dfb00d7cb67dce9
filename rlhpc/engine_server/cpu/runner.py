"""The CPU engine: a Hugging Face model behind SGLang's request semantics (generation, weights, memory).

Concurrency: one HTTP /generate request is one sampling batch, and batches run one at a time on
a single thread (see ``rlhpc.engine_server.cpu.app``), so with fixed ``sampling_seed``s a
request's tokens do not depend on other traffic. As in SGLang, seeds are used only by an engine
started ``deterministic`` (SGLang's ``--enable-deterministic-inference``); elsewhere every
request samples at random. Weight routes run on a second thread; a lock
keeps them off the model while a batch computes. A pause holds new batches (and, in modes
``in_place``/``retract``, the running one between decoding steps; ``abort``, SGLang's default,
ends it) until continued. Weights may change during such a pause: the batch goes on with them
(``retract``: its KV cache recomputed first), and each output reports which version made which
tokens (``meta_info["weight_versions"]``, SGLang's spans).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlhpc import moe_routing
from rlhpc.data.images import decode_uri, load_vision
from rlhpc.engine_server.cpu.fp8 import load_fp8_model
from rlhpc.engine_server.cpu.lora import Adapters
from rlhpc.engine_server.cpu.requests import (
    EngineError,
    Item,
    ModelLimits,
    check_tags,
    normalize_classify,
    normalize_generate,
)
from rlhpc.engine_server.cpu.sampling import RECOMPUTE, Multimodal, sample
from rlhpc.errors import RlhpcError
from rlhpc.model import is_classifier, load_classifier, load_model, load_tokenizer, mrope_positions, text_config
from rlhpc.weights.expert_names import checkpoint_named
from rlhpc.weights.fp8 import is_fp8_checkpoint
from rlhpc.weights.tensor_transport import (
    FlatBucket,
    TensorPayloadError,
    adjacent_bytes,
    copy_bytes,
    deserialize_flat_bucket,
    deserialize_named_tensors,
    deserialize_tensor_dict,
    flat_layout,
    flatten_parameters,
    unflatten,
)
from rlhpc.weights.update_group import init_custom_process_group
from rlhpc.wire import protocol as P
from rlhpc.wire.lora import TENSOR_LORA_PATH, LoraServing
from rlhpc.wire.protocol import MetaInfo

log = logging.getLogger("rlhpc.cpu_server")

SERVER_VERSION = "rlhpc-cpu-engine-0.1"
CLASSIFY_BATCH_TOKENS = 1 << 14  # tokens of one /classify forward (its inputs of one length ran at once)

# The seed of a request without one on a deterministic engine (SGLang's SamplingBatchInfo)
UNSEEDED_DETERMINISTIC_SEED = 42


class SchedulerDied(Exception):
    """What kills SGLang's scheduler process, and with it the whole server (it sends its HTTP
    process SIGQUIT, which kills the process tree): the CPU engine server exits on it too."""


def version_spans(steps: list[str], num_tokens: int, current: str) -> list[dict[str, Any]]:
    """SGLang's per-token ``weight_versions`` for a row of ``num_tokens`` output tokens, token k
    made at decoding step k with weights ``steps[k]``: one span per run of equal versions. A row
    without tokens gets one empty span of the ``current`` version (as SGLang reports it)."""
    version_key, start_key, end_key = P.WEIGHT_VERSION_SPAN_KEYS
    spans: list[dict[str, Any]] = []
    for k, version in enumerate(steps[:num_tokens]):
        if spans and spans[-1][version_key] == version:
            spans[-1][end_key] = k + 1
        else:
            spans.append({version_key: version, start_key: k, end_key: k + 1})
    return spans or [{version_key: current, start_key: 0, end_key: 0}]


class Engine:
    """One model behind SGLang's semantics: batches generate, weights update, memory is released and resumed."""

    def __init__(
        self,
        model_path: str,
        weight_version: str,
        device: str = "cpu",
        deterministic: bool = False,
        original_logprobs: bool = False,
        lora: LoraServing | None = None,
        routed_experts: bool = False,
    ):
        """``lora``: serve LoRA adapters (SGLang's --enable-lora and its settings). ``routed_experts``:
        SGLang's --enable-return-routed-experts (without it, a request's return_routed_experts is
        ignored, as SGLang ignores it)."""
        self.model_path = model_path
        self.deterministic = deterministic  # --enable-deterministic-inference: sampling_seed is honoured
        self.original_logprobs = original_logprobs  # SGLANG_RETURN_ORIGINAL_LOGPROB: logprobs before temperature
        self.routed_experts = routed_experts
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        # A *ForSequenceClassification model (a reward model) serves /classify, not /generate,
        # as SGLang serves it as an embedding model
        self.classifier = is_classifier(model_path)
        load = load_classifier if self.classifier else load_model
        if not self.classifier and is_fp8_checkpoint(model_path):  # rollout.quantization: fp8
            load = load_fp8_model
        self.model = load(model_path, self.device).eval().requires_grad_(False)
        if self.classifier and not isinstance(getattr(self.model, "score", None), torch.nn.Linear):
            raise EngineError(f"{model_path}: a classifier without a linear `score` head (as Llama's and Qwen2's)")
        flatten_parameters(self.model)  # so that flattened buckets land in place
        self.tokenizer = load_tokenizer(model_path)
        # a vision-language model's image processor: /generate takes image_data, as SGLang serves such a model
        self.vision = None if self.classifier else load_vision(model_path)
        cfg = text_config(self.model.config)
        self.vocab_size = int(cfg.vocab_size)
        self.context_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = self._eos_ids()
        self.limits = ModelLimits(self.vocab_size, self.context_len, frozenset(self.eos_ids))
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)  # padded rows are masked anyway
        self.weight_version = weight_version
        # LoRA adapters by name, applied per row (never merged into the weights a push updates)
        self.adapters = Adapters(self.model, lora if not self.classifier else None)

        self.model_lock = threading.Lock()  # held while a batch computes or weights change
        self.running = threading.Event()  # cleared while paused
        self.running.set()
        self.pause_mode = "abort"
        self.released: set[str] = set()
        self.stale: set[str] = set()  # parameters re-allocated but not re-sent since a resume
        self._shapes: dict[str, torch.Size] = {}  # of released parameters
        self._table: dict[str, torch.Tensor] | None = None  # see _param_table
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.group_devices: dict[str, torch.device] = {}  # where a group's broadcasts land
        self._scratch_buffers: dict[str, torch.Tensor] = {}  # per group: flattened buckets land here
        self._mapped: collections.deque = collections.deque(maxlen=2)  # see update_from_tensor
        self.busy = False
        self.last_progress = time.monotonic()  # a decoding step or a batch ended (what /health waits for)
        self.in_flight = 0  # generation requests past the pause, not yet answered (see flushable)
        self.receiving = False  # an update from distributed is under way (waiting for or in its broadcast)
        self.steps: list[str] = []  # of the batch running (or last run): its decoding steps' versions
        self.update_session: str | None = None  # selector of the open weight-update session
        self._updates = 0  # weight updates so far (one without a new version still changes weights)

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
        """GenerateReqInput -> rows (see ``requests.normalize_generate``)."""
        if self.classifier:
            raise EngineError(f"{self.model_path} is a classifier: it serves /classify, not /generate")
        return normalize_generate(body, self.limits, self.tokenizer.encode)

    def resolve_adapters(self, items: list[Item]) -> None:
        """Each row's LoRA adapter by its name, as SGLang resolves them: after the pause (a request
        held by one names the adapters loaded when it ends), refused before the batch is merged."""
        for it, adapter in zip(items, self.adapters.resolve([it.lora_path for it in items])):
            it.adapter = adapter

    def normalize_classify(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        """EmbeddingReqInput -> the token ids of each input (see ``requests.normalize_classify``)."""
        if not self.classifier:
            raise EngineError(f"{self.model_path} is not a *ForSequenceClassification model: /classify has no scores")
        return normalize_classify(body, self.limits, self.tokenizer.encode)

    @torch.no_grad()
    def classify(self, inputs: list[list[int]]) -> list[dict[str, Any]]:
        """Each input's scores (num_labels of them) at its last token, as SGLang's LAST pooling
        reads them; inputs of one length run as one batch (no padding, so nothing to mask)."""
        self.require_usable()
        by_length: dict[int, list[int]] = collections.defaultdict(list)
        for i, ids in enumerate(inputs):
            by_length[len(ids)].append(i)
        scores: list[list[float]] = [[] for _ in inputs]
        with self.model_lock:
            for length, same in by_length.items():
                step = max(1, CLASSIFY_BATCH_TOKENS // length)  # a forward's memory, whatever the batch
                for idx in (same[k : k + step] for k in range(0, len(same), step)):
                    ids = torch.tensor([inputs[i] for i in idx], device=self.device)
                    hidden = self.model.base_model(input_ids=ids).last_hidden_state[:, -1]
                    for i, row in zip(idx, self.model.score(hidden).float().tolist()):
                        scores[i] = row
            self.last_progress = time.monotonic()
        return [
            {P.EMBEDDING: s, "meta_info": {MetaInfo.ID: f"classify-{i}", MetaInfo.PROMPT_TOKENS: len(ids)}}
            for i, (s, ids) in enumerate(zip(scores, inputs))
        ]

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

    def _step_hook(self, seq: int, rids: list[str], steps: list[str]) -> bool | str:
        """Between decoding steps: abort, wait out a pause (off the model lock), check weights, and
        record in ``steps`` the weight version the next step samples with (step k makes every
        unfinished row's token k). After a ``retract`` pause in which the weights changed, answers
        ``RECOMPUTE``: the KV cache is rebuilt with the new weights, as SGLang re-prefills retracted
        requests; ``in_place`` keeps the cache computed with the old ones."""
        if self._aborted(seq, rids):
            return True
        recompute = False
        if not self.running.is_set():
            aborted = False
            before = self.weight_version, self._updates
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
            recompute = self.pause_mode == "retract" and (self.weight_version, self._updates) != before
        self.require_usable()
        steps.append(self.weight_version)
        self.last_progress = time.monotonic()
        return RECOMPUTE if recompute and len(steps) > 1 else False

    def generate(self, items: list[Item], seq: int) -> list[dict[str, Any]]:
        """Run one batch (called on the single generation thread): as SGLang's scheduler, rows of
        more adapters (the base model counts as one) than --max-loras-per-batch run in turn."""
        serving = self.adapters.serving
        names = list(dict.fromkeys(it.lora_path for it in items))
        if serving is None or len(names) <= serving.max_loras_per_batch:
            return self._generate(items, seq)
        outs: list[dict[str, Any]] = [{} for _ in items]
        for k in range(0, len(names), serving.max_loras_per_batch):
            part = set(names[k : k + serving.max_loras_per_batch])
            rows = [i for i, it in enumerate(items) if it.lora_path in part]
            for i, out in zip(rows, self._generate([items[i] for i in rows], seq)):
                outs[i] = out
        return outs

    def _generate(self, items: list[Item], seq: int) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        steps = self.steps = []  # the weight version of each decoding step (server_info shows the count)
        mm = self._multimodal(items)
        with self.model_lock:
            self.busy = True
            try:
                with self.adapters.applied([it.adapter for it in items]):
                    samples = self._sample(items, seq, steps, mm)
                inputs = [self._input_logprobs(it) if it.logprob_start_len >= 0 else None for it in items]
            finally:
                self.busy = False
                if steps:  # tokens were made (a batch aborted before its first step made none)
                    self.last_progress = time.monotonic()
            version = self.weight_version
        latency = time.perf_counter() - t0
        outs = [
            self._output(it, s, version_spans(steps, len(s.output_ids), version), latency)
            for it, s in zip(items, samples)
        ]
        for out, lps in zip(outs, inputs):
            if lps is not None:
                out["meta_info"][MetaInfo.INPUT_TOKEN_LOGPROBS] = lps
        return outs

    def _sample(self, items: list[Item], seq: int, steps: list[str], mm: Multimodal | None) -> list[Any]:
        if self.routed_experts and any(it.routed_experts_start is not None for it in items):
            with moe_routing.recorded(self.model) as routes:
                if not moe_routing.routers(self.model):
                    raise EngineError(f"return_routed_experts was sent, but {self.model_path} is not a MoE model")
                return self._sample_routed(items, seq, steps, mm, routes)
        return self._sample_routed(items, seq, steps, mm, None)

    def _sample_routed(
        self, items: list[Item], seq: int, steps: list[str], mm: Multimodal | None, routes: list | None
    ) -> list[Any]:
        rids = [it.rid for it in items]
        return sample(
            self.model,
            [it.prompt for it in items],
            [it.max_new_tokens for it in items],
            [it.temperature for it in items],
            [it.top_p for it in items],
            [self._seed(it) for it in items],
            eos_id=min(self.eos_ids, default=-1),  # unused: stop_ids decides per row
            pad_id=self.pad_id,
            stop_ids=[it.stop_ids for it in items],
            stop_fns=[self._stop_matcher(it.stop_strs) for it in items],
            top_logprobs=[it.top_logprobs_num for it in items],
            top_k=[it.top_k for it in items],
            min_p=[it.min_p for it in items],
            repetition_penalty=[it.repetition_penalty for it in items],
            step_hook=lambda: self._step_hook(seq, rids, steps),
            mm=mm,
            original_logprobs=self.original_logprobs,
            routes=routes,
        )

    def _multimodal(self, items: list[Item]) -> Multimodal | None:
        """The images of a batch's rows (each distinct one processed once: a prompt's n samples
        share them) as the model's prompt inputs, each row's image tokens checked against them."""
        if not any(it.images for it in items):
            return None
        if self.vision is None:
            raise EngineError(f"image_data was sent, but {self.model_path} is not a vision-language model")
        vision = self.vision
        pixels: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for it in items:
            for k, item in enumerate(it.images):
                if item not in pixels:
                    try:
                        pixels[item] = vision.pixels([decode_uri(item, f"image_data[{k}] of request {it.rid}")])
                    except RlhpcError as e:
                        raise EngineError(str(e)) from e
                    except Exception as e:  # PIL's: not an image
                        raise EngineError(f"image_data[{k}] of request {it.rid} is not an image: {e}") from e
            made = sum(int(pixels[i][1].prod()) // vision.merge**2 for i in it.images)
            have = it.prompt.count(vision.image_token_id)
            if made != have:
                raise EngineError(
                    f"request {it.rid}: its {len(it.images)} image(s) make {made} image tokens but its prompt "
                    f"holds {have}: render the prompt with the model's processor (one pad per image token)"
                )
        rows = [pixels[i] for it in items for i in it.images]
        grid = torch.cat([g for _, g in rows]).to(self.device)
        return Multimodal(
            torch.cat([p for p, _ in rows]).to(self.device),
            grid,
            lambda ids, attention: mrope_positions(self.model, ids, attention, grid),
        )

    def _seed(self, it: Item) -> int | None:
        """The seed a row samples with: its own on a deterministic engine (42 without one, as
        SGLang's), None (at random) on any other, whatever it asked for."""
        if not self.deterministic:
            return None
        return UNSEEDED_DETERMINISTIC_SEED if it.seed is None else it.seed

    @torch.no_grad()
    def _input_logprobs(self, it: Item) -> list[list[Any]]:
        """The prompt tokens' logprobs from ``logprob_start_len`` on, as SGLang answers them: each
        token's under the (temperature 1) softmax of the position before it, ``[logprob, id,
        None]``, the first entry's logprob None (SGLang shifts its values by one and pads with
        None, whatever the start). One forward of the prompt of its own: no padding to mask."""
        ids = torch.tensor([it.prompt], device=self.device)
        mm = self._multimodal([it])
        extra = {} if mm is None else {**mm.prompt_inputs(), "position_ids": mm.positions(ids, torch.ones_like(ids))}
        with self.adapters.applied([it.adapter]):
            logits = self.model(input_ids=ids, **extra).logits[0].float()
        targets = ids[0, it.logprob_start_len + 1 :]
        lps = torch.log_softmax(logits[it.logprob_start_len : -1], -1).gather(-1, targets[:, None])[:, 0]
        first = [[None, it.prompt[it.logprob_start_len], None]]
        return first + [[lp, tok, None] for lp, tok in zip(lps.tolist(), targets.tolist())]

    def _stop_matcher(self, stops: list[str]) -> Callable[[list[int]], str | None] | None:
        """Row output ids -> the stop string their text now contains, or None. As SGLang, only the
        tail is decoded: the longest stop string's token count plus one (a string may start inside
        a token), so a step costs the same however long the output grows."""
        if not stops:
            return None
        tail = 1 + max(len(self.tokenizer.encode(s, add_special_tokens=False)) for s in stops)

        def matched(ids: list[int]) -> str | None:
            text = self.tokenizer.decode(ids[-tail:])
            return next((s for s in stops if s in text), None)

        return matched

    def _text(self, it: Item, s: Any) -> str:
        """The output text as SGLang's detokenizer trims it; the token ids are never trimmed (RL
        trains on exactly what was sampled). A stop token is cut from the text unless
        ``no_stop_trim``; a stop string is cut with everything after it, or (``no_stop_trim``)
        kept, with only what follows it in its last token cut."""
        if s.finish_reason == "stop" and isinstance(s.matched, int) and not it.no_stop_trim:
            return self.tokenizer.decode(s.output_ids[:-1], skip_special_tokens=it.skip_special_tokens)
        text = self.tokenizer.decode(s.output_ids, skip_special_tokens=it.skip_special_tokens)
        if s.finish_reason == "stop" and isinstance(s.matched, str):
            pos = text.find(s.matched)
            if pos != -1:
                return text[: pos + len(s.matched)] if it.no_stop_trim else text[:pos]
        return text

    def _output(self, it: Item, s: Any, spans: list[dict[str, Any]], latency: float) -> dict[str, Any]:
        if s.finish_reason == "stop":
            # "matched": the stop token id, or the stop string (SGLang's FINISH_MATCHED_TOKEN/_STR)
            finish: dict[str, Any] = {"type": "stop", "matched": s.matched}
        elif s.finish_reason == "length":
            finish = {"type": "length", "length": it.max_new_tokens}
        else:
            finish = {"type": "abort", "message": "Abort in waiting queue" if not s.output_ids else "Aborted"}
        meta: dict[str, Any] = {
            MetaInfo.ID: it.rid,
            MetaInfo.FINISH_REASON: finish,
            MetaInfo.PROMPT_TOKENS: len(it.prompt),
            MetaInfo.WEIGHT_VERSION: spans[-1][P.WEIGHT_VERSION_SPAN_KEYS[0]],
            MetaInfo.WEIGHT_VERSIONS: spans,
            MetaInfo.COMPLETION_TOKENS: len(s.output_ids),
            MetaInfo.CACHED_TOKENS: 0,
            MetaInfo.E2E_LATENCY: latency,
        }
        if it.return_logprob:
            meta[MetaInfo.OUTPUT_TOKEN_LOGPROBS] = [[lp, tok, None] for lp, tok in zip(s.output_logprobs, s.output_ids)]
        if it.routed_experts_start is not None and s.routed_experts is not None:
            meta[MetaInfo.ROUTED_EXPERTS] = P.encode_routed_experts(s.routed_experts[it.routed_experts_start :].numpy())
        if it.top_logprobs_num:
            meta[MetaInfo.OUTPUT_TOP_LOGPROBS] = [
                [[lp, tok, None] for lp, tok in step] for step in s.output_top_logprobs
            ]
        return {
            "text": self._text(it, s),
            "output_ids": s.output_ids,
            "meta_info": meta,
        }

    # -------------------------------------------------------------- weights

    def _param_table(self) -> dict[str, torch.Tensor]:
        """The weights by the names a push sends (SGLang's): a fused expert parameter as views of
        its experts (``expert_names``), so a push in HF's in-memory names is refused as SGLang's
        loader would drop it. With duplicates: a tied lm_head is addressable by either name.
        Kept until the parameters move (``release``, ``resume``)."""
        if self._table is None:
            named = ((n, p.detach()) for n, p in self.model.named_parameters(remove_duplicate=False))
            self._table = dict(checkpoint_named(named))
        return self._table

    def load_weights(self, received: list[tuple[str, torch.Tensor]] | FlatBucket) -> None:
        """Validate every tensor first, then copy all: an update applies fully or not at all.
        Values are not checked (NaN would be loaded, as SGLang loads them): the trainer checks
        what it sends, where the bytes are (``rlhpc.weights.base.SenderBase._checked``)."""
        table = self._param_table()
        if isinstance(received, FlatBucket):
            names, metas = received.names, zip(received.names, received.shapes, received.dtypes)
        else:
            names, metas = [n for n, _ in received], ((n, t.shape, t.dtype) for n, t in received)
        problems = []
        for name, shape, dtype in metas:
            p = table.get(name)
            if p is None:
                problems.append(f"unknown parameter {name!r}")
            elif tuple(shape) != tuple(p.shape):
                problems.append(f"{name}: shape {tuple(shape)} != engine's {tuple(p.shape)}")
            elif dtype.is_floating_point != p.dtype.is_floating_point or dtype.is_complex:
                problems.append(f"{name}: dtype {dtype} for the engine's {p.dtype}")  # int64 weights are a bug
        if problems:
            raise EngineError(f"{len(problems)} bad tensor(s): " + "; ".join(problems[:5]))
        with self.model_lock:
            if "weights" in self.released:
                raise EngineError("weights are released; resume_memory_occupation(['weights']) before updating")
            with torch.no_grad():
                # a flat bucket into flat parameters of the same layout: one copy, not one per tensor
                dst = adjacent_bytes([table[name].data for name in names])
                if isinstance(received, FlatBucket):
                    src = received.back_to_back() if dst is not None else None
                    same = src is not None and all(d == table[n].dtype for n, d in zip(names, received.dtypes))
                    named = [] if same else received.tensors()
                else:
                    src = adjacent_bytes([t for _, t in received]) if dst is not None else None
                    same = src is not None and all(t.dtype == table[n].dtype for n, t in received)
                    named = received
                if same:
                    copy_bytes(dst, src)
                else:
                    for name, t in named:
                        table[name].copy_(t)  # casts if the trainer's dtype differs
            if self.device.type == "cuda":
                # copy_ is asynchronous on CUDA; the sender frees (or reuses) its IPC/broadcast
                # memory as soon as we answer, so the copies must be done first.
                torch.cuda.synchronize(self.device)
            self.stale.difference_update(names)
            self._updates += 1
        log.info("loaded %d tensor(s)", len(names))

    def flushable(self) -> bool:
        """Would SGLang's cache flush go through now? Its scheduler flushes only when fully idle
        (``Scheduler.flush_cache``: no running batch, no queued request), and a pause in mode
        ``retract`` or ``in_place`` makes it ignore the queue (``ignore_waiting``): ``retract``
        moved the running requests there, ``in_place`` kept them running. ``in_flight``: requests
        past the pause and not yet answered (``rlhpc.engine_server.cpu.app.Workers``)."""
        if self.running.is_set() or self.pause_mode == "abort":
            return self.in_flight == 0
        return self.pause_mode == "retract" or not self.busy

    def _finish_update(self, flush_cache: bool, version: str | None) -> str:
        """After an update's weights are in: SGLang's cache flush (the last bucket asks for it),
        which fails the update, weights loaded but no new version recorded, unless the engine is
        idle (``flushable``); then the version. Returns the success message's version note."""
        if flush_cache and not self.flushable():
            raise EngineError(P.FLUSH_BUSY)
        if version is None:
            return ""
        self.weight_version = version
        log.info("weight_version %s", version)
        return P.weight_version_note(version)

    def set_weight_version(self, version: str) -> None:
        """SGLang's /update_weight_version: the version alone (after a busy flush, see ``_finish_update``)."""
        self.weight_version = version
        log.info("weight_version %s (set alone)", version)

    def init_group(self, req: P.InitWeightsUpdateGroupReqInput) -> str:
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
        self._scratch_buffers.pop(group_name, None)
        if pg is None:
            raise EngineError(f"no weight update group {group_name!r}")
        dist.destroy_process_group(pg)
        return f"destroyed {group_name}"

    # SGLang's weight-update session: both updates are refused outside begin/end, with its messages.

    def begin_weight_update(self, req: P.BeginWeightUpdateReqInput) -> str:
        if req.selector not in P.WEIGHT_UPDATE_SELECTORS:
            raise EngineError(f"unknown selector {req.selector!r}; one of {P.WEIGHT_UPDATE_SELECTORS}")
        if self.update_session is not None:
            raise EngineError(P.SESSION_ALREADY_OPEN)
        self.update_session = req.selector  # no draft model here: every selector opens the one model
        return "Success"

    def end_weight_update(self) -> str:
        if self.update_session is None:
            raise EngineError(P.NO_SESSION_OPEN)
        self.update_session = None
        return "Success"

    def _require_session(self, route: str) -> None:
        if self.update_session is None:
            raise EngineError(P.outside_session_message(route))

    def update_from_distributed(self, req: P.UpdateWeightsFromDistributedReqInput) -> str:
        self.receiving = True
        try:
            return self._update_from_distributed(req)
        finally:
            self.receiving = False

    def _update_from_distributed(self, req: P.UpdateWeightsFromDistributedReqInput) -> str:
        self._require_session(P.Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED)
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise EngineError("names, dtypes and shapes differ in length")
        if req.load_format not in (None, P.FLATTENED_BUCKET):
            raise EngineError(f"load_format {req.load_format!r} is not supported by the CPU engine")
        pg = self.groups.get(req.group_name)
        if pg is None:
            raise EngineError(f"no weight update group {req.group_name!r}; call init_weights_update_group first")
        try:
            dtypes = [getattr(torch, d) for d in req.dtypes]
            if not all(isinstance(d, torch.dtype) for d in dtypes):
                raise AttributeError(req.dtypes)
            spans = flat_layout(dtypes, req.shapes) if req.load_format == P.FLATTENED_BUCKET else None
        except (AttributeError, TensorPayloadError) as e:  # refused before any broadcast: SGLang does too
            raise EngineError(f"bad tensor metadata: {e}") from e
        device = self.group_devices[req.group_name]
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if spans is not None and self._receive_in_place(req, dtypes, pg, device):
            return f"updated {len(req.names)} tensor(s) in place.{self._finish_update(req.flush_cache, req.weight_version)}"
        received = []
        # Receive every tensor even if some will be refused: skipping one would desynchronise
        # the broadcast sequence for the trainer and every other engine in the group.
        if spans is not None:
            flat = self._scratch(req.group_name, spans[-1][1], device)
            dist.broadcast(flat, group_src=0, group=pg)
            received = list(zip(req.names, unflatten(flat, dtypes, req.shapes)))
        else:
            for name, dtype, shape in zip(req.names, dtypes, req.shapes):
                buf = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(buf, group_src=0, group=pg)
                received.append((name, buf))
        self.load_weights(received)
        return f"updated {len(received)} tensor(s).{self._finish_update(req.flush_cache, req.weight_version)}"

    def _scratch(self, group_name: str, size: int, device: torch.device) -> torch.Tensor:
        """A receive buffer kept per group: one bucket of memory, faulted in once, not per update."""
        buf = self._scratch_buffers.get(group_name)
        if buf is None or buf.numel() < size or buf.device != device:
            buf = self._scratch_buffers[group_name] = torch.empty(size, dtype=torch.uint8, device=device)
        return buf[:size]

    def _receive_in_place(
        self, req: P.UpdateWeightsFromDistributedReqInput, dtypes: list[torch.dtype], pg: Any, device: torch.device
    ) -> bool:
        """Broadcast a flattened bucket straight into the parameters when they lie back to back in
        the same order, dtypes and device (see ``flatten_parameters``): no copy at all. False
        (nothing received) when they do not, or the update would be refused."""
        table = self._param_table()
        params = [table.get(name) for name in req.names]
        if any(
            p is None or p.dtype != dtype or tuple(p.shape) != tuple(shape) or p.device != device
            for p, dtype, shape in zip(params, dtypes, req.shapes)
        ):
            return False
        with self.model_lock:
            if "weights" in self.released:
                return False
            flat = adjacent_bytes([p.data for p in params])
            if flat is None:
                return False
            # Written in place: a broadcast that breaks half way leaves this bucket partly new,
            # as any failed push leaves the engine (paused, to be restarted).
            dist.broadcast(flat, group_src=0, group=pg)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.stale.difference_update(req.names)
            self._updates += 1
        log.info("received %d tensor(s) in place", len(req.names))
        return True

    def update_from_tensor(self, req: P.UpdateWeightsFromTensorReqInput) -> str:
        self._require_session(P.Route.UPDATE_WEIGHTS_FROM_TENSOR)
        if req.load_format not in (None, "direct", "default", P.FLATTENED_BUCKET):
            raise EngineError(f"load_format {req.load_format!r} is not supported by the CPU engine")
        if not req.serialized_named_tensors:
            raise EngineError("serialized_named_tensors is empty")
        # one payload per TP rank, each rank reads its own (SGLang's TpWorker.deserialize_own_rank):
        # this engine is TP rank 0 of 1. CUDA IPC handles only open on a GPU engine
        read = deserialize_flat_bucket if req.load_format == P.FLATTENED_BUCKET else deserialize_named_tensors
        try:
            named = read(req.serialized_named_tensors[0], allow_cuda=self.device.type == "cuda")
        except TensorPayloadError as e:
            raise EngineError(str(e)) from e
        self.load_weights(named)
        # Hold on to the shared-memory segments of the last two requests: a sender's kept staging
        # buffer then maps from torch's cache next time, without a new mmap and a page fault per
        # 4 KiB; a sender's one-off segments are freed two requests later. (Not CUDA: an open IPC
        # handle would keep the sender's memory.)
        flats = [named.flat] if isinstance(named, FlatBucket) else [t for _, t in named]
        self._mapped.append({t.untyped_storage().data_ptr(): t.untyped_storage() for t in flats if not t.is_cuda})
        count = len(named.names) if isinstance(named, FlatBucket) else len(named)
        return f"updated {count} tensor(s).{self._finish_update(req.flush_cache, req.weight_version)}"

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

    # -------------------------------------------------------------- LoRA adapters

    def load_lora_adapter(self, req: P.LoadLoRAAdapterReqInput) -> dict[str, str]:
        return self.adapters.load_path(req.lora_name, req.lora_path)

    def load_lora_adapter_from_tensors(self, req: P.LoadLoRAAdapterFromTensorsReqInput) -> dict[str, str]:
        """As a weight push's tensors: one payload per TP rank (this engine reads rank 0's), read by
        the same unpickler; {name: tensor}, or a flattened bucket."""
        self.adapters.require_enabled()  # before the payload is read, as SGLang's tokenizer manager refuses
        if req.load_format not in (None, P.FLATTENED_BUCKET):
            raise EngineError(f"load_format {req.load_format!r} is not supported by the CPU engine")
        if not req.serialized_named_tensors:
            raise EngineError("serialized_named_tensors is empty")
        allow_cuda = self.device.type == "cuda"
        try:
            if req.load_format == P.FLATTENED_BUCKET:
                tensors = dict(deserialize_flat_bucket(req.serialized_named_tensors[0], allow_cuda).tensors())
            else:
                tensors = deserialize_tensor_dict(req.serialized_named_tensors[0], allow_cuda)
        except TensorPayloadError as e:
            raise EngineError(str(e)) from e
        return self.adapters.load(req.lora_name, req.config_dict, tensors, TENSOR_LORA_PATH)

    def unload_lora_adapter(self, req: P.UnloadLoRAAdapterReqInput) -> dict[str, str]:
        return self.adapters.unload(req.lora_name)

    # -------------------------------------------------------------- memory

    def release(self, tags: list[str] | None) -> None:
        """SGLang's release_memory_occupation: only on an idle engine (a paused one may hold
        waiting requests), and each tag once: SGLang's scheduler asserts the first, and
        torch_memory_saver exits the process when asked to pause memory already paused."""
        tags = check_tags(tags)
        again = sorted(self.released.intersection(tags))
        if again:
            raise SchedulerDied(f"torch_memory_saver: Cannot pause allocation that is not active (tags {again})")
        with self.model_lock:  # a batch computing ends first (or, paused in place, waits off the lock)
            # a batch that holds a cache (it ran a step) is SGLang's running batch; one held by a
            # pause before its first step is a waiting request, which SGLang lets a paused engine keep
            if self.busy and self.steps:
                raise SchedulerDied(
                    "AssertionError: release_memory_occupation should be called only when server is idle."
                )
            if "weights" in tags:
                # Swap each parameter's storage for an empty one (the Parameter objects, and so
                # tied weights, stay). Buffers such as rotary tables stay too: nobody re-sends them.
                for name, p in self.model.named_parameters():
                    self._shapes[name] = p.shape
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                self._table = None
                self._mapped.clear()  # shared-memory segments held for the next colocated push
                self._scratch_buffers.clear()  # receive buffers: one bucket each
            # kv_cache, cuda_graph: sample() builds its cache per batch and frees it after, and
            # there are no graphs, so nothing is resident; the tags are recorded to refuse
            # generation, and to hold resume to SGLang's rule.
            self.released.update(tags)
            if self.device.type == "cuda":
                # freed blocks stay reserved by torch's caching allocator; hand them back to the
                # driver so a colocated trainer can use the memory
                torch.cuda.empty_cache()
        log.info("released %s (weights bytes now %d)", tags, self.weights_bytes())

    def resume(self, tags: list[str] | None) -> None:
        """SGLang's resume_memory_occupation: each tag is removed from the released ones
        (``set.remove``), so a tag that is not released is a KeyError, which kills SGLang's
        scheduler and with it the server."""
        tags = check_tags(tags)
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise SchedulerDied(f"KeyError: {missing[0]!r} (resume_memory_occupation of memory that is not released)")
        with self.model_lock:
            if "weights" in tags:
                flatten_parameters(self.model, self._shapes)
                self._table = None
                # by the names a push re-sends them under; a tied weight once, as named_parameters has it
                named = ((n, p.detach()) for n, p in self.model.named_parameters())
                self.stale.update(n for n, _ in checkpoint_named(named))
                self._shapes.clear()
            self.released.difference_update(tags)
        log.info("resumed %s; %d parameter(s) await new weights", tags, len(self.stale))

    def weights_bytes(self) -> int:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.model.parameters()}
        return sum(storages.values())

    # -------------------------------------------------------------- info

    def model_info(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": not self.classifier,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": self.vision is not None,
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
                    "decode_steps": len(self.steps),  # of the running (or last) batch
                    "requests_in_flight": self.in_flight,
                    "running_batch": self.busy,
                    "released_tags": sorted(self.released),
                    "weights_bytes": self.weights_bytes(),
                    "weight_update_groups": sorted(self.groups),
                    "weight_update_session": self.update_session is not None,
                    "receiving_weights": self.receiving,
                    **(
                        {"cuda_memory_reserved_bytes": torch.cuda.memory_reserved(self.device)}
                        if self.device.type == "cuda"
                        else {}
                    ),
                }
            ],
        }
