"""Batched autoregressive sampling with a KV cache and one RNG per sample.

One ``torch.Generator`` per sample (seeded by SGLang's ``sampling_seed``) makes a sample's
tokens independent of which other requests share its batch, so reruns are reproducible.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

RECOMPUTE = "recompute"  # a step hook's answer: the weights changed, rebuild the KV cache with them


@dataclass
class Sample:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" (eos or a stop token: the last output id) | "length" | "abort"


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
    step_hook: Callable[[], bool | str] | None = None,
) -> list[Sample]:
    """Generate for a batch of prompts. Temperature 0 means greedy.

    Logprobs are those of the sampled token under the unmodified (temperature 1) softmax, as
    SGLang reports them by default.

    ``stop_ids[i]``, when given, replaces ``{eos_id}`` as row i's set of stopping tokens (SGLang's
    ``stop_token_ids`` / ``ignore_eos``). ``step_hook`` runs before every forward pass; it may
    block (an engine pausing mid-batch) and returning True ends all unfinished rows as "abort";
    returning ``RECOMPUTE`` drops the KV cache and runs the next step over every token so far (the
    prompts and the tokens sampled up to now), so the cache holds the weights loaded meanwhile.
    """
    device = next(model.parameters()).device
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros((batch, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):  # left padding keeps every row's last token aligned
        input_ids[i, width - len(p) :] = torch.tensor(p, device=device)
        attn[i, width - len(p) :] = 1
    gens = []
    for s in seeds:
        g = torch.Generator(device=device)
        g.manual_seed(s if s is not None else int(torch.randint(0, 2**62, ()).item()))
        gens.append(g)
    temps = torch.tensor(temperature, dtype=torch.float32, device=device)
    tops = torch.tensor(top_p, dtype=torch.float32, device=device)
    limits = torch.tensor(max_new_tokens, device=device)

    stops = [set(s) for s in stop_ids] if stop_ids is not None else [{eos_id}] * batch

    outs: list[list[int]] = [[] for _ in range(batch)]
    lps: list[list[float]] = [[] for _ in range(batch)]
    done = limits <= 0  # max_new_tokens=0 rows produce nothing, even beside longer rows
    finish = ["length"] * batch
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    # transformers >= 5 names the KV cache argument ``cache``; older releases ``past_key_values``.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    past = None
    step_ids, step_pos = input_ids, position_ids
    fed_ids, fed_pos = input_ids[:, :0], position_ids[:, :0]  # what the cache holds
    for _ in range(int(limits.max().item())):
        verdict = step_hook() if step_hook is not None else False
        if verdict is True:
            finish = [f if bool(done[i]) else "abort" for i, f in enumerate(finish)]
            break
        if verdict == RECOMPUTE:
            step_ids, step_pos = torch.cat([fed_ids, step_ids], 1), torch.cat([fed_pos, step_pos], 1)
            fed_ids, fed_pos, past = fed_ids[:, :0], fed_pos[:, :0], None
        fed_ids, fed_pos = torch.cat([fed_ids, step_ids], 1), torch.cat([fed_pos, step_pos], 1)
        out = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos, use_cache=True, **{cache_kw: past})
        past = out[cache_kw]
        logits = out.logits[:, -1, :].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        greedy = temps <= 0
        probs = torch.softmax(logits / temps.clamp(min=1e-5)[:, None], dim=-1)
        probs = _top_p_filter(probs, tops)
        next_ids = torch.empty(batch, dtype=torch.long, device=device)
        for i in range(batch):
            if greedy[i]:
                next_ids[i] = logits[i].argmax()
            else:
                next_ids[i] = torch.multinomial(probs[i], 1, generator=gens[i])[0]
        for i in range(batch):
            if done[i]:
                continue
            tok = int(next_ids[i])
            outs[i].append(tok)
            lps[i].append(float(logprobs[i, tok]))
            if tok in stops[i]:
                done[i], finish[i] = True, "stop"
            elif len(outs[i]) >= limits[i]:
                done[i] = True
        if bool(done.all()):
            break
        next_ids = torch.where(done, torch.full_like(next_ids, pad_id), next_ids)
        attn = torch.cat([attn, (~done).long()[:, None]], dim=1)
        step_ids = next_ids[:, None]
        step_pos = step_pos[:, -1:] + 1
    return [Sample(outs[i], lps[i], finish[i]) for i in range(batch)]
