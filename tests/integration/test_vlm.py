"""A vision-language model end to end on CPU: the CPU engine serves image prompts as SGLang's
/generate takes them (``image_data``), its logprobs those of ``transformers``' own forward of
the processor's output."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.engines import engine_client, start_server, stop_server
from support.jobs import REPO, job_args, kill_when, rollouts, submit
from support.vision import build_vlm, png, processor

from rlhpc.checkpoint import CheckpointManager
from rlhpc.data.images import PLACEHOLDER, ImageRef, Vision, with_image_parts
from rlhpc.data.prompts import ImageTokens, render_chats
from rlhpc.errors import RlhpcError
from rlhpc.invariants import comparable, final_weights
from rlhpc.metrics import read_metrics
from rlhpc.model import load_model, load_tokenizer
from rlhpc.schedule import load_pending
from rlhpc.wire.client import EngineClient


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def client(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineClient]:
    proc, url, _ = start_server(str(vlm), tmp_path_factory.mktemp("engine"), "vlm")
    try:
        yield engine_client(url)
    finally:
        stop_server(proc)


def image_prompt(vlm: Path, question: str, images: list[ImageRef]) -> tuple[str, list[int]]:
    tok = load_tokenizer(vlm)
    chat = [{"role": "user", "content": PLACEHOLDER * len(images) + question}]
    counts = ImageTokens.of(tok, Vision(vlm), [images])
    ((text, ids),) = render_chats(tok, tok.chat_template, [chat], True, images=counts)
    return text, ids


def test_image_prompt_logprobs_are_transformers_forward_of_the_processors_output(
    client: EngineClient, vlm: Path
) -> None:
    """Greedy from an image prompt, batched beside a prompt with a larger image and a text-only
    one (so left padding and the 3-D positions of other rows are in play); each row's tokens and
    logprobs, and its prompt's, are those of the model's own forward of the processor's output
    (where the model computes its positions itself)."""
    small, large = ImageRef("small", data=png(56, 56)), ImageRef("large", data=png(112, 84, (10, 200, 90)))
    rows = [("How many squares?", [small]), ("Which color?", [large]), ("no image", [])]
    prompts = [image_prompt(vlm, q, imgs) for q, imgs in rows]
    outs = client.generate(
        input_ids=[ids for _, ids in prompts],
        image_data=[[i.uri() for i in imgs] for _, imgs in rows],
        sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
    )
    model, proc = load_model(vlm).eval(), processor(vlm)
    for (question, imgs), (text, ids), out in zip(rows, prompts, outs):
        reference = proc(text=[text], images=[i.open() for i in imgs] or None, return_tensors="pt")
        assert reference["input_ids"][0].tolist() == ids
        full = torch.tensor([ids + out["output_ids"]])
        inputs = {**reference, "input_ids": full, "attention_mask": torch.ones_like(full)}
        inputs["mm_token_type_ids"] = (full == model.config.image_token_id).int()  # the processor's, extended
        with torch.no_grad():
            logprobs = torch.log_softmax(model(**inputs).logits[0].float(), -1)
        want = logprobs[len(ids) - 1 : -1].gather(-1, full[0, len(ids) :, None])[:, 0]
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, want, atol=1e-4), (question, got, want)
        assert out["output_ids"] == logprobs[len(ids) - 1 : -1].argmax(-1).tolist()  # greedy: each the argmax
        prompt_lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
        want_prompt = logprobs[: len(ids) - 1].gather(-1, full[0, 1 : len(ids), None])[:, 0]
        assert torch.allclose(prompt_lps, want_prompt, atol=1e-4)
        assert out["meta_info"]["prompt_tokens"] == len(ids)  # the image tokens counted


def test_images_that_do_not_fill_the_prompts_image_tokens_are_refused(client: EngineClient, vlm: Path) -> None:
    _, ids = image_prompt(vlm, "How many?", [ImageRef("small", data=png(56, 56))])
    bigger = ImageRef("large", data=png(112, 112)).uri()  # 16 image tokens for a prompt rendered with 4
    with pytest.raises(RlhpcError, match="make 16 image tokens but its prompt holds 4"):
        client.generate(input_ids=[ids], image_data=[[bigger]], sampling_params={"max_new_tokens": 1})
    with pytest.raises(RlhpcError, match="The length of image_data should be equal to the batch size"):
        client.generate(input_ids=[ids, ids], image_data=[[bigger]], sampling_params={"max_new_tokens": 1})
    with pytest.raises(RlhpcError, match="not an image"):
        client.generate(
            input_ids=[ids], image_data=[["data:image/png;base64,AAAA"]], sampling_params={"max_new_tokens": 1}
        )
    assert client.get_model_info()["has_image_understanding"] is True


def test_with_image_parts_is_verls_split() -> None:
    chat = [{"role": "user", "content": f"a{PLACEHOLDER}b{PLACEHOLDER}"}, {"role": "assistant", "content": "x"}]
    assert with_image_parts(chat) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image"},
                {"type": "text", "text": "b"},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": "x"},
    ]


# ------------------------------------------------------------------ the torch actor


def rank(vlm: Path, **actor: object):
    """One torch actor rank in this process (gloo, world of one), on the tiny VLM."""
    from rlhpc.actor.spec import ActorSpec
    from rlhpc.actor.worker import TrainWorker
    from rlhpc.config import Config

    cfg = Config(deterministic=True)
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    w = TrainWorker(ActorSpec.from_config(cfg, 1), str(vlm), 0, 1)
    w.init_process_group(w.rendezvous(one_node=True))
    return w


def image_batch(vlm: Path):
    """Four samples: three with images of two sizes (two sharing one object, as a group's
    samples do), one without; and each prompt's text as the template wrote it."""
    from rlhpc.batch import RolloutBatch

    small, large = ImageRef("small", data=png(56, 56)), ImageRef("large", data=png(112, 84, (10, 200, 90)))
    rows = [("How many squares?", [small]), ("Which color?", [large]), ("no image", []), ("Again?", [small])]
    rendered = [image_prompt(vlm, q, imgs) for q, imgs in rows]
    responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    n = len(rows)
    batch = RolloutBatch(
        [ids for _, ids in rendered], responses, [[-1.0] * len(r) for r in responses], torch.zeros(n),
        torch.tensor([1.0, -1.0, 0.5, -0.5]), n, images=[imgs for _, imgs in rows],
    )  # fmt: skip
    return batch, [text for text, _ in rendered]


