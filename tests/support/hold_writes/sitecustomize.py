"""Holds every actor rank's checkpoint file write while the file RLHPC_TEST_HOLD_WRITES exists.

Put this directory on PYTHONPATH (every process of a job then imports it at start, Ray's
workers included). The first held write creates ``<that file>.held``; removing the file lets
the writes go on. With the variable unset this does nothing.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

GATE = os.environ.get("RLHPC_TEST_HOLD_WRITES")
MODULE = "rlhpc.actor.snapshot"


class _HoldWrites(importlib.abc.MetaPathFinder):
    """Patches ``FlatTensors.write`` as the module is first imported."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # find the real module, once
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            write = module.FlatTensors.write

            def held(self, path):
                if os.path.exists(GATE):
                    open(f"{GATE}.held", "w").close()
                    while os.path.exists(GATE):
                        time.sleep(0.05)
                return write(self, path)

            module.FlatTensors.write = held

        spec.loader.exec_module = exec_module
        return spec


if GATE:
    sys.meta_path.insert(0, _HoldWrites())
