#!/usr/bin/env python3
"""Print one rollout dump (``rlhpc-show-rollout``; see rlhpc/cli/show_rollout.py or --help)."""

from rlhpc.cli.show_rollout import main

if __name__ == "__main__":
    raise SystemExit(main())
