"""Trainer -> engine weight sync, for real: gloo broadcast groups, shared memory, HTTP, subprocesses.

The test process is the trainer (rank 0). Engines are CPU engine servers started on port 0.
Every check compares engine weights with the trainer's bit for bit (float32 survives JSON).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from support.engines import (
    assert_engine_holds,
    assert_generation_matches,
    engine_client,
    generate_in_background,
    named,
    start_server,
    stop_server,
    trainer_model,
)

from rlhpc.errors import RlhpcError
from rlhpc.weights.base import iter_buckets
from rlhpc.weights.broadcast import DistributedWeightSender
from rlhpc.weights.sender import make_weight_sender
from rlhpc.weights.shared_memory import TensorWeightSender
from rlhpc.weights.tensor_transport import (
    SharedStaging,
    TensorPayloadError,
    TensorUnpickler,
    adjacent_bytes,
    deserialize_flat_bucket,
    deserialize_named_tensors,
    flat_order,
    flatten_into,
    flatten_parameters,
    serialize_flat_bucket,
    serialize_named_tensors,
    share_memory_by_name,
    unflatten,
)
from rlhpc.wire import protocol as P
from rlhpc.wire.client import EngineClient

LOGS: dict[str, Path] = {}  # engine URL -> its server log


@pytest.fixture(scope="module")
def engines(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineClient]]:
    work = tmp_path_factory.mktemp("engines")
    with ThreadPoolExecutor(2) as pool:  # start both at once: startup is mostly imports
        started = list(pool.map(lambda i: start_server(model_path, work, f"engine{i}"), range(2)))
    LOGS.update({url: work / f"engine{i}.log" for i, (_, url, _) in enumerate(started)})
    yield [engine_client(url, timeout_s=60) for _, url, _ in started]
    for proc, _, _ in started:
        stop_server(proc)
    for proc, _, _ in started:
        assert proc.returncode == 0


def state(c: EngineClient) -> dict:
    return c.get_server_info()["internal_states"][0]


@pytest.fixture(autouse=True)
def clean_engines(request: pytest.FixtureRequest) -> None:
    """Each test that uses the shared engines gets them as a fresh one is: no weight-update session
    or group an earlier test left open (a failed push keeps both on purpose), not paused, memory
    held. Only the weights and their version carry over: every test pushes and checks its own."""
    if "engines" not in request.fixturenames:
        return
    fresh = {"paused": False, "released_tags": [], "weight_update_groups": [], "weight_update_session": False}
    for c in request.getfixturevalue("engines"):
        now = state(c)
        if now["weight_update_session"]:
            c.end_weight_update()
        for group in now["weight_update_groups"]:
            c.destroy_weights_update_group(group)
        if now["released_tags"]:
            c.resume_memory_occupation()
        c.continue_generation()
        now = state(c)
        assert {k: now[k] for k in fresh} == fresh and not now["receiving_weights"], now


@contextlib.contextmanager
def update_session(client: EngineClient) -> Iterator[None]:
    """A weight-update session around a direct update (SGLang refuses updates outside one)."""
    client.begin_weight_update()
    try:
        yield
    finally:
        client.end_weight_update()


def total_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ------------------------------------------------------------------ buckets


def test_buckets_respect_the_size_and_mark_the_last() -> None:
    ts = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]  # float32: 4 bytes each
    out = list(iter_buckets(ts, bucket_bytes=80))
    assert [[n for n, _ in b] for b, _ in out] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    assert [last for _, last in out] == [False, False, False, False, True]
    assert [last for _, last in iter_buckets(ts[:1], 80)] == [True]
    assert list(iter_buckets([], 80)) == []


# ------------------------------------------------------------------ flattened buckets


def test_flattened_bucket_round_trips_bit_exact_in_process() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randn(4, 6, generator=g).t(),  # not contiguous: read in place, not cloned
        torch.randint(0, 100, (3,), generator=g, dtype=torch.int8),
        torch.tensor(2.5),
    ]
    tensors = [tensors[i] for i in flat_order(tensors)]  # widest first: every tensor aligned
    out = torch.empty(1000, dtype=torch.uint8)
    flat = flatten_into(tensors, out)
    assert flat.data_ptr() == out.data_ptr() and flat.numel() == sum(t.numel() * t.element_size() for t in tensors)
    back = unflatten(flat, [t.dtype for t in tensors], [list(t.shape) for t in tensors])
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(tensors, back))


def test_tensors_already_back_to_back_are_sent_without_a_copy() -> None:
    storage = torch.arange(20.0)
    a, b = storage[:6].view(2, 3), storage[6:10]
    flat = adjacent_bytes([a, b])
    assert flat is not None and flat.data_ptr() == a.data_ptr() and flat.numel() == 40
    assert adjacent_bytes([b, a]) is None  # out of order
    assert adjacent_bytes([a, storage[11:12]]) is None  # a gap
    assert adjacent_bytes([storage.view(4, 5).t()]) is None  # not contiguous
    sender = DistributedWeightSender([EngineClient("http://x")], [1], "127.0.0.1", "gloo", 1 << 20)
    one = torch.randn(4, 4)
    assert sender._pack(([("w", one)], True), 0).flat.data_ptr() == one.data_ptr()  # no clone
    packed = sender._pack(([("x", torch.zeros(3, dtype=torch.bfloat16)), ("w", one)], False), 0)
    assert packed.names == ["w", "x"] and packed.dtypes == ["float32", "bfloat16"]  # aligned: widest first
    assert packed.flat.data_ptr() == sender._buffers[0].data_ptr()  # packed into the kept buffer
    sender.close()


def in_place_receives(c: EngineClient) -> int:
    return LOGS[c.base_url].read_text().count("in place")


def test_flattened_buckets_land_in_place_or_through_a_buffer(engines: list[EngineClient], model_path: str) -> None:
    """In place when the engine's parameters match the bucket's order and dtypes; through a kept
    receive buffer (and a cast) when they do not; in place again after release + resume."""
    c = engines[0]
    model = trainer_model(model_path, seed=8)
    with torch.no_grad():  # values a bfloat16 carries exactly
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    sender = DistributedWeightSender([c], [1], "127.0.0.1", "gloo", total_bytes(model) // 3, group_name="flat")
    try:
        sender.connect()
        before = in_place_receives(c)
        sender.send(named(model), version=40)
        assert in_place_receives(c) > before
        assert_engine_holds(c, model)

        model = trainer_model(model_path, seed=9)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
        mixed = [(n, t.to(torch.bfloat16) if i % 2 else t) for i, (n, t) in enumerate(named(model))]
        before = in_place_receives(c)
        sender.send(mixed, version=41)
        assert in_place_receives(c) == before  # the dtypes differ from the engine's: cast after receiving
        assert c.get_weight_version() == "41"
        assert_engine_holds(c, model)

        c.release_memory_occupation()
        c.resume_memory_occupation()
        model = trainer_model(model_path, seed=10)
        sender.send(named(model), version=42)
        assert in_place_receives(c) > before
        assert c.get_weight_version() == "42"
        assert_engine_holds(c, model)
        assert_generation_matches(c, model, model_path)
    finally:
        sender.close()


# ------------------------------------------------------------------ disaggregated


def test_distributed_sync_is_bit_exact_on_every_engine(engines: list[EngineClient], model_path: str) -> None:
    model = trainer_model(model_path, seed=1)
    bucket = total_bytes(model) // 5  # several buckets
    sender = make_weight_sender(
        engines, [1, 1], colocate=False, master_address="127.0.0.1", backend="gloo", bucket_bytes=bucket
    )
    assert isinstance(sender, DistributedWeightSender)
    try:
        sender.connect()
        assert sender.world_size == 3 and sender.rank_offsets == [1, 2]
        assert all(
            c.get_server_info()["internal_states"][0]["weight_update_groups"] == [sender.group_name] for c in engines
        )
        sender.send(named(model), version=7)
        for c in engines:
            assert c.get_weight_version() == "7"
            assert_engine_holds(c, model)
        assert_generation_matches(engines[0], model, model_path)

        # the group is reused by later updates
        model = trainer_model(model_path, seed=2)
        sender.send(named(model), version=8)
        for c in engines:
            assert c.get_weight_version() == "8"
            assert_engine_holds(c, model)
        out = engines[1].generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 1})
        assert out["meta_info"]["weight_version"] == "8"
        assert_generation_matches(engines[1], model, model_path)
    finally:
        sender.close()
    assert all(c.get_server_info()["internal_states"][0]["weight_update_groups"] == [] for c in engines)


def refuses_connections(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_the_rendezvous_port_closes_once_the_group_formed(engines: list[EngineClient], model_path: str) -> None:
    """Whoever reaches the store's port could write the group's keys: it listens only while the group forms."""
    model = trainer_model(model_path, seed=3)
    sender = DistributedWeightSender(engines, [1, 1], "127.0.0.1", "gloo", 1 << 20, group_name="closing", timeout=20)
    try:
        sender.connect()
        assert sender.master_port and refuses_connections(sender.master_port)
        for version in (40, 41):  # gloo needs no store after forming: pushes go through
            sender.send(named(model), version=version)
            for c in engines:
                assert c.get_weight_version() == str(version)
                assert_engine_holds(c, model)
    finally:
        sender.close()


def test_distributed_sync_failures_are_reported_not_hung(engines: list[EngineClient], model_path: str) -> None:
    model = trainer_model(model_path, seed=5)
    c = engines[0]
    # a refused tensor name: the engine still drains the broadcast, so the group stays usable
    sender = DistributedWeightSender([c], [1], "127.0.0.1", "gloo", 1 << 20, group_name="names", timeout=20)
    try:
        sender.connect()
        with pytest.raises(RlhpcError, match="unknown parameter 'bogus'"):
            sender.send([*named(model), ("bogus", torch.zeros(3))], version=20)
        sender.send(named(model), version=21)
        assert c.get_weight_version() == "21"
        assert_engine_holds(c, model)
    finally:
        sender.close()

    # an engine that cannot join the broadcast at all: fail fast with its reason, not after the timeout
    doomed = DistributedWeightSender([c], [1], "127.0.0.1", "gloo", 1 << 20, group_name="doomed", timeout=4)
    try:
        doomed.connect()
        c.destroy_weights_update_group("doomed")
        # the engine's own refusal, not the sender's 4 s timeout
        with pytest.raises(RlhpcError, match="no weight update group 'doomed'"):
            doomed.send(named(model), version=22)
        with pytest.raises(RlhpcError, match="unusable"):
            doomed.send(named(model), version=22)
    finally:
        doomed.close()
        c.continue_generation()  # a failed send leaves the engine paused on purpose
    assert c.get_weight_version() == "21"


def test_an_end_waits_for_the_update_under_way(engines: list[EngineClient], model_path: str) -> None:
    """The engine answers begin/end without a thread hop only when no other control call is
    pending: an end sent while an update waits for its broadcast closes the session after it.
    The broadcast is held until the end is seen queued behind the update (an end that did not
    wait would be answered while the broadcast is still held)."""
    model = trainer_model(model_path, seed=11)
    c = engines[0]
    sender = DistributedWeightSender([c], [1], "127.0.0.1", "gloo", 1 << 24, group_name="order", timeout=30)
    try:
        sender.connect()
        packed = sender._pack((list(named(model)), True), slot=0)
        announce = P.UpdateWeightsFromDistributedReqInput(
            names=packed.names, dtypes=packed.dtypes, shapes=packed.shapes, group_name="order",
            flush_cache=True, weight_version="77", load_format=P.FLATTENED_BUCKET,
        )  # fmt: skip
        c.begin_weight_update()
        with ThreadPoolExecutor(2) as pool:
            update = pool.submit(c.update_weights_from_distributed, announce)  # waits for the broadcast
            while not state(c)["receiving_weights"]:
                assert not update.done(), update.result()
            end = pool.submit(c.end_weight_update)
            while state(c)["control_calls_queued"] < 2:  # the update, and the end behind it
                assert not end.done(), f"the end was answered during the update: {end.result()}"
            assert not update.done() and not end.done() and state(c)["weight_update_session"]
            sender._broadcast(packed.flat)
            assert update.result(timeout=30)["success"] and end.result(timeout=30)["success"]
        assert c.get_weight_version() == "77" and not state(c)["weight_update_session"]
        assert_engine_holds(c, model)
    finally:
        sender.close()


def test_reconnect_replaces_a_group_left_open(engines: list[EngineClient], model_path: str) -> None:
    """A trainer that restarts (or forgets close()) can connect again under the same group name."""
    model = trainer_model(model_path, seed=6)
    first = DistributedWeightSender(engines, [1, 1], "127.0.0.1", "gloo", 1 << 20, timeout=20)
    first.connect()
    second = DistributedWeightSender(engines, [1, 1], "127.0.0.1", "gloo", 1 << 20, timeout=20)
    try:
        second.connect()
        second.send(named(model), version=30)
        for c in engines:
            assert c.get_weight_version() == "30"
            assert_engine_holds(c, model)
    finally:
        second.close()
        first.close()
    assert all(c.get_server_info()["internal_states"][0]["weight_update_groups"] == [] for c in engines)


def test_distributed_sync_refuses_a_wrong_tp_size(engines: list[EngineClient]) -> None:
    sender = DistributedWeightSender(engines[:1], [2], "127.0.0.1", "gloo", 1 << 20)
    with pytest.raises(RlhpcError, match="tp_size=1"):
        sender.connect()
    sender.close()


# ------------------------------------------------------------------ version confirmation


class _StubEngine:
    """Answers a colocated push like an engine; ``note`` decides whether the answer names the version."""

    def __init__(self, note: bool, reports: str | None = None):
        self.base_url, self.note, self.reports, self.asked = "http://stub", note, reports, 0
        self.calls: list[str] = []
        self.version: str | None = None
        self.session = False
        self.refuse_next = False
        self.payloads: list[list[str]] = []  # serialized_named_tensors of each update_weights_from_tensor

    def begin_weight_update(self) -> dict:  # with SGLang's refusals
        if self.session:
            raise RlhpcError(f"engine stub failed: {P.SESSION_ALREADY_OPEN}", "")
        self.calls.append("begin")
        self.session = True
        return {"success": True, "message": "Success"}

    def end_weight_update(self, timeout_s: float | None = None) -> dict:
        if not self.session:
            raise RlhpcError(f"engine stub failed: {P.NO_SESSION_OPEN}", "")
        self.calls.append("end")
        self.session = False
        return {"success": True, "message": "Success"}

    def pause_generation(self, mode: str = "abort") -> None:
        self.calls.append("pause" if mode == "abort" else f"pause {mode}")

    def update_weights_from_tensor(self, req: P.UpdateWeightsFromTensorReqInput) -> dict:
        if not self.session:
            raise RlhpcError(P.outside_session_message(P.Route.UPDATE_WEIGHTS_FROM_TENSOR), "")
        if self.refuse_next:
            self.refuse_next = False
            raise RlhpcError("engine stub failed: bad tensor", "")
        self.calls.append("update, abort all" if req.abort_all_requests else "update")
        self.payloads.append(req.serialized_named_tensors)
        self.version = req.weight_version or self.version
        note = P.weight_version_note(req.weight_version) if self.note and req.weight_version else ""
        return {"success": True, "message": f"ok.{note}"}

    def update_weights_from_distributed(self, req: P.UpdateWeightsFromDistributedReqInput) -> dict:
        if not self.session:
            raise RlhpcError(P.outside_session_message(P.Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED), "")
        self.calls.append("announce, abort all" if req.abort_all_requests else "announce")
        self.version = req.weight_version or self.version
        note = P.weight_version_note(req.weight_version) if self.note and req.weight_version else ""
        return {"success": True, "message": f"ok.{note}"}

    def get_weight_version(self) -> str:
        self.asked += 1
        return self.reports or self.version

    def continue_generation(self) -> None:
        self.calls.append("continue")


def test_the_version_is_read_from_the_answer_or_else_asked() -> None:
    two_buckets = [("w", torch.ones(4)), ("b", torch.ones(4))]
    confirming, silent = _StubEngine(note=True), _StubEngine(note=False)
    sender = TensorWeightSender([confirming, silent], [1, 1], bucket_bytes=16)
    sender.send(two_buckets, version=3)
    sender.close()
    assert (confirming.asked, silent.asked) == (0, 1)  # only the engine whose answer did not say
    # one weight-update session per push, around every bucket
    assert confirming.calls == silent.calls == ["pause", "begin", "update", "update", "end", "continue"]

    wrong = _StubEngine(False, reports="old")
    sender = TensorWeightSender([wrong], [1], bucket_bytes=16)
    with pytest.raises(RlhpcError, match="wrong weight version"):
        sender.send(two_buckets, version=4)
    sender.close()
    assert wrong.calls == ["pause", "begin", "update", "update", "end"]  # left paused


def test_every_push_pauses_and_continues_one_bucket_or_many() -> None:
    """SGLang's begin of an engine that is not paused waits for the requests in flight, and an
    update's abort_all_requests comes after it: a push of one bucket pauses too."""
    engine = _StubEngine(note=True)
    sender = TensorWeightSender([engine], [1], bucket_bytes=1 << 20)
    for version in (4, 5):
        sender.send([("w", torch.ones(4)), ("b", torch.ones(4))], version=version)
    assert engine.calls == ["pause", "begin", "update", "end", "continue"] * 2 and engine.asked == 0
    engine.reports = "old"
    engine.note = False
    with pytest.raises(RlhpcError, match="wrong weight version"):
        sender.send([("w", torch.ones(4))], version=6)
    assert engine.calls[-4:] == ["pause", "begin", "update", "end"]  # a failed push leaves it paused
    sender.close()


