"""Many LoRA runs, one fleet: a ``--shared-fleet`` sweep's tasks on one CPU engine, each serving
its own adapter; one task failing leaves the other finishing, and each task gets exactly the
samples it gets alone."""

import subprocess

import h5py
from safetensors.torch import load_file
from support.jobs import REPO, SUBMIT, deterministic_config, rollouts, said

# Rollouts of 8 prompts x 4 samples; a rate that moves the adapters far within a rollout, so a
# request served with another task's adapter (or none) would give other tokens
LORA = [*deterministic_config(3, save_interval=1), "actor.lora.rank=8", "actor.lr=0.01"]
GOOD, BAD = "support.rewards:parity", "support.rewards:parity_then_raise"  # BAD raises after rollout 0


def sets(*overrides: str) -> list[str]:
    return [a for o in (*LORA, *overrides) for a in ("--set", o)]


def dump(run_dir, rollout_id: int) -> dict:
    with h5py.File(run_dir / "rollouts" / f"rollout_{rollout_id:06d}.h5") as f:
        return {k: f[k][:].tolist() for k in ("response_ids", "rollout_logprobs", "weight_versions", "rewards")}


def test_two_lora_runs_share_one_fleet_and_one_failing_leaves_the_other(tmp_path):
    sweep = tmp_path / "sweep"
    args = [*SUBMIT, "--run-dir", str(sweep), *sets(), "--sweep", f"data.reward={GOOD},{BAD}", "--shared-fleet"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)
    out = said(p)
    assert p.returncode != 0 and "1 of 2 sweep task(s) failed: task 1 (data.reward=" in out, out[-3000:]
    good, bad = sweep / "task_000", sweep / "task_001"
    assert rollouts(good) == [0, 1, 2] and (good / "FINISHED").is_file()
    assert rollouts(bad) == [0] and not (bad / "FINISHED").exists()
    # both on the fleet's one engine, each adapter under its task's name; each unloaded as its task ended
    [engine_log] = (sweep / "logs" / "fleet").glob("engine_*.log")
    text = engine_log.read_text()
    for task in ("task_000", "task_001"):
        assert f"LoRA adapter {task} loaded" in text and text.rstrip().count(f"LoRA adapter {task} unloaded") >= 1
    assert not (sweep / "fleet.json").exists()  # the fleet stopped with the sweep

    # it trained: its adapter moved off the base (B starts at zero), so requests that did not name
    # it, or named another task's, would get other tokens
    pushed = load_file(good / "lora_push" / "v000003" / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for k, t in pushed.items() if "lora_B" in k)

    # the same run alone, on engines of its own: the same samples, bit for bit, and the same versions
    alone = tmp_path / "alone"
    p = subprocess.run(
        [*SUBMIT, "--run-dir", str(alone), *sets(f"data.reward={GOOD}")],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for r in range(3):
        shared, own = dump(good, r), dump(alone, r)
        assert shared == own, r
        assert shared["weight_versions"] == [r] * 32  # the task's own adapter version, not the engine's
