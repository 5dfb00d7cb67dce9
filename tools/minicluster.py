#!/usr/bin/env python3
"""A real Slurm cluster on one machine (``python tools/minicluster.py up|status|down|kill-node|revive-node``;
see rlhpc/devtools/minicluster.py or --help)."""

import sys
from pathlib import Path

# The checkout beside this script, installed or not: the minicluster runs as root, often under a
# python without rlhpc installed, and needs nothing but the standard library.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhpc.devtools.minicluster import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
