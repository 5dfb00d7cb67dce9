#!/usr/bin/env python3
"""Plot a run's metrics.jsonl to a PNG (``rlhpc-plot``; see rlhpc/cli/plot_metrics.py or --help)."""

from rlhpc.cli.plot_metrics import main

if __name__ == "__main__":
    raise SystemExit(main())
