#!/usr/bin/env python3
"""Build a tiny randomly initialised HF model (``rlhpc-make-tiny-model``; see rlhpc/cli/make_tiny_model.py)."""

from rlhpc.cli.make_tiny_model import main

if __name__ == "__main__":
    raise SystemExit(main())
