"""The real-model recipes in jobs/configs/ dry-run as a user would submit them, against their
model's config.json shape (tests/support/models/) and data in their layout (verl's GSM8K)."""

import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rlhpc.cluster.memory import summarize
from rlhpc.errors import ConfigError
from rlhpc.preflight import load_config
from rlhpc.wire.protocol import ROUTED_EXPERTS_FLAG

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "support" / "models"
RECIPES = {
    "gsm8k_qwen2.5_1.5b_1x8.yaml": ("qwen2.5-1.5b-instruct", "node0: actor ranks 0-3 on gpu0-3; engines 0-3 on gpu4-7"),
    "gsm8k_qwen2.5_7b_4x8.yaml": ("qwen2.5-7b-instruct", "engines 0-7"),
    # tests/support/models/qwen3-*: the published config.json shapes of Qwen3-8B, Qwen3-32B and
    # Qwen3-30B-A3B (sizes only, no weights)
    "gsm8k_qwen3_8b_1x8.yaml": ("qwen3-8b", "node0: actor ranks 0-3 on gpu0-3; engines 0-3 on gpu4-7"),
    "gsm8k_qwen3_32b_4x8.yaml": ("qwen3-32b", "node2..node3 (2 nodes): engines 0-3 on gpu0-7"),
    "gsm8k_qwen3_30b_a3b_2x8.yaml": ("qwen3-30b-a3b", "node1: engines 0-3 on gpu0-7"),
    # the published config.json shape of Qwen2.5-VL-7B-Instruct (a vision tower, image tokens)
    "geo3k_qwen2.5_vl_7b_1x8.yaml": (
        "qwen2.5-vl-7b-instruct",
        "node0: actor ranks 0-3 on gpu0-3; engines 0-3 on gpu4-7",
    ),
}


def gsm8k_parquet(path: Path) -> Path:
    """verl's GSM8K layout: chat-message prompts, the answer under reward_model."""
    rows = [
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)}}
        for i in range(16)
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_every_shipped_recipe_is_checked_here():
    with_model = {
        f.name for f in (REPO / "jobs" / "configs").glob("*.yaml") if "path" in yaml.safe_load(f.read_text())["model"]
    }
    assert with_model == set(RECIPES)


def geo3k_parquet(path: Path) -> Path:
    """verl's geometry3k layout: an images column of {"bytes", "path"}, <image> in the prompt messages."""
    import io

    from PIL import Image

    def png() -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (64, 48), (20, 40, 60)).save(buf, format="PNG")
        return buf.getvalue()

    rows = [
        {"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": f"<image>Find x ({i})."}],
         "images": [{"bytes": png(), "path": None}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(i)}}
        for i in range(8)
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_recipe_dry_runs_against_its_models_shape(recipe, tmp_path):
    model, layout = RECIPES[recipe]
    data = (geo3k_parquet if recipe.startswith("geo3k") else gsm8k_parquet)(tmp_path / "data.parquet")
    sets = [
        f"model.path={MODELS / model}",
        f"data.train_file={data}",
        f"data.eval_file={data}",
        "cluster.gpu_kind=H100",
    ]
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--config", str(REPO / "jobs" / "configs" / recipe),
         "--run-dir", str(tmp_path / "run"), "--partition", "gpu", *[a for s in sets for a in ("--set", s)]],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cfg = load_config(REPO / "jobs" / "configs" / recipe, sets)
    assert f"#SBATCH --nodes={cfg.cluster.num_nodes}" in p.stdout and layout in p.stdout
    assert "Step time estimate on H100 (cluster.gpu_kind)" in p.stdout  # and the layouts compared
    assert "fastest layout of these" in p.stdout or "no layout of these" in p.stdout
    # the engine launch line and the resolved config it will run
    tp = cfg.cluster.rollout_gpus_per_engine
    served = tmp_path / "run" / "engine_model_fp8" if cfg.rollout.quantization == "fp8" else MODELS / model
    assert f"python -P -m sglang.launch_server --model-path {served} " in p.stdout
    assert f"--tp-size {tp} --mem-fraction-static 0.7 --random-seed {cfg.seed}" in p.stdout
    launch = p.stdout.split("sglang.launch_server", 1)[1].split("\n", 1)[0]
    assert ("--base-gpu-id 0 --quantization fp8 " in launch) == (cfg.rollout.quantization == "fp8")
    assert (f"{ROUTED_EXPERTS_FLAG} " in launch) == cfg.algo.routing_replay
    resolved = yaml.safe_load(p.stdout.split("# the resolved config the job runs", 1)[1].split("\n", 1)[1])
    assert resolved["data"]["label_key"] == "reward_model.ground_truth" and resolved["model"]["path"] == str(
        MODELS / model
    )
    assert not (tmp_path / "run").exists()
    # the memory plan: checked against cluster.gpu_memory_gb where the recipe sets it (the dry run
    # above would have been refused), and the totals its comment shows are the dry run's
    plan = p.stdout.split("GPU memory plan", 1)[1].split("\n\n", 1)[0]
    if cfg.cluster.gpu_memory_gb is not None:
        assert f"of {cfg.cluster.gpu_memory_gb:g} GiB (cluster.gpu_memory_gb)" in plan
        comment = (REPO / "jobs" / "configs" / recipe).read_text()
        for who in ("actor rank", "engine"):
            total = re.search(rf"^  {who}: ([\d.]+)$", plan, re.M).group(1)
            assert f"#   {who} {total} " in comment, (who, total, plan)


