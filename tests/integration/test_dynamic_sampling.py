"""Dynamic sampling over a real CPU engine server: which groups are kept, the filter's counts in the
metrics, the extra prompts a pure function of (seed, rollout, round), and per-token weight versions
read from the engines' spans."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.engines import engine_client, start_server, stop_server

from rlhpc.config import AlgoConfig, DynamicSamplingConfig, EvalConfig, RolloutConfig
from rlhpc.data.buffer import DataBuffer
from rlhpc.data.dynamic_sampling import Group, nonzero_std, resolve_filter
from rlhpc.errors import ConfigError
from rlhpc.model import load_tokenizer
from rlhpc.rollout.generation import Generation, one_batch
from rlhpc.wire.client import EngineClient
from rlhpc.wire.protocol import token_versions

ROWS = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(40)]
B, N, SEED = 4, 2, 7


@pytest.fixture(scope="module")
def client(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineClient]:
    # deterministic: seeds are honoured (SGLang ignores them otherwise), so two rollouts compare
    proc, url, _ = start_server(
        model_path, tmp_path_factory.mktemp("srv"), "engine", ["--enable-deterministic-inference"]
    )
    yield engine_client(url, timeout_s=120)
    stop_server(proc)


def generation(client: EngineClient, model_path: str, reward=lambda p, r, a: float(len(r) % 2), **ds) -> Generation:
    rollout = RolloutConfig(
        rollout_batch_size=B, n_samples_per_prompt=N, max_new_tokens=3, dynamic_sampling=DynamicSamplingConfig(**ds)
    )
    return Generation(load_tokenizer(model_path), reward, rollout, EvalConfig(), AlgoConfig(), SEED, one_batch(client))


def test_built_in_filter_and_resolution() -> None:
    assert nonzero_std(Group("p", "a", ["x", "y"], [0.0, 1.0]))
    assert not nonzero_std(Group("p", "a", ["x", "y"], [1.0, 1.0]))
    assert resolve_filter("nonzero_std") is nonzero_std
    with pytest.raises(ConfigError, match="cannot be imported"):
        resolve_filter("support.filters:no_such_function")


def test_extra_prompts_are_a_pure_function_of_seed_rollout_and_round() -> None:
    a, b = DataBuffer(ROWS, B, SEED), DataBuffer(ROWS, B, SEED)
    assert a.extra_rows(3, 1, 6) == b.extra_rows(3, 1, 6)
    assert a.extra_rows(3, 1, 6) != a.extra_rows(3, 2, 6) != a.extra_rows(4, 1, 6)
    assert len({r["prompt"] for r in a.extra_rows(3, 1, 40)}) == 40  # no repeats while rows last


def test_the_filter_counts_and_the_groups_trained(client: EngineClient, model_path: str) -> None:
    """A user filter keeping even answers: which groups pass is known from the rows alone, so the
    counts and the batch are predicted before generating."""
    buffer, over, rollout_id = DataBuffer(ROWS, B, SEED), 6, 5
    rounds = [buffer.batch(rollout_id) + buffer.extra_rows(rollout_id, 0, over - B)]
    while sum(int(r["answer"]) % 2 == 0 for rows in rounds for r in rows) < B:
        rounds.append(buffer.extra_rows(rollout_id, len(rounds), over))
    seen = [r for rows in rounds for r in rows]
    kept = [r["prompt"] for r in seen if int(r["answer"]) % 2 == 0]

    gen = generation(client, model_path, filter="support.filters:even_answer", over_sampling_batch_size=over)
    batch, metrics, texts = gen.rollout(
        rollout_id, buffer.batch(rollout_id), lambda k, c: buffer.extra_rows(rollout_id, k, c)
    )
    assert metrics["dynamic_sampling/kept"] == len(kept)
    assert metrics["dynamic_sampling/dropped"] == len(seen) - len(kept)
    assert metrics["dynamic_sampling/rounds"] == len(rounds) and metrics["dynamic_sampling/short"] == 0
    assert len(batch) == B * N and texts["prompt"][::N] == kept[:B]
    assert batch.token_versions == [[0] * len(ids) for ids in batch.response_ids]  # the engine's "default" weights


def test_a_filter_keeping_everything_trains_the_unfiltered_rollout(client: EngineClient, model_path: str) -> None:
    buffer = DataBuffer(ROWS, B, SEED)
    rows, more = buffer.batch(2), lambda k, c: buffer.extra_rows(2, k, c)
    plain, _, _ = generation(client, model_path).rollout(2, rows, more)
    kept, metrics, _ = generation(client, model_path, filter="support.filters:keep_all").rollout(2, rows, more)
    assert kept.response_ids == plain.response_ids and kept.rewards.tolist() == plain.rewards.tolist()
    assert (metrics["dynamic_sampling/kept"], metrics["dynamic_sampling/dropped"]) == (B, 0)


def test_too_few_kept_groups_fill_the_batch_with_dropped_ones(client: EngineClient, model_path: str) -> None:
    buffer = DataBuffer(ROWS, B, SEED)
    gen = generation(client, model_path, reward=lambda p, r, a: 1.0, filter="nonzero_std", max_rounds=2)
    batch, metrics, _ = gen.rollout(0, buffer.batch(0), lambda k, c: buffer.extra_rows(0, k, c))
    assert metrics["dynamic_sampling/kept"] == 0 and metrics["dynamic_sampling/dropped"] == 2 * B
    assert metrics["dynamic_sampling/rounds"] == 2 and metrics["dynamic_sampling/short"] == B
    assert len(batch) == B * N and batch.advantages.abs().sum() == 0  # no gradient, but a batch


def test_token_versions_from_sglang_spans() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions({"weight_version": "4", "weight_versions": spans}, 5) == [3, 3, 4, 4, 4]
    assert token_versions({"weight_version": "default"}, 2) == [0, 0]  # no spans: the sample's version
    assert token_versions({"weight_version": "4", "weight_versions": spans}, 7) == [4] * 7  # spans that do not fit
