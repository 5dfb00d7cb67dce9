"""A CPU rollout engine that speaks SGLang's native HTTP protocol.

SGLang cannot run on CPU-only machines (CI), so this server stands in for it with the same
routes, request field names and response shapes (SGLang 0.5.23's ``http_server.py`` /
``io_struct.py``), backed by a Hugging Face model and ``rlhpc.engine_server.cpu.sampling.sample``.
The one client, ``rlhpc.wire.client.EngineClient``, drives both.

    python -m rlhpc.engine_server.cpu --model-path DIR --host HOST --port 0 --ready-file FILE

With ``--port 0`` the server binds a free port itself and writes ``{"host", "port", "pid"}`` to
the ready file (temp + rename) once it answers HTTP, so callers never race for ports.
``--device cuda`` puts the model on cuda:0 (GPU checks); weight update groups may then use
NCCL, and colocated senders may pass CUDA tensors by IPC handle.

Modules: ``requests`` (SGLang request bodies -> engine work), ``engine`` (model, sampling,
weights, memory), ``app`` (the HTTP routes), ``server`` (the process; ``__main__`` runs it).
Routes and field names come from ``rlhpc.wire.protocol``.
"""
