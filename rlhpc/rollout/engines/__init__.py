"""The engine pool: a group of engines on their GPUs, kept alive and (trained ones) on the current weights.

It lives in the driver process and talks to every engine over SGLang's HTTP protocol, so the
same code drives the CPU engine server here and SGLang servers on a GPU cluster. It sends the
/generate requests it is handed (``rlhpc.rollout.generation`` makes them) and knows nothing of
prompts, rewards or tokenizers.

Its parts, each readable alone: ``engine_set`` (the engines' processes, clients, router and
bounded restarts), ``health`` (the four states of an engine: serving, down, restarted, lost with
its node; silence) and ``fanout`` (``send``, abort, affinity, sending again). ``EnginePool``
(``pool``) puts them together; ``EnginePool.start`` starts the processes, its constructor only
composes parts. The pool holds no weights: the trained engines' are kept by their one owner,
``rlhpc.rollout.weight_sync``, which the driver builds; the reward model's and the teacher's
engines (``frozen``) serve the model on disk.

An engine whose server dies or stops answering /health is restarted (at most
``rollout.max_engine_restarts`` times) and reported (``report_restarts``) to the weight owner,
which brings it back to the current weights: the weight-sync channel is opened again over all
engines, since they share one group, and the current version is pushed.
Generation requests that failed on it are sent again; every sample has its own seed, so in a
``deterministic: true`` run (engines started with --enable-deterministic-inference, which SGLang
needs to honour a seed) they give the same tokens.

/health is asked only after a failure (a request or a push that an engine did not answer),
never before every generation, evaluation or push. SGLang's own /health is a generation, held
20 s and answered 503 on a paused engine; every engine gets it switched off (``engine_env``). A dead server refuses connections at once, so its death shows
as failed requests; a hung one, as requests that time out (a /generate after
``rollout.generate_timeout_s``, which grows with its max_new_tokens).

Restarts wait for a safe moment. A restarted engine must get the weights the others hold, and
only the actor has them, and only while it is not training. Generation in the async pipeline
runs beside training (``restarts_deferred``): an engine it finds dead is only marked down, its
requests go to the healthy engines (same weights, same tokens), and the restart waits for the
next gap, where the thread that pushes weights pushes (``WeightSync.push``) or calls ``ensure_engines``.
With no healthy engine left such a generation raises ``EnginesDown`` for the schedule.
The router (``rollout.sglang.router``, CPU engines too) is restarted when it dies, at most
``rollout.max_engine_restarts`` times as well, and started again over the engines serving
whenever they change (a restart's new URL, a node lost or back); until then the engines are
sent to directly.

Every engine route requires the job's engine key (``rlhpc.wire.engine_key``): a fresh one is
written to ``key_file`` when the pool starts, the engines, the router and the weight source get
the file (its path), and the pool's clients send it. Engines listen on loopback when every slot
of the placement is on the driver's node (nobody else needs to reach them), else on the node's IP.
"""

from rlhpc.rollout.engines.engine_set import COLOCATED_ENGINE_GPU, EngineSet
from rlhpc.rollout.engines.health import NODE_CHECK_S, SILENT_S, Health, NodeLost
from rlhpc.rollout.engines.pool import EnginePool
from rlhpc.wire.request import EnginesDown

__all__ = [
    "COLOCATED_ENGINE_GPU", "NODE_CHECK_S", "SILENT_S", "EnginePool", "EngineSet", "EnginesDown", "Health", "NodeLost",
]  # fmt: skip