def shm_refcount(handle: bytes) -> int:
    """The reference count torch keeps in a "file_system" shared-memory segment's header."""
    with open(b"/dev/shm" + handle, "rb") as f:
        return int.from_bytes(f.read(4), "little", signed=True)


def test_each_tp_rank_of_each_engine_gets_a_pickle_of_its_own() -> None:
    """SGLang's rank r unpickles serialized_named_tensors[r] (test_sglang_protocol pins it): each
    pickle counts one reference on the shared buffer, each rank's unpickling drops its own, so
    the count returns to where it was (one pickle for all ranks leaves a CUDA IPC block held)."""
    engines = [_StubEngine(note=True), _StubEngine(note=True)]
    sender = TensorWeightSender(engines, [2, 3], bucket_bytes=1 << 20)
    sender.send([("w", torch.ones(4)), ("b", torch.ones(4))], version=1)
    sender.close()
    assert [len(e.payloads[0]) for e in engines] == [2, 3]

    flat = torch.zeros(64, dtype=torch.uint8)
    tensors = [flat[:32].view(torch.float32), flat[32:].view(torch.float32)]
    staging = SharedStaging()
    flat = staging.pack(tensors)
    handle = re.search(rb"/torch_\d+_\d+_\d+", base64.b64decode(serialize_flat_bucket(flat, ["a", "b"], tensors)[0]))
    before = shm_refcount(handle.group())
    payloads = serialize_flat_bucket(flat, ["a", "b"], tensors, ranks=3)
    assert shm_refcount(handle.group()) == before + 3
    for payload in payloads:  # every rank reads its own
        assert [n for n, _ in deserialize_flat_bucket(payload).tensors()] == ["a", "b"]
    assert shm_refcount(handle.group()) == before
    staging.close()


