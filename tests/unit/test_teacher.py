"""The teacher (issue 30): its config and GPUs, what it asks the engines and reads back, and the
on-policy distillation term against numbers worked out by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhpc.algo.grpo import agg_loss, distill_advantages, policy_loss_per_token
from rlhpc.cluster.layout import describe_layout, idle_note, plan_layout, summarize_layout
from rlhpc.config import ClusterConfig, RewardModelConfig, TeacherConfig
from rlhpc.errors import ConfigError, RlhpcError
from rlhpc.model import build_bpe_tokenizer, build_char_tokenizer
from rlhpc.preflight import config_from_dict
from rlhpc.rollout.teacher import check_same_vocabulary, request, response_logprobs
from rlhpc.wire.protocol import MetaInfo

REPO = Path(__file__).resolve().parents[2]


def _cfg(teacher=None, algo=None, **more):
    tree = {"model": {"tiny": {}}, "cluster": {"gpus_per_node": 3}, **more}
    if teacher is not None:
        tree["teacher"] = teacher
    if algo is not None:
        tree["algo"] = algo
    return config_from_dict(tree)


# ------------------------------------------------------------------ config and layout


def test_distillation_takes_a_teacher_on_gpus_of_its_own():
    cfg = _cfg({"tiny": {"seed": 5}}, {"distill_coef": 0.5})
    assert (cfg.cluster.actor_num_gpus, cfg.cluster.rollout_num_gpus) == (1, 1)
    assert not cfg.algo.needs_reference and cfg.algo.needs_teacher
    kl = _cfg({"tiny": {}}, {"kl_coef": 0.1, "kl_target": "teacher"}).algo
    assert not kl.needs_reference and kl.needs_teacher  # the KL pulls toward the teacher: no reference copy


@pytest.mark.parametrize(
    "teacher, algo, cluster, match",
    [
        (None, {"distill_coef": 1.0}, {}, r"algo\.distill_coef = 1\.0 reads a teacher's logprobs"),
        (None, {"kl_coef": 0.1, "kl_target": "teacher"}, {}, r"algo\.kl_target = 'teacher'"),
        ({"tiny": {}}, {}, {}, "nothing uses it"),
        ({"tiny": {}}, {"kl_coef": 0.1}, {}, "nothing uses it"),  # a KL to the reference reads no teacher
        ({}, {"distill_coef": 1.0}, {}, "exactly one of teacher.path and teacher.tiny"),
        ({"path": "/nowhere"}, {"distill_coef": 1.0}, {}, r"teacher\.path /nowhere has no config\.json"),
        ({"tiny": {}, "num_gpus": 3, "gpus_per_engine": 2}, {"distill_coef": 1.0}, {"gpus_per_node": 8}, "whole"),
        ({"tiny": {}, "num_gpus": 2}, {"distill_coef": 1.0}, {}, r"teacher\.num_gpus = 2 .* none is left"),
        ({"tiny": {}}, {"distill_coef": -1.0}, {}, r"algo\.distill_coef = -1\.0 must be >= 0"),
        ({"tiny": {}}, {"distill_coef": 1.0}, {"gpus_per_node": 2, "rollout_nodes": 1}, "heterogeneous"),
        # kl_in_reward and reference resets act on a reference model, which a KL to the teacher has not
        ({"tiny": {}}, {"kl_coef": 0.1, "kl_target": "teacher", "kl_in_reward": True}, {}, "act on the reference"),
        ({"tiny": {}}, {"kl_coef": 0.1, "kl_target": "teacher", "ref_update_interval": 2}, {}, "act on the reference"),
    ],
)
def test_refused_with_the_key_and_the_fix(teacher, algo, cluster, match):
    with pytest.raises(ConfigError, match=match) as e:
        _cfg(teacher, algo, cluster={"gpus_per_node": 3, **cluster})
    assert e.value.fix


def test_the_teacher_group_comes_after_the_reward_models():
    cluster = ClusterConfig(gpus_per_node=4, num_nodes=2, actor_num_gpus=2, rollout_num_gpus=2)
    layout = plan_layout(
        cluster, RewardModelConfig(tiny={}, num_gpus=2), TeacherConfig(tiny={}, num_gpus=2, gpus_per_engine=2)
    )
    assert layout.reward_slots == ((4,), (5,)) and layout.teacher_slots == ((6, 7),) and layout.num_slots == 8
    assert "teacher engine 0   (tp=2) -> node1:gpu2, node1:gpu3" in describe_layout(layout)
    summary = summarize_layout(layout)
    assert "1 teacher engine(s) (tp=2, GPUs of their own)" in summary
    assert "node1: reward engines 0-1 on gpu0-1; teacher engines 0 on gpu2-3" in summary
    alone = plan_layout(
        ClusterConfig(gpus_per_node=4, actor_num_gpus=1, rollout_num_gpus=1), None, TeacherConfig(tiny={})
    )
    assert alone.teacher_slots == ((2,),) and alone.reward_slots == ()
    note = idle_note(ClusterConfig(gpus_per_node=4, actor_num_gpus=1, rollout_num_gpus=1), None, TeacherConfig(tiny={}))
    assert note is not None and "(actor 1 + rollout 1 + teacher 1)" in note


def test_the_dry_run_shows_the_teacher_group_and_its_launch_line(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(run), "--nodes", "1",
         "--gpus-per-node", "4", "--set", "teacher.tiny.seed=5", "--set", "teacher.backend=sglang",
         "--set", "algo.distill_coef=0.5"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "1 teacher engine(s) (tp=1, GPUs of their own)" in p.stdout
    assert "node0: actor ranks 0-1 on gpu0-1; engines 0 on gpu2; teacher engines 0 on gpu3" in p.stdout
    line = p.stdout.split("teacher engine 0's launch line (each teacher engine's alike):\n", 1)[1].splitlines()[0]
    assert "--model-path <run dir>/teacher" in line and "--is-embedding" not in line
    assert "distill_coef: 0.5" in p.stdout and not run.exists()


# ------------------------------------------------------------------ requests and answers


def test_a_teacher_asks_from_the_prompts_last_token_and_reads_the_responses():
    ids, start = request([1, 2, 3], [7, 8])
    assert ids == [1, 2, 3, 7, 8] and start == 2  # SGLang's None lands on the prompt's last token
    answer = {"meta_info": {MetaInfo.INPUT_TOKEN_LOGPROBS: [[None, 3, None], [-0.5, 7, None], [-1.25, 8, None]]}}
    assert response_logprobs(answer, 2) == [-0.5, -1.25]
    assert response_logprobs({"meta_info": {MetaInfo.INPUT_TOKEN_LOGPROBS: [[None, 3, None]]}}, 0) == []
    with pytest.raises(RlhpcError, match="answered 1 input logprobs for a response of 2 tokens"):
        response_logprobs({"meta_info": {MetaInfo.INPUT_TOKEN_LOGPROBS: [[None, 3, None]]}}, 2)


def test_a_teacher_with_another_tokenizer_is_refused():
    check_same_vocabulary(build_char_tokenizer(), build_char_tokenizer(), "/t")
    with pytest.raises(RlhpcError, match="another tokenizer than the policy"):
        check_same_vocabulary(build_char_tokenizer(), build_bpe_tokenizer(), "/t")


# ------------------------------------------------------------------ the distillation term


def test_distillation_advantages_by_hand():
    """Two samples (3 and 2 response tokens, the masked position holds 9s). Per token the advantage
    is A - coef * (old - teacher), with coef 0.1:

    sample 0, A = 0.5:  old - teacher = (-1.0 - -1.5, -2.0 - -1.0, -0.5 - -3.0) = (0.5, -1.0, 2.5)
                        -> 0.5 - 0.05 = 0.45, 0.5 + 0.1 = 0.6, 0.5 - 0.25 = 0.25
    sample 1, A = -1.0: (-0.5 - -0.5, -0.25 - -1.25, masked) = (0.0, 1.0, 0)
                        -> -1.0, -1.1, and -1.0 at the masked position
    """
    adv = torch.tensor([0.5, -1.0])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.5, -0.25, 9.0]])
    teacher = torch.tensor([[-1.5, -1.0, -3.0], [-0.5, -1.25, 9.0 - 20.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    per_token, reverse_kl = distill_advantages(adv, old, teacher, mask, 0.1)
    assert per_token.flatten().tolist() == pytest.approx([0.45, 0.6, 0.25, -1.0, -1.1, -1.0])
    assert reverse_kl.flatten().tolist() == pytest.approx([0.5, -1.0, 2.5, 0.0, 1.0, 0.0])
    # (distill/kl, the token mean of the reverse KL as the rank sums it, is checked against
    # transformers in tests/integration/test_distillation.py)
    # through the PPO loss at ratio 1 (the first step: logprobs = old): each token's loss is -A_t,
    # token-mean: -(0.45 + 0.6 + 0.25 - 1.0 - 1.1) / 5 = 0.8 / 5 = 0.16
    pg, _ = policy_loss_per_token("ppo_clip", old, old, per_token, mask, 0.2, 0.28)
    assert agg_loss(pg, mask, "token-mean").item() == pytest.approx(0.16)
