"""Tools for developing rlhpc, importable by the tests and benchmarks that drive them.

``minicluster`` (a real Slurm cluster on one machine; stdlib only, runs as root) and ``chaos``
(the fault-injection soak; it starts jobs through the checkout's ``jobs/submit.py``). Their
command lines are the thin scripts ``tools/minicluster.py`` and ``tools/chaos.py``.
"""
