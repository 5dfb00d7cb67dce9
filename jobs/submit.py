#!/usr/bin/env python3
"""Submit an rlhpc training run (``rlhpc-submit``; see rlhpc/cli/submit.py or --help)."""

from rlhpc.cli.submit import main

if __name__ == "__main__":
    raise SystemExit(main())
