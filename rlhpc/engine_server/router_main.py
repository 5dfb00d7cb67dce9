"""``python -m rlhpc.engine_server.router_main [--api-key-file PATH] [--parent-pid PID] ROUTER_ARGS...``:
sglang_router with the engine key read from a file, never on a command line, and ended when the
process that started it (the driver) is gone.

sglang_router takes its key only as ``--api-key KEY``, and a process's command line is readable
by every user of the node (``ps``). This runs sglang_router's own entry point in this process
with the key added to ``sys.argv`` here, after exec: ``/proc/PID/cmdline`` keeps what we were
started with, the file's path.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time

from rlhpc.wire.engine_key import read_key

ROUTER_MODULE = "sglang_router.launch_router"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m rlhpc.engine_server.router_main", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument("--api-key-file", default=None, help="the file holding the engine key (0600)")
    p.add_argument("--parent-pid", type=int, default=None, help="end the router when this process is gone")
    args, router_args = p.parse_known_args(argv)
    if "--api-key" in router_args:
        p.error("pass the key as --api-key-file, not --api-key: command lines are visible to every user")
    if args.parent_pid is not None:
        watch(args.parent_pid)
    key = ["--api-key", read_key(args.api_key_file)] if args.api_key_file else []
    sys.argv = [ROUTER_MODULE, *router_args, *key]
    runpy.run_module(ROUTER_MODULE, run_name="__main__", alter_sys=True)


def watch(parent_pid: int, period_s: float = 0.5) -> None:
    """A forked child that ends this process (the router) once ``parent_pid`` is gone. The router
    runs in a session of its own (so that stopping it ends what it started), which a SIGKILL of
    the driver's group does not reach; and it holds the GIL while it serves, so no thread of
    this process could watch. The child is in the router's group: stopping the router ends it."""
    import psutil

    router = os.getpid()
    try:
        born = psutil.Process(parent_pid).create_time()  # a later process given the same pid is not it
    except psutil.NoSuchProcess:
        sys.exit(f"the parent process {parent_pid} is already gone")
    if os.fork() != 0:
        return
    try:
        while os.getppid() == router:  # else the router ended and this was handed to init
            time.sleep(period_s)
            try:
                alive = psutil.Process(parent_pid).create_time() == born
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                os.kill(router, signal.SIGTERM)
                time.sleep(5)
                if os.getppid() == router:
                    os.kill(router, signal.SIGKILL)
                break
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
