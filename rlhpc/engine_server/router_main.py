"""``python -m rlhpc.engine_server.router_main --api-key-file PATH ROUTER_ARGS...``: sglang_router with
the engine key read from a file, never on a command line.

sglang_router takes its key only as ``--api-key KEY``, and a process's command line is readable
by every user of the node (``ps``). This runs sglang_router's own entry point in this process
with the key added to ``sys.argv`` here, after exec: ``/proc/PID/cmdline`` keeps what we were
started with, the file's path.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from rlhpc.wire.engine_key import read_key

ROUTER_MODULE = "sglang_router.launch_router"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m rlhpc.engine_server.router_main", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument("--api-key-file", required=True, help="the file holding the engine key (0600)")
    args, router_args = p.parse_known_args(argv)
    if "--api-key" in router_args:
        p.error("pass the key as --api-key-file, not --api-key: command lines are visible to every user")
    sys.argv = [ROUTER_MODULE, *router_args, "--api-key", read_key(args.api_key_file)]
    runpy.run_module(ROUTER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