def test_cuda_devices_travel_as_uuids() -> None:
    """As SGLang's patched reductions: the sender names its GPU by UUID (argument 6 of
    rebuild_cuda_tensor), the receiver maps it to its own index (CUDA_VISIBLE_DEVICES differ)."""
    from rlhpc.weights.tensor_transport import _device_from_uuid, with_device_uuid

    args = tuple(range(15))
    assert with_device_uuid(args, uuid_of=lambda i: f"GPU-{i}") == (*range(6), "GPU-6", *range(7, 15))
    assert _device_from_uuid(2) == 2  # a payload from a sender without the mapping
    with pytest.raises(TensorPayloadError, match="no GPU here has the UUID 'GPU-6'"):
        _device_from_uuid("GPU-6")


class _CountedBroadcasts(DistributedWeightSender):
    """The disaggregated sender with its broadcast counted instead of sent: the HTTP calls around
    it are what this checks (the broadcast itself is checked bit for bit above)."""

    def __init__(self, engine: _StubEngine):
        super().__init__([engine], [1], "127.0.0.1", "gloo", bucket_bytes=1 << 20)
        self._group = object()  # connected, as far as the sender's checks go

    def _broadcast(self, flat: torch.Tensor) -> None:
        self.clients[0].calls.append("broadcast")


