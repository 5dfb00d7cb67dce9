"""Training side: ``ActorGroup`` (group.py, driver-side fan-out) over one rank per actor slot.

``rank.py`` is what every rank shares (rendezvous, the GRPO train step, weight sync);
``worker.py`` (PyTorch DDP) and ``megatron/worker.py`` (megatron-core TP x DP) are the
backends; ``spec.py`` is the part of the run config they are built from.
"""
