"""Logging set-up shared by every entry point: rich console output, progress bars in a TTY."""

from __future__ import annotations

import logging
import os
import sys
import warnings

from rich.console import Console
from rich.logging import RichHandler

# Set by jobs/submit.py when it streams a local job to a terminal, so the job's bars render there.
FORCE_TERMINAL_ENV = "RLHPC_FORCE_TERMINAL"


def setup_logging(level: str = "INFO") -> Console:
    force = os.environ.get(FORCE_TERMINAL_ENV) == "1"
    # A log file (Slurm, submitit) gets long lines rather than rich wrapping at 80 columns.
    console = Console(
        force_terminal=True if force else None, stderr=False, width=120 if force or not sys.stdout.isatty() else None
    )
    logging.basicConfig(
        level=level.upper(),
        format="%(message)s",
        datefmt="%H:%M:%S",
        handlers=[RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False)],
        force=True,
    )
    # Third-party chatter that says nothing to an RL user.
    for noisy in ("urllib3", "filelock", "httpx", "wandb"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("submitit").propagate = False  # it has its own handler; avoid every line twice
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    # transformers' own chatter off, without importing it here (it imports torch: seconds on a
    # login node that may need neither): read at its import, also by the processes started from
    # here; its progress bars are turned off where models are loaded (rlhpc.model).
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    return console
