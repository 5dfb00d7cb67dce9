"""The plain sampler: one /generate call per sample, rows in requests of a few rows each, the
engine's answer scored (``rlhpc.rollout.sampler``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhpc.data.prompts import encode_rows
from rlhpc.data.rows import Row
from rlhpc.rollout.sampler import Draw, Sampling, rows_per_request
from rlhpc.rollout.samples import Samples
from rlhpc.rollout.scoring import MixedScorer, Sample
from rlhpc.wire.protocol import finish_reason, routed_experts, token_versions, weight_version
from rlhpc.wire.request import Request, sample_seed


def image_uris(rows: list[Row]) -> list[list[str]]:
    """Each row's images as SGLang's ``image_data`` takes them (data URIs, encoded once per row,
    not per sample); empty when no row has any."""
    if not any(r.images for r in rows):
        return []
    return [[ref.uri() for ref in r.images] for r in rows]


def _samples(rows: list[Row], n: int, row_of: Sequence[int], outputs: Sequence[dict]) -> list[Sample]:
    """What the reward reads of each output: ``outputs[k]`` answers row ``row_of[k]``."""
    return [
        Sample(
            prompt=rows[i].prompt_text, response=out["text"], label=rows[i].label,
            response_ids=list(out["output_ids"]), messages=rows[i].messages if rows[i].is_chat else None,
            row=rows[i], finish_reason=finish_reason(out["meta_info"]),
        )
        for i, out in zip(row_of, outputs)
    ]  # fmt: skip


@dataclass
class PlainSampler:
    """``routing_shape``: with algo.routing_replay, the MoE model's (layers, experts per token,
    experts) (``rlhpc.model.routing_shape``): every sample then carries its routed experts."""

    run: Sampling
    routing_shape: tuple[int, int, int] | None = None

    def sample(self, draw: Draw) -> Samples:
        run, rows, n = self.run, draw.rows, draw.n
        per_request = rows_per_request(len(rows), n, run.num_engines)
        chunks = [range(i, min(i + per_request, len(rows))) for i in range(0, len(rows), per_request)]
        prompts = encode_rows(run.tokenizer, rows)
        uris = image_uris(rows)
        replay = self.routing_shape is not None
        requests = [
            Request(
                return_routed_experts=replay,
                input_ids=[prompts[i] for i in chunk for _ in range(n)],
                image_data=[uris[i] for i in chunk for _ in range(n)] if uris else None,
                sampling_params=[
                    {
                        "max_new_tokens": draw.max_new_tokens,
                        "temperature": draw.temperature,
                        "top_p": run.top_p,
                        "sampling_seed": sample_seed(run.seed, draw.seed_tag, i, j),
                        **draw.params,
                    }
                    for i in chunk
                    for j in range(n)
                ],
            )
            for chunk in chunks
        ]

        # model components (the reward model) score each request's samples as it is answered
        ahead = run.reward_fn.start() if isinstance(run.reward_fn, MixedScorer) else {}
        with run.bar(draw.desc, len(rows)) as advance:

            def done(c: int, answer: list[dict]) -> None:
                advance(len(chunks[c]))
                if ahead:
                    group = _samples(rows, n, [i for i in chunks[c] for _ in range(n)], answer)
                    for scores in ahead.values():
                        scores.add(c, group)

            try:
                answers = run.send(requests, done)
            except BaseException:
                for scores in ahead.values():
                    scores.close()
                raise

        outputs = [out for answer in answers for out in answer]  # row-major: a row's n samples adjacent
        response_ids = [list(out["output_ids"]) for out in outputs]
        logprobs = [[lp for lp, _tok, _ in out["meta_info"].get("output_token_logprobs", [])] for out in outputs]
        samples = _samples(rows, n, [k // n for k in range(len(outputs))], outputs)
        texts = {
            "prompt": [s.prompt for s in samples],
            # the engine's own detokenization (SGLang's: stop token trimmed, special tokens
            # skipped), not a second one here on the loop's critical path
            "response": [s.response for s in samples],
            "answer": [s.label for s in samples],
        }
        if ahead:
            ready = {name: scores.scores(range(len(requests))) for name, scores in ahead.items()}
            rewards, parts = run.reward_fn(samples, ready)
        else:
            rewards, parts = run.reward_fn(samples)
        prompt_ids = [prompts[k // n] for k in range(len(outputs))]
        per_token = [token_versions(out["meta_info"], len(ids)) for out, ids in zip(outputs, response_ids)]
        versions = [min(v) if v else weight_version(out["meta_info"]) for v, out in zip(per_token, outputs)]
        return Samples(
            prompt_ids=prompt_ids, response_ids=response_ids, logprobs=logprobs,
            rewards=torch.tensor(rewards, dtype=torch.float32), texts=texts, weight_versions=versions,
            token_versions=per_token, parts=parts, finish_reasons=[finish_reason(out["meta_info"]) for out in outputs],
            images=[rows[k // n].images for k in range(len(outputs))] if uris else [],
            routed_experts=self._routed_experts(prompt_ids, response_ids, outputs) if replay else [],
        )  # fmt: skip

    def _routed_experts(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], outputs: list[dict]
    ) -> list[torch.Tensor]:
        """Each sample's ``meta_info["routed_experts"]`` as [tokens - 1, layers, top-k], kept in the
        smallest integer type its expert ids fit (a rollout holds one per token, layer and k)."""
        assert self.routing_shape is not None
        layers, top_k, experts = self.routing_shape
        dtype = torch.uint8 if experts <= 256 else torch.int16
        return [
            torch.from_numpy(routed_experts(out["meta_info"], len(p) + len(r) - 1, layers, top_k).copy()).to(dtype)
            for p, r, out in zip(prompt_ids, response_ids, outputs)
        ]