def test_the_actor_computes_transformers_logprobs_for_image_samples_packed_or_padded(vlm: Path) -> None:
    """The torch actor's per-token logprobs of image samples, in padded and in packed
    micro-batches, are those of the model's own forward of each sample alone with the
    processor's pixels (where the model computes its 3-D positions itself)."""
    import torch.distributed as dist

    from rlhpc.actor.packing import micro_batch_groups

    batch, texts = image_batch(vlm)
    w = rank(vlm, max_tokens_per_micro_batch=10_000)
    try:
        model, proc = w.module, processor(vlm)
        want = []
        for k in range(len(batch)):
            ids = torch.tensor([batch.prompt_ids[k] + batch.response_ids[k]])
            refs = batch.images[k]
            inputs = {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "mm_token_type_ids": (ids == model.config.image_token_id).int(),
            }
            if refs:
                got = proc(text=[texts[k]], images=[r.open() for r in refs], return_tensors="pt")
                assert got["input_ids"][0].tolist() == batch.prompt_ids[k]
                inputs |= {"pixel_values": got["pixel_values"], "image_grid_thw": got["image_grid_thw"]}
            with torch.no_grad():
                lps = torch.log_softmax(model(**inputs).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            want.append(lps[len(batch.prompt_ids[k]) - 1 :])
        for packs in (False, True):
            w.can_pack = packs  # actor.sequence_packing as the torch actor runs it, or padded
            (mb_batch,) = micro_batch_groups(batch, 10_000, padded=not packs)
            mb = w._on_device(mb_batch)
            with torch.no_grad():
                per_token = mb.per_sample(w._token_logprobs(w._logits(w.module, mb), mb.ids))
            for row in range(len(mb_batch)):  # a micro-batch's samples come in its own order
                k = batch.response_ids.index(mb_batch.response_ids[row])
                start = len(mb_batch.prompt_ids[row]) - 1
                got = per_token[row, start : start + len(mb_batch.response_ids[row])]
                assert torch.allclose(got, want[k], atol=1e-5), (packs, k)
    finally:
        w.shutdown()
        assert not dist.is_initialized()


@pytest.mark.parametrize("frozen", [False, True])
def test_a_train_step_moves_the_vision_tower_unless_frozen(vlm: Path, frozen: bool) -> None:
    w = rank(vlm, lr=1e-2, freeze_vision_tower=frozen, max_tokens_per_micro_batch=64)
    try:
        before = w.named_tensors()
        batch = image_batch(vlm)[0]
        batch.response_ids[0] = [w.module.config.image_token_id, 6, 7]  # a sampled image token is text
        metrics = w.train(0, batch)
        after = w.named_tensors()
    finally:
        w.shutdown()
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert metrics["optimizer_steps"] == 1.0
    assert any(n.startswith("model.language_model.") for n in moved)
    assert any(n.startswith("model.visual.") for n in moved) != frozen


# ------------------------------------------------------------------ whole jobs

HELD_SQUARES = "data.reward=support.hold:squares"  # the task's reward, held for ``kill_when``
# The squares task on the tiny VLM, small and deterministic: what a killed run must reproduce.
# Asynchronous (a checkpoint holds a generated, untrained rollout and its pictures), with an
# entropy bonus so every rollout moves the weights (a random start's rewards are mostly 0).
# The job's cost is its start-up (~25 s), not its 4 rollouts (~1 s each).
SQUARES = (
    "model.tiny.architecture=qwen2_5_vl", "model.tiny.tokenizer=bpe", "data.task=squares", "rollout.max_new_tokens=2",
    "deterministic=true", "rollout.num_rollout=4", "checkpoint.save_interval=2", "eval.interval=2",
    "eval.n_samples_per_prompt=2", "eval.temperature=1.0", "data.num_eval=8", "rollout.max_staleness=1",
    "algo.entropy_coef=0.01",
)  # fmt: skip


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("squares") / "run"
    p = submit(run, *SQUARES, HELD_SQUARES, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run


def test_a_vlm_job_trains_evaluates_and_dumps_its_images(undisturbed: Path) -> None:
    """The squares job end to end: rollouts of image prompts generated a step ahead and trained,
    evaluations with pass@k, each dump keeping each picture once (a group's samples share it)."""
    import h5py

    assert rollouts(undisturbed) == [0, 1, 2, 3]
    records = [m for m in read_metrics(undisturbed) if m["kind"] == "rollout"]
    assert [m["staleness/max"] for m in records] == [0.0, 1.0, 1.0, 1.0]
    assert all(m["grad_norm"] > 0 for m in records)  # each rollout moved the weights: a resume has them to match
    evals = [m for m in read_metrics(undisturbed) if m["kind"] == "eval"]
    assert [m["rollout_id"] for m in evals] == [-1, 1, 3]
    assert all({"eval/pass@1", "eval/pass@2"} <= set(m) for m in evals)
    vision = Vision(undisturbed / "base_model")
    with h5py.File(undisturbed / "rollouts" / "rollout_000003.h5") as f:
        index = [list(i) for i in f["image_index"][:]]
        assert len(f["image_source"]) == 8 and len(index) == 8 * 4  # 8 pictures, 4 samples each
        assert all(index[k] == index[k - k % 4] for k in range(len(index)))
        assert all(len(b) > 0 for b in f["image_bytes"][:])  # drawn, not in a file: their bytes are kept
        prompt = list(f["prompt_ids"][0])
        assert prompt.count(vision.image_token_id) == 4  # a 56x56 picture: 4 image tokens


def test_a_killed_vlm_run_resumes_to_the_same_run(undisturbed: Path, tmp_path: Path) -> None:
    """SIGKILLed once rollout 1's checkpoint exists (in rollout 2's scoring; the checkpoint holds
    rollout 2, generated with its pictures and not trained), resumed: the same metrics and the
    same final weights, vision tower included, as the run nobody stopped."""
    run = tmp_path / "run"
    args = job_args(run, *SQUARES, HELD_SQUARES)
    kill_when(args, run / "checkpoints" / "rollout_000001")
    latest = CheckpointManager(run / "checkpoints", 2).latest()
    pending = load_pending(latest.path)  # what the async pipeline had generated ahead
    assert [g.rollout_id for g in pending.values()] == [latest.rollout_id + 1]
    assert all(len(refs) == 1 for g in pending.values() for refs in g.batch.images)  # each sample's picture
    resumed_from = latest.rollout_id
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"resuming from rollout_{resumed_from:06d}" in p.stdout
    assert comparable(run) == comparable(undisturbed)
    assert final_weights(run) == final_weights(undisturbed)
