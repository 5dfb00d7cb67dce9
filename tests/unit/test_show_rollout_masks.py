"""rlhpc-show-rollout shows what was trained (issue 42, item 8): each sample's response in
pieces per turn, ``+`` for the engine's tokens (loss mask 1) and ``-`` for the masked ones (an
observation, the template's tokens), decoded with the run's tokenizer; long prompts cut to
their end unless --full."""

from __future__ import annotations

import torch

from rlhpc.batch import RolloutBatch
from rlhpc.cli import show_rollout
from rlhpc.metrics import write_rollout_dump
from rlhpc.model import build_bpe_tokenizer
from rlhpc.run_dir import RunDir


def test_trained_and_masked_tokens_are_marked_per_turn_and_long_prompts_cut(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    tok = build_bpe_tokenizer()
    tok.save_pretrained(run.base_model)  # the run's tokenizer, where a tiny model's run keeps it
    run.config_file.write_text("model:\n  path: null\n")
    reply0, observation, reply1 = "3+4=", "<|im_end|>\n<|im_start|>user\nNo: say 7.<|im_end|>\n", "7<|im_end|>"
    ids = [tok(t, add_special_tokens=False).input_ids for t in (reply0, observation, reply1)]
    response = ids[0] + ids[1] + ids[2]
    mask = [1] * len(ids[0]) + [0] * len(ids[1]) + [1] * len(ids[2])
    turns = [0] * (len(ids[0]) + len(ids[1])) + [1] * len(ids[2])
    prompt = "<|im_start|>system\n" + "a long system prompt " * 20 + "<|im_end|>\n<|im_start|>user\nSay 7.<|im_end|>\n"
    batch = RolloutBatch(
        [tok(prompt).input_ids, [1]], [response, ids[2]], [[0.0] * len(response), [0.0] * len(ids[2])],
        torch.tensor([1.0, 0.0]), torch.tensor([0.5, -0.5]), 2,
        loss_masks=[mask, [1] * len(ids[2])], turns=[turns, [0] * len(ids[2])], truncated=[False, True],
    )  # fmt: skip
    texts = {"prompt": [prompt, "x"], "response": [tok.decode(response), reply1], "answer": ["7", "7"]}
    write_rollout_dump(run.rollout_dump(3), 3, batch, texts)
    assert show_rollout.main([str(run.path), "3"]) == 0
    out = capsys.readouterr().out
    assert "sample 0: reward 1.00 adv +0.500 answer '7', " + f"{len(ids[0]) + len(ids[2])} of {len(response)}" in out
    assert "2 turn(s)" in out and "cut at its limit" in out
    assert f"  turn 0   + {reply0!r}\n  turn 0   - {observation!r}\n  turn 1   + {reply1!r}\n" in out
    # a long prompt: its end (the question), and how long it was
    assert (
        f"...{prompt[-160:]!r} ({len(prompt)} chars; --full shows it whole)" in out and "<|im_start|>system" not in out
    )
    assert show_rollout.main([str(run.path), "3", "--full"]) == 0
    assert repr(prompt) in capsys.readouterr().out
    # a dump copied away from its run: no tokenizer, the response whole
    alone = tmp_path / "alone.h5"
    alone.write_bytes(run.rollout_dump(3).read_bytes())
    assert show_rollout.main([str(alone)]) == 0
    assert f"  response {tok.decode(response)!r}" in capsys.readouterr().out
