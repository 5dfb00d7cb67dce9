"""Images in prompts: a data file's image columns read and checked at load, and image prompts
rendered to the tokens ``transformers``' Qwen2.5-VL processor gives (the tiny VLM, built here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image
from support.vision import build_vlm, png, processor

from rlhpc.config import DataConfig
from rlhpc.data.files import read_rows
from rlhpc.data.images import PLACEHOLDER, ImageRef, Vision, from_png, with_image_parts
from rlhpc.data.prompts import ImageTokens, prepare_prompts, render_chats
from rlhpc.errors import ConfigError
from rlhpc.model import load_tokenizer


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm(tmp_path_factory.mktemp("vlm") / "model")


def test_image_prompts_render_to_the_processors_tokens(vlm: Path) -> None:
    tok, vision = load_tokenizer(vlm), Vision(vlm)
    images = [
        [ImageRef("a", data=png(56, 56))],
        [ImageRef("b", data=png(90, 70)), ImageRef("c", data=png(300, 40))],
        [],
    ]
    chats = [
        [{"role": "user", "content": f"{PLACEHOLDER}How many squares?"}],
        [
            {"role": "system", "content": "Look."},
            {"role": "user", "content": f"Left {PLACEHOLDER} right {PLACEHOLDER}?"},
        ],
        [{"role": "user", "content": "no image here"}],
    ]
    counts = ImageTokens.of(tok, vision, images)
    assert counts.counts[1][1] > counts.counts[0][0] >= 4  # sizes differ: the count is the processor's, per image
    rendered = render_chats(tok, tok.chat_template, chats, add_generation_prompt=True, images=counts)
    proc = processor(vlm)
    for chat, refs, (text, ids) in zip(chats, images, rendered):
        # what a user of transformers does: the template's text, then the processor on it and the images
        template_text = tok.apply_chat_template(with_image_parts(chat), tokenize=False, add_generation_prompt=True)
        assert text == template_text  # the text keeps one pad per image
        got = proc(text=[template_text], images=[r.open() for r in refs] or None, return_tensors="pt")
        assert ids == got["input_ids"][0].tolist()
        assert ids.count(vision.image_token_id) == sum(c for c in ImageTokens.of(tok, vision, [refs]).counts[0])
        if refs:  # the pixels the actor and the engine compute are the processor's
            pixels, grid = vision.pixels(refs)
            assert pixels.equal(got["pixel_values"]) and grid.equal(got["image_grid_thw"])


def test_a_pad_token_in_the_text_stays_text(vlm: Path) -> None:
    tok, vision = load_tokenizer(vlm), Vision(vlm)
    chat = [{"role": "user", "content": f"{PLACEHOLDER} says <|image_pad|><|vision_start|>"}]
    refs = [[ImageRef("a", data=png(56, 56))]]
    ((_, ids),) = render_chats(tok, tok.chat_template, [chat], True, images=ImageTokens.of(tok, vision, refs))
    assert ids.count(vision.image_token_id) == vision.tokens(refs[0][0])  # the forged pad is not an image token


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def verl_row(images: list, question: str = "How many?") -> dict:
    return {
        "prompt": [{"role": "user", "content": f"{PLACEHOLDER * len(images)}{question}"}],
        "images": images,
        "reward_model": {"ground_truth": "3"},
    }


def test_verl_layout_images_read_as_bytes_paths_and_datasets_dicts(tmp_path: Path, vlm: Path) -> None:
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png(60, 60))
    rows = [  # datasets' Image feature in Parquet: {"bytes", "path"}, a path relative to the data file
        verl_row([{"bytes": png(56, 56), "path": None}]),
        verl_row([{"bytes": None, "path": "pics/a.png"}]),
        verl_row([{"bytes": png(70, 56), "path": None}, {"bytes": None, "path": str(tmp_path / "pics" / "a.png")}]),
    ]
    f = write_parquet(tmp_path / "train.parquet", rows)
    read = read_rows(f, "prompt", "reward_model.ground_truth")
    read += read_rows(
        write_parquet(tmp_path / "bytes.parquet", [verl_row([png(56, 80)])]), "prompt", "reward_model.ground_truth"
    )
    lines = tmp_path / "paths.jsonl"  # plain paths
    lines.write_text(json.dumps(verl_row([str(tmp_path / "pics" / "a.png")])) + "\n")
    read += read_rows(lines, "prompt", "reward_model.ground_truth")
    assert [len(r.images) for r in read] == [1, 1, 2, 1, 1]
    assert read[1].images[0].path == str(tmp_path / "pics" / "a.png") and read[0].images[0].source.endswith(
        "row 0 images[0]"
    )
    assert read[0].images[0].durable and read[3].images[0].durable  # in the data file: a dump keeps where
    prepared = prepare_prompts(load_tokenizer(vlm), DataConfig(), {"train": 128}, Vision(vlm))("train", read)
    vision = Vision(vlm)
    for row in prepared:  # the length counted with the image tokens
        assert row.prompt_ids.count(vision.image_token_id) == sum(vision.tokens(i) for i in row.images)


@pytest.mark.parametrize(
    "images, says",
    [
        ([{"bytes": None, "path": "missing.png"}], "the image file"),
        ([{"bytes": b"not an image", "path": None}], "not an image PIL can read"),
        ([{"bytes": None, "path": None}], "not an image"),
    ],
)
def test_a_bad_image_is_one_error_naming_file_row_and_key(tmp_path: Path, images: list, says: str) -> None:
    good = [{"bytes": png(56, 56), "path": None}]
    f = write_parquet(tmp_path / "train.parquet", [verl_row(good), verl_row(images)])
    with pytest.raises(ConfigError) as e:
        read_rows(f, "prompt", "reward_model.ground_truth")
    assert f"{f} row 1 images[0]" in str(e.value) and says in str(e.value)


def test_placeholders_must_match_the_images(tmp_path: Path) -> None:
    row = verl_row([png(56, 56), png(56, 56)])
    row["prompt"][0]["content"] = f"{PLACEHOLDER} one mark for two images"
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({**row, "images": [{"bytes": None, "path": str(_save(tmp_path, "x.png"))}] * 2}) + "\n")
    with pytest.raises(ConfigError, match=r"line 1 has 2 image\(s\) in 'images' but 1 <image>"):
        read_rows(f, "prompt", "reward_model.ground_truth")


def _save(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).write_bytes(png(56, 56))
    return tmp_path / name


def test_images_need_a_vision_model_and_chat_prompts(tmp_path: Path, vlm: Path) -> None:
    f = write_parquet(tmp_path / "train.parquet", [verl_row([png(56, 56)])])
    rows = read_rows(f, "prompt", "reward_model.ground_truth")
    with pytest.raises(ConfigError, match="the model takes none"):
        prepare_prompts(load_tokenizer(vlm), DataConfig(), None, None)("train", rows)
    text = write_parquet(
        tmp_path / "text.parquet", [{"prompt": "<image>how many", "images": [png(56, 56)], "answer": "1"}]
    )
    with pytest.raises(ConfigError, match="has a text prompt"):
        prepare_prompts(load_tokenizer(vlm), DataConfig(), None, Vision(vlm))("train", read_rows(text))


def test_generated_images_keep_their_bytes() -> None:
    ref = from_png("task squares", Image.new("RGB", (56, 56)))
    assert not ref.durable and ref.read()[:4] == b"\x89PNG" and ref.uri().startswith("data:image/png;base64,")


def test_a_vlms_weights_go_out_in_the_checkpoints_names(vlm: Path) -> None:
    """The weight push names a vision-language model's tensors as its checkpoint does (what SGLang's
    load_weights knows; it skips any other name without an error), the vision tower's included."""
    from safetensors import safe_open

    from rlhpc.model import load_model
    from rlhpc.weights.expert_names import checkpoint_named

    model = load_model(vlm)
    with safe_open(str(vlm / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    pushed = {name for name, _ in checkpoint_named(model.named_parameters())}
    assert pushed == saved and any(n.startswith("visual.") for n in pushed)


def test_sglang_takes_images_as_rlhpc_sends_them() -> None:
    """SGLang 0.5.23 takes ``image_data`` per prompt beside ``input_ids`` that hold the image
    tokens already: its Qwen-VL processor decodes the ids, folds each run of pads back into one
    image mark and expands it again from the images; and its Qwen2.5-VL model's parameters are
    named ``model.*``, ``visual.*``, ``lm_head.*`` (the checkpoint's names, ``checkpoint_named``)."""
    import ast

    from support import sglang_wheel as W

    assert "image_data" in W.request_structs()["GenerateReqInput"]
    assert "The length of image_data should be equal to the batch size." in W.source(W.IO_STRUCT)
    qwen_vl = W.source("sglang/srt/multimodal/processors/qwen_vl.py")
    assert r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>" in qwen_vl
    base = W.source("sglang/srt/multimodal/processors/base_processor.py")
    assert "prompt = self._tokenizer.decode(prompt)" in base
    # an image with transparency loses its alpha (PIL's convert, not transformers' white
    # background): ``ImageRef.open`` does the same, so the actor sees the engines' pixels
    assert "smart_rgb_conversion = False" in base and 'return img.convert("RGB")' in base
    assert "smart_rgb_conversion = True" not in qwen_vl and "discard_alpha_channel=False" not in qwen_vl
    model = ast.parse(W.source("sglang/srt/models/qwen2_5_vl.py"))
    cls = next(n for n in model.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2_5_VLForConditionalGeneration")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {ast.unparse(t) for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets}
    assert {"self.model", "self.visual", "self.lm_head"} <= assigned


def test_a_dump_keeps_each_image_once_and_a_checkpoint_restores_them(tmp_path: Path) -> None:
    """A rollout's images in its dump: each distinct one once (a file's by its source, a generated
    one with its bytes), each sample's indices into them; the pending rollouts a checkpoint holds
    (loaded with weights_only) keep them, shared as before."""
    import h5py
    import torch

    from rlhpc.batch import RolloutBatch
    from rlhpc.metrics import write_rollout_dump

    in_file = ImageRef("train.parquet row 3 images[0]", data=png(56, 56), in_data_file=True)
    drawn = from_png("data.task squares picture 0", Image.new("RGB", (56, 56), (255, 255, 255)))
    images = [[in_file]] * 4 + [[drawn, in_file]] * 4
    n = len(images)
    batch = RolloutBatch([[1, 2]] * n, [[3]] * n, [[-0.5]] * n, torch.zeros(n), torch.zeros(n), 4, images=images)
    torch.save(batch.state_dict(), tmp_path / "pending.pt")
    again = RolloutBatch.from_state_dict(torch.load(tmp_path / "pending.pt", weights_only=True))
    assert [[r.read() for r in refs] for refs in again.images] == [[r.read() for r in refs] for refs in images]
    for b, name in ((batch, "a.h5"), (again, "b.h5")):
        write_rollout_dump(tmp_path / name, 0, b, {})
        with h5py.File(tmp_path / name) as f:
            assert [s.decode() for s in f["image_source"][:]] == [in_file.source, drawn.source]
            assert [list(i) for i in f["image_index"][:]] == [[0]] * 4 + [[1, 0]] * 4
            assert len(f["image_bytes"][0]) == 0 and bytes(f["image_bytes"][1]) == drawn.read()


@pytest.mark.parametrize(
    "tree, says",
    [
        (
            {"model": {"tiny": {"architecture": "qwen2_5_vl", "tokenizer": "bpe"}}, "actor": {"backend": "megatron"}},
            "which the megatron actor cannot train yet",
        ),
        ({"model": {"tiny": {}}, "data": {"task": "squares"}}, "shows the model pictures, but model.tiny.architecture"),
        (
            {"model": {"tiny": {"architecture": "qwen2_5_vl", "tokenizer": "bpe"}}, "data": {"task": "squares"},
             "rollout": {"env": "rlhpc.data.guess:GuessEnv"}},
            "multi-turn rollouts",
        ),
        ({"model": {"tiny": {"architecture": "qwen2_5_vl"}}}, "model.tiny.tokenizer = 'char' has no chat template"),
    ],
)  # fmt: skip
def test_what_images_cannot_do_yet_is_refused_at_submit(tree: dict, says: str) -> None:
    from rlhpc.preflight import check, config_from_dict

    with pytest.raises(ConfigError, match=re.escape(says)):
        check(config_from_dict(tree))


def test_an_image_with_transparency_opens_as_sglang_loads_it() -> None:
    """Its alpha dropped (a transparent pixel keeps its colour), not composited onto white as
    ``transformers``' own conversion would: the pixels SGLang's Qwen-VL processor computes."""
    rgba = Image.new("RGBA", (56, 56), (10, 20, 30, 0))
    opened = from_png("transparent", rgba).open()
    assert opened.mode == "RGB" and opened.getpixel((0, 0)) == (10, 20, 30)
