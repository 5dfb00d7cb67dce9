"""Build a tiny randomly initialised HF model (config.json + safetensors + tokenizer).

python tools/make_tiny_model.py models/tiny --architecture qwen2 --hidden-size 128
python tools/make_tiny_model.py models/qwen-shaped --architecture qwen2 --tokenizer bpe   # no BOS, ChatML
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from rlhpc.errors import ConfigError
from rlhpc.logs import setup_logging
from rlhpc.model import TinyModelConfig, build_tiny_model


def build_parser() -> argparse.ArgumentParser:
    """This command's options; the docs test checks the commands the docs show against it."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    for f in dataclasses.fields(TinyModelConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    setup_logging()
    if args.out_dir.exists():
        logging.error("%s already exists; choose another directory or remove it", args.out_dir)
        return 2
    try:
        cfg = TinyModelConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyModelConfig)})
    except ConfigError as e:
        logging.error("%s", e)
        return 2
    build_tiny_model(args.out_dir, cfg)
    return 0