def test_a_disaggregated_push_of_one_bucket_is_five_round_trips() -> None:
    """pause, begin, announce (+ its broadcast), end, continue; the version is read from the
    announce's answer, not asked."""
    engine = _StubEngine(note=True)
    sender = _CountedBroadcasts(engine)
    for version in (1, 2):
        engine.calls.clear()
        sender.send([("w", torch.ones(4)), ("b", torch.ones(4))], version=version)
        assert sorted(engine.calls[2:4]) == ["announce", "broadcast"]  # the two run side by side
        assert engine.calls[:2] + engine.calls[4:] == ["pause", "begin", "end", "continue"]
    assert engine.asked == 0 and engine.version == "2"
    sender._group = None  # nothing to destroy
    sender.close()


def test_a_failed_push_closes_its_session_and_one_left_open_is_replaced() -> None:
    """SGLang refuses a second begin: a push that fails mid-way closes its session, and a session
    some earlier push could not close (engine deaf at the time) is ended before ours begins."""
    engine = _StubEngine(note=True)
    sender = TensorWeightSender([engine], [1], bucket_bytes=16)
    engine.refuse_next = True
    with pytest.raises(RlhpcError, match="bad tensor"):
        sender.send([("w", torch.ones(4)), ("b", torch.ones(4))], version=1)
    assert engine.calls == ["pause", "begin", "end"] and not engine.session
    engine.calls.clear()
    engine.session = True  # left open by an earlier push
    sender.send([("w", torch.ones(4)), ("b", torch.ones(4))], version=2)
    sender.close()
    assert engine.calls == ["pause", "end", "begin", "update", "update", "end", "continue"]
    assert not engine.session and engine.version == "2"


