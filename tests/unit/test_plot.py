"""rlhpc-plot draws every panel a user watches, from this run's metrics or an older run's."""

import json

import pytest

from rlhpc.cli import plot_metrics
from rlhpc.run_dir import RunDir


@pytest.mark.parametrize("newer", [True, False], ids=["with-entropy-and-kl", "an-older-run"])
def test_the_plot_has_entropy_and_kl_panels(tmp_path, newer):
    run = RunDir(tmp_path)
    records = [{"kind": "eval", "rollout_id": -1, "reward": 0.1, "response_len": 1.0}]
    for i in range(4):
        r = {"kind": "rollout", "rollout_id": i, "reward": 0.1 * i, "response_len": 1.0, "loss": 0.0, "time/step": 0.1}
        records.append(r | ({"entropy": 3.0 - i, "kl": 0.01 * i} if newer else {}))
    run.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    fig = plot_metrics.figure(run)
    panels = {ax.get_title().split(" ")[0].removesuffix(":"): ax for ax in fig.axes}
    # each panel named by its metric, as metrics.jsonl, the console and wandb name it
    assert {"reward", "entropy", "kl", "loss", "time/step", "response_len"} <= set(panels)
    # an eval record of an older run (logged as "reward") is read under today's name
    assert [line.get_label() for line in panels["reward"].get_lines()] == ["reward (train)", "eval/reward"]
    assert [len(line.get_xdata()) for line in panels["entropy"].get_lines()] == [4 if newer else 0]
    assert plot_metrics.plot(run, tmp_path / "metrics.png").stat().st_size > 10_000  # a PNG of them
