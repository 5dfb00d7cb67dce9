#!/usr/bin/env python3
"""The fault-injection soak (``python tools/chaos.py --trials N``; see rlhpc/devtools/chaos.py or --help)."""

import sys
from pathlib import Path

# The checkout beside this script, installed or not: the soak runs its jobs/submit.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhpc.devtools.chaos import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
