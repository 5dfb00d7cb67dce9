"""A vision-language model end to end on CPU: the CPU engine serves image prompts as SGLang's
/generate takes them (``image_data``), its logprobs those of ``transformers``' own forward of
the processor's output."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlhpc.data.images import PLACEHOLDER, ImageRef, Vision, with_image_parts
from rlhpc.data.prompts import ImageTokens, render_chats
from rlhpc.errors import RlhpcError
from rlhpc.model import load_model, load_tokenizer
from rlhpc.wire.client import EngineClient
from tests.support.engines import engine_client, start_server, stop_server
from tests.support.vision import build_vlm, png, processor


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