def test_partial_rollouts_pause_with_retract_and_never_abort() -> None:
    """rollout.partial_rollout: requests in flight are kept across the push (retract), so even a
    push of one bucket pauses instead of sending abort_all_requests."""
    engine = _StubEngine(note=True)
    sender = make_weight_sender([engine], [1], True, "127.0.0.1", "gloo", 1 << 20, pause_mode="retract")
    sender.send([("w", torch.ones(4))], version=2)
    sender.close()
    assert engine.calls == ["pause retract", "begin", "update", "end", "continue"]


# ------------------------------------------------------------------ pushes beside requests in flight


@pytest.mark.parametrize("colocate", [True, False])
def test_a_push_of_one_bucket_does_not_wait_for_requests_in_flight(
    engines: list[EngineClient], model_path: str, colocate: bool
) -> None:
    """SGLang's begin waits for the requests in flight on an engine that is not paused: the push
    pauses first (mode abort), so a long generation is aborted, not waited for."""
    c = engines[0]
    model = trainer_model(model_path, seed=41)
    sender = make_weight_sender([c], [1], colocate, "127.0.0.1", "gloo", 1 << 30)
    sender.connect()
    try:
        sender.send(named(model), version=70)
        t, out = generate_in_background(c, f"in-flight-{colocate}")
        sender.send(named(model), version=71)
        t.join(60)
    finally:
        sender.close()
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert out[0]["meta_info"]["completion_tokens"] < 120
    assert c.get_weight_version() == "71"
    assert_engine_holds(c, model)


