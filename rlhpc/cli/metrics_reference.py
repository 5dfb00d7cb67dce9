"""Write docs/reference/metrics.md from the list of metrics in rlhpc/metric_names.py.

    python -m rlhpc.cli.metrics_reference            # rewrite docs/reference/metrics.md
    python -m rlhpc.cli.metrics_reference --check    # exit 1 if the committed file is stale

Every metric rlhpc logs is in that list, by its name and what it means; ``MetricsLogger`` warns
of a name that is not, and the tests fail on one. A unit test compares the committed page with
``render()``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhpc.metric_names import METRICS, Metric

OUT = Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md"
COMMAND = "python -m rlhpc.cli.metrics_reference"

INTRO = """\
`RUN_DIR/metrics.jsonl` holds one JSON object per rollout and per evaluation: `{"kind",
"rollout_id", ...}`, `kind` being `rollout` or `eval`, `rollout_id` the rollout's id (counted from
0, as its checkpoint `rollout_000003` and `rlhpc-eval --checkpoint rollout_3` count it; the eval
before any training is `-1`). Each metric has one name everywhere: in the file, in wandb (offline by
default, `logging.wandb_mode`; step = `rollout_id + 1`), in `rlhpc-plot`'s panels and legends, and
on this page. The console shows a few of them per line (`reward`, `len` for `response_len`,
`gnorm` for `grad_norm`, `step`/`gen`/`train`/`sync` for `time/*`, and each eval set's mean by its
name). A torn last line (a job killed mid-write) is dropped with a warning; a bad line anywhere else
is an error naming the line. `python tools/plot_metrics.py RUN_DIR` (or `rlhpc-plot`) draws them;
see [the run dir](run-dir.md) for the files beside it.

In a name, `{set}` is an eval set's name (`eval.sets.NAME`), `{k}` and `{n}` numbers, `{part}` a
part of a reward that returns a dict, `{stat}` a statistic's name."""


def _row(m: Metric) -> str:
    see = f"[see]({m.see})" if m.see else ""
    meaning = m.meaning.replace("|", "\\|")
    return f"| `{m.name}` | {meaning} | {see} |"


def render() -> str:
    out = ["# Metrics", "", f"<!-- Generated from rlhpc/metric_names.py by `{COMMAND}`; do not edit by hand. -->", ""]
    out += [INTRO, ""]
    for kind, title, doc in (
        ("rollout", "Rollout records", "One per rollout trained (`kind: rollout`)."),
        (
            "eval",
            "Eval records",
            "One per evaluation (`kind: eval`), every eval set's metrics in it "
            "([evaluation](../guides/evaluation.md)): the default set's (`data.eval_file`, or the task's own "
            "eval rows) under `eval/`, each named set's under `eval/NAME/`. `rlhpc-eval` prints and writes "
            "them under the same names.",
        ),
    ):
        out += [f"## {title}", "", doc, "", "| metric | meaning | |", "|---|---|---|"]
        out += [_row(m) for m in METRICS if m.kind == kind]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with the committed file; write nothing")
    p.add_argument("--out", type=Path, default=OUT, help=f"where to write (default: {OUT})")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
