"""Batched autoregressive sampling with a KV cache and one RNG per sample.

One ``torch.Generator`` per sample (seeded by SGLang's ``sampling_seed``) makes a sample's
tokens independent of which other requests share its batch, so reruns are reproducible; the
draw itself is one vectorised step over the batch.

The distribution is shaped as SGLang 0.5's is (its penalizers, then its sampler): repetition
penalty on the logits of tokens the row has already generated, temperature, then top-k (and
the rest renormalised), top-p, and min-p relative to the most likely token. A shaping at its
no-op value is skipped, so the default path is the same computation as before these existed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from rlhpc.wire.protocol import TOP_K_ALL

RECOMPUTE = "recompute"  # a step hook's answer: the weights changed, rebuild the KV cache with them


@dataclass
class Multimodal:
    """A vision-language batch's prompt inputs: its images' pixels, given to every forward that
    runs the prompt (the first, and a recompute), and its 3-D rotary positions ``(ids, attention)
    -> [3, N, L]`` (Qwen-VL's mrope; each generated token then advances all three by one)."""

    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    positions: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def prompt_inputs(self) -> dict[str, torch.Tensor]:
        if self.pixel_values is None:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


@dataclass
class Sample:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" (eos, a stop token or a stop string) | "length" | "abort"
    matched: int | str | None = None  # what stopped it: the stop token (the last output id) or stop string
    # per output token, when asked: its top-k [(logprob, token id), ...], most likely first
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # with ``routes``: [prompt + output tokens - 1, layers, top-k] the experts each fed token went to
    routed_experts: torch.Tensor | None = None


def _top_k_filter(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Each row's ``top_k`` most likely tokens (ties by token order), renormalised: SGLang's
    default (flashinfer) sampler renormalises after top-k, so top-p then sees the kept mass."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs * (rank < top_k[:, None]))
    return kept / kept.sum(dim=-1, keepdim=True)


def _min_p_filter(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens less likely than ``min_p`` times the row's most likely one."""
    return probs * (probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values)


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """SGLang's repetition penalty: a token already generated (``seen``) has its logit divided by
    the row's ``penalty`` when positive and multiplied when negative (> 1 makes it less likely)."""
    scaled = torch.where(logits < 0, logits * penalty[:, None], logits / penalty[:, None])
    return torch.where(seen, scaled, logits)


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p[:, None]
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    temperature: list[float],
    top_p: list[float],
    seeds: list[int | None],
    eos_id: int,
    pad_id: int,
    *,
    stop_ids: list[Collection[int]] | None = None,
    stop_fns: list[Callable[[list[int]], str | None] | None] | None = None,
    top_logprobs: list[int] | None = None,
    step_hook: Callable[[], bool | str] | None = None,
    top_k: list[int] | None = None,
    min_p: list[float] | None = None,
    repetition_penalty: list[float] | None = None,
    mm: Multimodal | None = None,
    original_logprobs: bool = False,
    routes: list[torch.Tensor] | None = None,
) -> list[Sample]:
    """Generate for a batch of prompts. Temperature 0 means greedy.

    Logprobs are SGLang's: of the sampled token under the softmax of the logits (after the
    repetition penalty, which SGLang applies to the logits before its sampler) divided by the
    row's temperature (1 for a greedy row, which SGLang samples at temperature 1 with top-k 1),
    or, with ``original_logprobs`` (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB``), not divided.
    Top-k, top-p and min-p never change them: SGLang takes them before its filters.

    ``stop_ids[i]``, when given, replaces ``{eos_id}`` as row i's set of stopping tokens (SGLang's
    ``stop_token_ids`` / ``ignore_eos``). ``stop_fns[i]``, when given, sees row i's output ids after
    each new token and returns the stop string they now contain (the row ends, "stop") or None;
    it is asked before the stop tokens, as SGLang checks strings first. ``top_logprobs[i]`` > 0
    records that many most likely tokens per step for row i (of the same logprobs). ``top_k`` (-1 or
    ``TOP_K_ALL``: off), ``min_p`` and ``repetition_penalty`` shape row i's distribution as SGLang's
    sampling params of those names. ``step_hook`` runs before every forward pass; it may
    block (an engine pausing mid-batch) and returning True ends all unfinished rows as "abort";
    returning ``RECOMPUTE`` drops the KV cache and runs the next step over every token so far (the
    prompts and the tokens sampled up to now), so the cache holds the weights loaded meanwhile.
    ``routes``: the list ``rlhpc.moe_routing.recorded`` fills for this model; each sample then
    gets the experts of every token this batch's forwards ran (SGLang's routed experts: the
    prompt's and the output's but the last, which no forward ran; a recompute's replace the
    earlier ones, as SGLang's retract does).
    """
    device = next(model.parameters()).device
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    # left padding keeps every row's last token aligned
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
    steps_max = max(max_new_tokens, default=0)
    uniforms = _row_uniforms(seeds, steps_max).to(device)
    temps = torch.tensor(temperature, dtype=torch.float32, device=device)
    greedy = temps <= 0
    # what the logprobs are divided by: None when by nothing (original logprobs, or no row samples
    # away from temperature 1); a greedy row's is 1 (SGLang samples it at temperature 1, top-k 1)
    lp_temps = None if original_logprobs else torch.where(greedy, torch.ones_like(temps), temps)
    if lp_temps is not None and bool((lp_temps == 1).all()):
        lp_temps = None
    tops = torch.tensor(top_p, dtype=torch.float32, device=device)
    # each shaping only when some row asks for it: the default path stays as it was
    ks = [TOP_K_ALL if k is None or k <= 0 else k for k in top_k] if top_k is not None else []
    ks_t = torch.tensor(ks, dtype=torch.long, device=device) if any(k < TOP_K_ALL for k in ks) else None
    min_ps = torch.tensor(min_p, dtype=torch.float64, device=device) if min_p and any(min_p) else None
    pens = repetition_penalty if repetition_penalty and any(p != 1 for p in repetition_penalty) else None
    pens_t = torch.tensor(pens, dtype=torch.float32, device=device) if pens is not None else None
    seen: torch.Tensor | None = None  # [batch, vocab]: tokens each row generated (repetition penalty)

    stops = [set(s) for s in stop_ids] if stop_ids is not None else [{eos_id}] * batch
    rows = _Rows(list(max_new_tokens), stops, stop_fns, list(top_logprobs) if top_logprobs is not None else [0] * batch)
    k_max = max(rows.tops_k, default=0)
    position_ids = mm.positions(input_ids, attn) if mm is not None else (attn.cumsum(-1) - 1).clamp(min=0)
    # transformers >= 5 names the KV cache argument ``cache``; older releases ``past_key_values``.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    past = None
    step_ids, step_pos = input_ids, position_ids
    fed_ids, fed_pos = input_ids[:, :0], position_ids[..., :0]  # what the cache holds (positions: [N, L] or [3, N, L])
    fed_routes: torch.Tensor | None = None  # with routes: [N, fed tokens, layers, top-k]
    for step in range(steps_max):
        verdict = step_hook() if step_hook is not None else False
        if verdict is True:
            rows.abort()
            break
        if verdict == RECOMPUTE:
            step_ids, step_pos = torch.cat([fed_ids, step_ids], 1), torch.cat([fed_pos, step_pos], -1)
            fed_ids, fed_pos, past = fed_ids[:, :0], fed_pos[..., :0], None
            fed_routes = None
        images = mm.prompt_inputs() if mm is not None and not fed_ids.shape[1] else {}  # this step runs the prompt
        fed_ids, fed_pos = torch.cat([fed_ids, step_ids], 1), torch.cat([fed_pos, step_pos], -1)
        out = model(
            input_ids=step_ids, attention_mask=attn, position_ids=step_pos, use_cache=True, **{cache_kw: past}, **images
        )
        past = out[cache_kw]
        if routes is not None:
            last = routes.pop()  # this forward's (only the newest is kept)
            step_routes = last.reshape(batch, step_ids.shape[1], *last.shape[1:])
            fed_routes = step_routes if fed_routes is None else torch.cat([fed_routes, step_routes], 1)
        logits = out.logits[:, -1, :].float()
        shaped = logits
        if pens_t is not None:
            if seen is None:
                seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)
            shaped = penalize_repeats(logits, seen, pens_t)
        next_ids = _draw(shaped, temps, tops, greedy, uniforms[:, step], ks_t, min_ps)
        if seen is not None:
            seen[torch.arange(batch, device=device), next_ids] = True
        log_probs = torch.log_softmax(shaped if lp_temps is None else shaped / lp_temps[:, None], dim=-1)
        chosen_lps = log_probs.gather(1, next_ids[:, None])[:, 0]
        rows.record(next_ids.tolist(), chosen_lps.tolist(), _top(log_probs, k_max))
        if all(rows.done):
            break
        running = torch.tensor([not d for d in rows.done], device=device)
        next_ids = torch.where(running, next_ids, torch.full_like(next_ids, pad_id))
        attn = torch.cat([attn, running.long()[:, None]], dim=1)
        step_ids = next_ids[:, None]
        step_pos = step_pos[..., -1:] + 1
    samples = rows.samples()
    if fed_routes is not None:
        real = attn[:, : fed_routes.shape[1]].bool().cpu()  # left pads and finished rows' pads ran too
        for i, s in enumerate(samples):
            s.routed_experts = fed_routes[i][real[i]][: len(prompts[i]) + len(s.output_ids) - 1].cpu()
    return samples


def _row_uniforms(seeds: list[int | None], steps: int) -> torch.Tensor:
    """Each row's uniforms for all its steps, from its own generator, drawn up front: the per-step
    draw is then one vectorised inverse-CDF over the batch, and a row's tokens still depend only
    on its seed, never on its batch-mates. (A row without a seed gets a random one.)"""
    uniforms = torch.empty((len(seeds), steps), dtype=torch.float64)
    for i, s in enumerate(seeds):
        g = torch.Generator()
        g.manual_seed(s if s is not None else int(torch.randint(0, 2**62, ()).item()))
        torch.rand(steps, generator=g, dtype=torch.float64, out=uniforms[i])
    return uniforms


class _Rows:
    """Each row's tokens so far and why it ended: the per-token bookkeeping of ``sample``."""

    def __init__(
        self,
        limits: list[int],
        stops: list[set[int]],
        stop_fns: list[Callable[[list[int]], str | None] | None] | None,
        tops_k: list[int],
    ):
        batch = len(limits)
        self.limits, self.stops, self.stop_fns, self.tops_k = limits, stops, stop_fns, tops_k
        self.outs: list[list[int]] = [[] for _ in range(batch)]
        self.lps: list[list[float]] = [[] for _ in range(batch)]
        self.done = [n <= 0 for n in limits]  # max_new_tokens=0 rows produce nothing, even beside longer rows
        self.finish = ["length"] * batch
        self.matched: list[int | str | None] = [None] * batch
        self.top_lps: list[list[list[tuple[float, int]]]] = [[] for _ in range(batch)]

    def record(self, tokens: list[int], logprobs: list[float], best: list[list[tuple[float, int]]]) -> None:
        """One step's tokens for the rows still running; a row ends on a stop string (asked
        first, as SGLang does), a stop token, or its length limit."""
        for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
            if self.done[i]:
                continue
            self.outs[i].append(tok)
            self.lps[i].append(lp)
            if self.tops_k[i] > 0:
                self.top_lps[i].append(best[i][: self.tops_k[i]])
            stop_fn = self.stop_fns[i] if self.stop_fns is not None else None
            hit = stop_fn(self.outs[i]) if stop_fn is not None else None
            if hit is not None:
                self.done[i], self.finish[i], self.matched[i] = True, "stop", hit
            elif tok in self.stops[i]:
                self.done[i], self.finish[i], self.matched[i] = True, "stop", tok
            elif len(self.outs[i]) >= self.limits[i]:
                self.done[i] = True

    def abort(self) -> None:
        self.finish = [f if self.done[i] else "abort" for i, f in enumerate(self.finish)]

    def samples(self) -> list[Sample]:
        return [
            Sample(self.outs[i], self.lps[i], self.finish[i], self.matched[i], self.top_lps[i])
            for i in range(len(self.outs))
        ]


def _top(log_probs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """Each row's ``k`` most likely tokens as [(logprob, token id), ...] (nothing when k is 0)."""
    if k <= 0:
        return [[] for _ in range(log_probs.shape[0])]
    values, ids = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
    return [list(zip(v, t)) for v, t in zip(values.tolist(), ids.tolist())]


def _draw(
    logits: torch.Tensor,
    temps: torch.Tensor,
    tops: torch.Tensor,
    greedy: torch.Tensor,
    u: torch.Tensor,
    top_k: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's next token: its argmax when greedy, else the inverse CDF of its temperature-,
    top-k-, top-p- and min-p-shaped distribution at its uniform ``u`` (float64, so no filtered-out
    token is ever hit)."""
    probs = torch.softmax(logits / temps.clamp(min=1e-5)[:, None], dim=-1)
    if top_k is not None:
        probs = _top_k_filter(probs, top_k)
    probs = _top_p_filter(probs, tops).double()
    if min_p is not None:
        probs = _min_p_filter(probs, min_p)
    cdf = probs.cumsum(dim=-1)
    # the first token whose CDF exceeds u * total; a token of probability 0 owns an empty interval
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    last_kept = (probs > 0).long().cumsum(-1).argmax(-1)  # guards u * total rounding up to total
    drawn = torch.minimum(drawn, last_kept)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)