def test_a_cache_flush_refused_while_a_request_runs_is_retried(
    engines: list[EngineClient], model_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang fails the last bucket's update when its cache flush finds a request running (the
    weights are in, the version is not): the push flushes again until the engine is idle, within
    a bound, then sets the version. Paused in place, the request keeps running until aborted."""
    c = engines[0]
    model = trainer_model(model_path, seed=42)
    sender = TensorWeightSender([c], [1], bucket_bytes=1 << 30)
    sender.pause_mode = "in_place"
    name = "model.layers.0.mlp.up_proj.weight"
    want = model.get_parameter(name).detach()[:1].tolist()  # its first row, as the engine answers

    def abort_once_loaded() -> None:  # the refused update loaded the weights: end the request
        while c.get_weights_by_name(name, truncate_size=1) != want:
            time.sleep(0.02)
        c.abort_request(rid="busy-flush")

    t, out = generate_in_background(c, "busy-flush")
    helper = threading.Thread(target=abort_once_loaded, daemon=True)
    helper.start()
    try:
        with caplog.at_level("WARNING", logger="rlhpc.weights.base"):
            sender.send(named(model), version=72)
    finally:
        helper.join(60)
        t.join(60)
        sender.close()
    assert "busy at the weight update's cache flush" in caplog.text
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert c.get_weight_version() == "72"
    assert_engine_holds(c, model)


# ------------------------------------------------------------------ colocate


def test_tensor_sync_is_bit_exact(engines: list[EngineClient], model_path: str) -> None:
    model = trainer_model(model_path, seed=3)
    sender = make_weight_sender(
        engines, [1, 1], colocate=True, master_address="127.0.0.1", backend="gloo", bucket_bytes=total_bytes(model) // 4
    )
    assert isinstance(sender, TensorWeightSender)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sender.connect()
    engines[1].begin_weight_update()  # a session some failed push left open: replaced, not refused
    sender.send(named(model), version=11)
    sender.close()
    for c in engines:
        assert c.get_weight_version() == "11"
        assert_engine_holds(c, model)
        with pytest.raises(RlhpcError, match="no weight-update session is open"):
            c.end_weight_update()  # the push closed its sessions
    # the trainer's own tensors are untouched (only clones went to shared memory)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]) and not p.is_shared()
    assert_generation_matches(engines[1], model, model_path)


def test_colocated_pushes_reuse_the_staging_buffer_or_send_shared_weights_as_they_are(
    engines: list[EngineClient], model_path: str
) -> None:
    sender = TensorWeightSender(engines, [1, 1], bucket_bytes=1 << 16)  # several buckets, one staging buffer
    for seed, version in ((20, 50), (21, 51)):  # the engines map the kept buffer again: no stale bytes
        model = trainer_model(model_path, seed=seed)
        sender.send(named(model), version=version)
        for c in engines:
            assert c.get_weight_version() == str(version)
            assert_engine_holds(c, model)
    staged = sender._staging._buf
    assert staged is not None and staged.is_shared()
    staged_bytes = staged.clone()

    flatten_parameters(model)  # the trainer's weights flat in shared memory: each bucket sent as it is
    share_memory_by_name(model)
    for version in (52, 53):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
        sender.send(named(model), version=version)
        assert sender._staging._buf is staged and torch.equal(staged, staged_bytes)  # not used
        for c in engines:
            assert c.get_weight_version() == str(version)
            assert_engine_holds(c, model)
    assert_generation_matches(engines[0], model, model_path)
    sender.close()


def test_tensor_payload_refuses_arbitrary_pickles(engines: list[EngineClient]) -> None:
    import base64
    import pickle

    evil = base64.b64encode(pickle.dumps([("x", os.getcwd)])).decode()
    with pytest.raises(RlhpcError, match="refusing to unpickle"), update_session(engines[0]):
        engines[0].update_weights_from_tensor(P.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[evil]))


class _CudaTensorStandIn:
    """Pickles exactly as ForkingPickler pickles a CUDA tensor (rebuild_cuda_tensor + IPC handle),
    so the CPU engine's refusal is tested on machines without a GPU."""

    def __reduce__(self):  # noqa: ANN204
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = (torch.Tensor, torch.Size([2]), (1,), 0, torch.storage.TypedStorage, torch.float32, 0, b"h" * 64)
        return rebuild_cuda_tensor, (*args, 8, 0, False, b"r", 0, b"e", True)


def test_cpu_engine_refuses_cuda_tensors(engines: list[EngineClient]) -> None:
    import base64
    import pickle

    payload = base64.b64encode(pickle.dumps([("model.norm.weight", _CudaTensorStandIn())])).decode()
    with pytest.raises(RlhpcError, match="CUDA tensors cannot be loaded by the CPU engine"), update_session(engines[0]):
        engines[0].update_weights_from_tensor(P.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload]))


def test_cuda_ipc_tensors_are_unpickled_only_on_a_gpu_engine() -> None:
    where = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
    with pytest.raises(TensorPayloadError, match="CUDA tensors cannot be loaded by the CPU engine"):
        TensorUnpickler(io.BytesIO(), allow_cuda=False).find_class(*where)
    assert "rebuild_cuda_tensor" in repr(TensorUnpickler(io.BytesIO(), allow_cuda=True).find_class(*where))
    with pytest.raises(TensorPayloadError, match="refusing to unpickle os.system"):
        TensorUnpickler(io.BytesIO(), allow_cuda=True).find_class("os", "system")