def test_qwen3_32b_does_not_fit_at_tp_4_without_pipeline_parallelism(tmp_path):
    data = gsm8k_parquet(tmp_path / "gsm8k.parquet")
    sets = [f"model.path={MODELS / 'qwen3-32b'}", f"data.train_file={data}", f"data.eval_file={data}"]
    recipe = REPO / "jobs" / "configs" / "gsm8k_qwen3_32b_4x8.yaml"
    with pytest.raises(ConfigError, match=r"actor rank needs ~.* biggest term is gradients") as e:
        load_config(recipe, [*sets, "actor.megatron.tensor_model_parallel_size=4"])
    assert (
        "tensor_model_parallel_size" in e.value.fix
        and "expert" not in e.value.fix
        and "raise actor.megatron.pipeline_model_parallel_size" in e.value.fix
    )
    # the knob it names: two stages halve the weights and their state; the first keeps two
    # micro-batches' activations, the last the logits (which are the bigger here)
    two_stages = load_config(recipe, [*sets, "actor.megatron.tensor_model_parallel_size=4",
                                      "actor.megatron.pipeline_model_parallel_size=2"])  # fmt: skip
    assert re.search(r"^  actor rank: 56\.0$", summarize(two_stages), re.M)
    assert "the last of 2 pipeline stages (32 of 64 layers)" in summarize(two_stages)
    with pytest.raises(ConfigError, match=r"biggest term is activations \(no recompute\)"):
        load_config(recipe, [*sets, "actor.megatron.recompute=false"])


def test_the_heads_decide_which_parallel_sizes_a_model_takes(tmp_path):
    """Qwen2.5-1.5B has 12 query heads and 2 key/value heads: Megatron TP 4 cannot split the
    key/value heads, and an SGLang engine of 8 GPUs cannot split the query heads."""
    data = gsm8k_parquet(tmp_path / "gsm8k.parquet")
    base = [f"model.path={MODELS / 'qwen2.5-1.5b-instruct'}", f"data.train_file={data}", f"data.eval_file={data}"]
    recipe = REPO / "jobs" / "configs" / "gsm8k_qwen2.5_1.5b_1x8.yaml"
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size = 4 does not divide .* key/value heads \(2\)"):
        load_config(recipe, [*base, "actor.megatron.tensor_model_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"rollout_gpus_per_engine = 8 \(each engine's TP\) does not divide .* 12"):
        load_config(recipe, [*base, "cluster.gpus_per_node=16", "cluster.rollout_num_gpus=8", "cluster.actor_num_gpus=8",
                             "cluster.rollout_gpus_per_engine=8"])  # fmt: skip
