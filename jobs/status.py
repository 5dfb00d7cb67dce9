#!/usr/bin/env python3
"""Where a run stands (``rlhpc-status``; see rlhpc/cli/status.py or --help)."""

from rlhpc.cli.status import main

if __name__ == "__main__":
    raise SystemExit(main())