def forking_dump(obj: object) -> bytes:
    """``obj`` pickled as the senders pickle (shared CPU tensors by /dev/shm name)."""
    from multiprocessing.reduction import ForkingPickler

    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        return buf.getvalue()
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def test_flat_bucket_payloads_are_checked_before_any_byte_lands(engines: list[EngineClient], model_path: str) -> None:
    """A span outside the bucket, of the wrong size or misaligned, or a payload that is not a bucket,
    is refused with the reason; the engine keeps its weights."""
    import base64
    from types import SimpleNamespace

    c = engines[0]
    before = c.get_weights_by_name("model.norm.weight", truncate_size=4)
    flat = torch.zeros(64, dtype=torch.uint8)
    flat.share_memory_()  # never unpickled: every payload below is refused first or names no tensor

    def meta(start: int, end: int, shape: list[int], dtype: torch.dtype = torch.float32) -> SimpleNamespace:
        return SimpleNamespace(name="model.norm.weight", shape=torch.Size(shape), dtype=dtype, start_idx=start,
                               end_idx=end, numel=end - start)  # fmt: skip

    cases = [
        ({"flattened_tensor": flat, "metadata": [meta(0, 80, [20])]}, "do not hold an aligned"),  # past the end
        ({"flattened_tensor": flat, "metadata": [meta(0, 12, [4])]}, "do not hold an aligned"),  # wrong size
        ({"flattened_tensor": flat, "metadata": [meta(2, 6, [1])]}, "do not hold an aligned"),  # misaligned
        ({"flattened_tensor": flat, "metadata": ["x"]}, "bad flattened_bucket metadata"),
        ([("model.norm.weight", flat)], "holds {'flattened_tensor'"),
        ({"flattened_tensor": flat.view(torch.int32), "metadata": []}, "must be 1-D uint8"),
    ]
    for obj, why in cases:
        raw = base64.b64encode(forking_dump(obj)).decode()
        req = P.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[raw], load_format=P.FLATTENED_BUCKET)
        with pytest.raises(RlhpcError, match=re.escape(why)), update_session(c):
            c.update_weights_from_tensor(req)
    assert c.get_weights_by_name("model.norm.weight", truncate_size=4) == before


def test_serialized_tensors_round_trip_in_process() -> None:
    named_in = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.tensor([1, 2], dtype=torch.int64))]
    payload, keep = serialize_named_tensors(named_in)
    named_out = deserialize_named_tensors(payload)
    assert [n for n, _ in named_out] == ["a", "b"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(named_in, named_out))
    assert all(t.data_ptr() != x.data_ptr() for t, (_, x) in zip(keep, named_in))  # clones, not the live tensors
    with pytest.raises(TensorPayloadError, match="cannot read serialized_named_tensors"):
        deserialize_named_tensors("not base64!")


# Payloads that, unpickled by a loader that checks only what a payload names, set state on a
# class found by name (BUILD), call one (REDUCE, NEWOBJ), or (issue 43, item 9) BUILD an allowed
# SimpleNamespace whose `append` is then a class that APPEND calls: UntypedStorage(2**20).
HOSTILE_PICKLES = {
    "BUILD on a class": b"ctorch.storage\nUntypedStorage\nN}X\x04\x00\x00\x00evilK\x01s\x86b.",
    "REDUCE on a class": b"ctorch.storage\nUntypedStorage\nJ\x00\x00\x10\x00\x85R.",
    "NEWOBJ of a class": b"\x80\x02ctorch\nTensor\n)\x81.",
    "BUILD then APPEND on SimpleNamespace": (
        b"ctypes\nSimpleNamespace\n)R}X\x06\x00\x00\x00appendctorch.storage\nUntypedStorage\nsbJ\x00\x00\x10\x00a."
    ),
    "BUILD on a rebuild function": (
        b"ctorch.multiprocessing.reductions\nrebuild_tensor\nN}X\x02\x00\x00\x00fnK\x01s\x86b."
    ),
    "a rebuild function called with a class": (
        b"ctorch.multiprocessing.reductions\nrebuild_storage_empty\nctorch.storage\nTypedStorage\n\x85R."
    ),
}


@pytest.mark.parametrize("what", HOSTILE_PICKLES)
def test_a_payload_can_neither_call_nor_change_what_it_names(what: str) -> None:
    # Issue 32, item 5 (BUILD on a class found by name was a process-wide setattr) and issue 43,
    # item 9: every global a payload may name is handed out as something safe to call with any
    # arguments and impossible to change, so no sequence of opcodes gets further.
    with pytest.raises(Exception) as refused:  # noqa: PT011 - the point is that nothing loads
        TensorUnpickler(io.BytesIO(HOSTILE_PICKLES[what]), allow_cuda=True).load()
    assert not isinstance(refused.value, MemoryError)
    assert not hasattr(torch.storage.UntypedStorage, "evil")
    with pytest.raises(TensorPayloadError):
        deserialize_named_tensors(base64.b64encode(HOSTILE_PICKLES[what]).decode())


def test_a_payload_names_only_torch_s_own_shared_memory() -> None:
    """A shared storage must name torch's manager socket and a /dev/shm segment of this user that
    holds the declared size: mapping past a segment's end would crash the engine at first read."""
    t = torch.zeros(64, dtype=torch.uint8)
    payload, keep = serialize_named_tensors([("x", t)])
    raw = base64.b64decode(payload)
    handle = re.search(rb"/torch_\d+_\d+_\d+", raw).group()
    bigger = raw.replace(b"K@", b"K\xff", 1)  # the storage's declared size 64 -> 255 (its segment: 64 + a header)
    assert bigger != raw
    with pytest.raises(TensorPayloadError, match="holds fewer than 255 bytes"):
        deserialize_named_tensors(base64.b64encode(bigger).decode())
    other = raw.replace(handle, b"/etc" + b"x" * (len(handle) - 4))
    with pytest.raises(TensorPayloadError, match="does not name a torch shared-memory segment"):
        deserialize_named_tensors(base64.b64encode(other).decode())
    assert torch.equal(deserialize_named_tensors(payload)[0][1], t)


def test_int_weights_are_refused_and_the_old_ones_kept(engines: list[EngineClient]) -> None:
    c = engines[0]
    before = c.get_weights_by_name("model.norm.weight", truncate_size=4)
    size = len(c.get_weights_by_name("model.norm.weight", truncate_size=10**6))
    payload, _ = serialize_named_tensors([("model.norm.weight", torch.ones(size, dtype=torch.int64))])
    with pytest.raises(RlhpcError, match="dtype torch.int64"), update_session(c):
        c.update_weights_from_tensor(P.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload]))
    assert c.get_weights_by_name("model.norm.weight", truncate_size=4) == before


@pytest.mark.parametrize("colocate", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_diverged_trainer_s_weights_never_reach_an_engine(
    engines: list[EngineClient], model_path: str, colocate: bool, bad: float
) -> None:
    """The trainer checks each bucket before it leaves (SGLang loads whatever it is sent): the push
    fails naming the tensor, and the engines keep their weights and version."""
    c = engines[0]
    model = trainer_model(model_path, seed=40)
    flatten_parameters(model)  # the loop's layout: disaggregated, received in place
    name = "model.layers.0.mlp.up_proj.weight"
    sender = make_weight_sender([c], [1], colocate, "127.0.0.1", "gloo", total_bytes(model) // 3)
    sender.connect()
    try:
        sender.send(named(model), version=60)
        held = c.get_weights_by_name(name, truncate_size=10**6)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            model.get_parameter(name).view(-1)[5] = bad
        with pytest.raises(RlhpcError, match=rf"NaN or infinite values in 1 tensor\(s\): {re.escape(name)};"):
            sender.send(named(model), version=61)
    finally:
        sender.close()
    assert c.get_weight_version() == "60"
    assert c.get_weights_by_name(name, truncate_size=10**6) == held
    c.continue_generation()  # the failed push left it paused


def test_float16_weights_whose_sum_overflows_are_finite() -> None:
    """The check sums each run of one dtype; a float16 sum overflows long before its values do."""
    from rlhpc.weights.tensor_transport import flat_layout, non_finite

    tensors = [torch.full((40_000,), 60_000.0, dtype=torch.float16), torch.ones(3, dtype=torch.float16)]
    flat = flatten_into(tensors, torch.empty(80_006, dtype=torch.uint8))
    spans = flat_layout([t.dtype for t in tensors], [list(t.shape) for t in tensors])
    assert non_finite(flat, [torch.float16] * 2, spans, ["a", "b"]) == []
    tensors[1][2] = float("inf")
    flat = flatten_into(tensors, flat)
    assert non_finite(flat, [torch.float16] * 2, spans, ["a", "b"]) == ["b"]


def test_cpu_engine_refuses_nccl(engines: list[EngineClient]) -> None:
    with pytest.raises(RlhpcError, match="'nccl' needs an engine on CUDA"):
        engines[0].init_weights_update_group(
            P.InitWeightsUpdateGroupReqInput(
                master_address="127.0.0.1",
                master_port=1,
                rank_offset=1,
                world_size=2,
                group_name="nccl_group",
                backend="nccl",
            )
        )
    assert engines[0].get_server_info()["internal_states"][0]["weight_update_groups"] == []


# ------------------------------------------------------------------ release / resume


def test_release_frees_weights_and_resume_needs_a_resend(engines: list[EngineClient], model_path: str) -> None:
    c = engines[1]
    assert c.get_server_info()["internal_states"][0]["weights_bytes"] > 0
    c.release_memory_occupation()
    state = c.get_server_info()["internal_states"][0]
    assert state["weights_bytes"] == 0 and state["released_tags"] == ["cuda_graph", "kv_cache", "weights"]
    with pytest.raises(RlhpcError, match="memory is released"):
        c.generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 2})

    c.resume_memory_occupation(["weights"])
    with pytest.raises(RlhpcError, match="kv_cache"):
        c.generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 2})
    c.resume_memory_occupation(["kv_cache", "cuda_graph"])  # each released tag once, as SGLang's resume
    assert c.get_server_info()["internal_states"][0]["weights_bytes"] > 0
    with pytest.raises(RlhpcError, match="not re-sent since resume"):
        c.generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 2})

    model = trainer_model(model_path, seed=4)
    sender = TensorWeightSender([c], [1], bucket_bytes=1 << 20)
    sender.send(named(model), version=12)
    sender.close()
    assert_engine_holds(c, model)
    assert_generation_matches(c, model, model_path)
