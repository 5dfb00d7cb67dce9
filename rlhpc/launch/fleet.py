"""Many LoRA runs, one fleet (``--shared-fleet``): a sweep's tasks share one set of engines.

The sweep's owner (locally, the submitting command) checks that the tasks can share engines
(``fleet_settings``), starts the engines once (``Fleet``, the engine servers outside any run's
Ray), writes the fleet file each task's ``rollout.fleet`` names, runs every task at once, and
unloads each task's adapter when the task ends, finished or failed: the others go on. Each
task stays an ordinary run (its own driver, Ray, actor, checkpoints, resume and metrics); it
attaches to the fleet instead of starting engines and serves its adapter under its run dir's
name (``rlhpc.rollout.engines.fleet``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlhpc.cluster.layout import plan_layout
from rlhpc.config import Config, config_to_dict
from rlhpc.errors import ConfigError, RlhpcError
from rlhpc.run_dir import SweepDir
from rlhpc.wire import lora as L

if TYPE_CHECKING:
    import submitit

    from rlhpc.engine_server.host import EngineServer
    from rlhpc.launch.sweep import SweepTask
    from rlhpc.rollout.engines.fleet import FleetFile
    from rlhpc.wire.client import EngineClient

log = logging.getLogger(__name__)

# What the engines are started with: equal in every task of a shared fleet
FLEET_KEYS = ("model", "rollout.backend", "rollout.sglang", "deterministic", "algo.routing_replay")
POLL_S = 0.5


def _value(cfg: Config, key: str) -> object:
    d: object = config_to_dict(cfg)
    for part in key.split("."):
        d = d[part]  # type: ignore[index]
    return d


def fleet_settings(tasks: list[SweepTask]) -> L.LoraServing:
    """What the fleet serves the tasks' adapters with (room for the largest rank, every module
    any task adapts, one adapter per task and the base model in a batch); refused, naming the
    task and the key, when the tasks cannot share engines. Each task's own checks
    (``rollout.fleet``: LoRA with adapter push, the synchronous loop) ran when its config loaded."""
    first = tasks[0]
    if first.cfg.rollout.backend != "cpu":
        raise ConfigError(
            f"--shared-fleet with rollout.backend = {first.cfg.rollout.backend}: the fleet's owner starts "
            "CPU engines only so far",
            "drop --shared-fleet (each task starts its own SGLang engines), or set rollout.backend: cpu",
        )
    engines = _num_engines(first.cfg)
    for t in tasks[1:]:
        for key in FLEET_KEYS:
            if _value(t.cfg, key) != _value(first.cfg, key):
                raise ConfigError(
                    f"--shared-fleet: sweep task {t.index} ({t.describe()}) has another {key} than task "
                    f"{first.index} ({_value(t.cfg, key)!r} against {_value(first.cfg, key)!r}); the tasks share "
                    "the engines, which are started once",
                    "sweep only keys the engines do not see (actor.lr, actor.lora.*, seed, data.*), or drop --shared-fleet",
                )
        if _num_engines(t.cfg) != engines:
            raise ConfigError(
                f"--shared-fleet: sweep task {t.index} ({t.describe()}) plans {_num_engines(t.cfg)} engine(s), "
                f"task {first.index} {engines}",
                "sweep no cluster.* key with --shared-fleet (the tasks share one set of engines)",
            )
    loras = [t.cfg.actor.lora for t in tasks]
    if any(lora.target_modules == L.ALL_LINEAR for lora in loras):
        targets: tuple[str, ...] = (L.ALL,)
    else:
        targets = tuple(sorted({m for lora in loras for m in lora.target_modules}))
    return L.LoraServing(
        max_lora_rank=max(lora.rank for lora in loras),
        target_modules=targets,
        # SGLang counts the base model as one; more than its default only for more tasks
        max_loras_per_batch=max(L.DEFAULT_MAX_LORAS_PER_BATCH, len(tasks) + 1),
    )


def _num_engines(cfg: Config) -> int:
    return len(plan_layout(cfg.cluster, cfg.reward_model, cfg.teacher).engine_slots)


class Fleet:
    """The engines of a shared fleet, on this machine: started by ``start``, stopped by ``stop``."""

    def __init__(self, sweep: SweepDir, cfg: Config, serving: L.LoraServing):
        self.sweep, self.cfg, self.serving = sweep, cfg, serving
        self.servers: list[EngineServer] = []
        self.clients: list[EngineClient] = []

    def start(self) -> FleetFile:
        # late: the submitting process imports these (ray, torch) only to run a shared fleet here
        from rlhpc.config import startup_timeout_s
        from rlhpc.engine_server.host import EngineServer
        from rlhpc.model import weight_bytes
        from rlhpc.rollout.engines.fleet import FleetFile
        from rlhpc.run_dir import tiny_model
        from rlhpc.wire.client import EngineClient
        from rlhpc.wire.engine_key import new_key

        cfg, sweep = self.cfg, self.sweep
        model_path = cfg.model.path
        if model_path is None:  # a tiny model: the same bytes each task builds (deterministic)
            tiny_model(sweep.fleet_model, cfg.model.tiny)
            model_path = str(sweep.fleet_model)
        api_key = new_key(sweep.fleet_key)
        timeout = startup_timeout_s(cfg.rollout, weight_bytes(model_path))
        for e in range(_num_engines(cfg)):
            self.servers.append(
                EngineServer(
                    model_path,
                    str(sweep.fleet_logs),
                    e,
                    timeout,
                    key_file=str(sweep.fleet_key),
                    host="127.0.0.1",
                    deterministic=cfg.deterministic,
                    lora=self.serving,
                    routed_experts=cfg.algo.routing_replay,
                )  # fmt: skip
            )
        urls = [s.url() for s in self.servers]
        self.clients = [EngineClient(u, api_key=api_key) for u in urls]
        fleet = FleetFile(tuple(urls), tuple(s.log_file() for s in self.servers), str(sweep.fleet_key))
        fleet.write(sweep.fleet_file)
        log.info(
            "shared fleet up: %d engine(s) serving up to %d adapters of rank <= %d (%s), log %s",
            len(urls), self.serving.max_loras_per_batch - 1, self.serving.max_lora_rank, sweep.fleet_file,
            sweep.fleet_logs,
        )  # fmt: skip
        return fleet

    def unload(self, name: str) -> None:
        """A task ended: its adapter leaves every engine (one never pushed, or gone: nothing to do)."""
        for c in self.clients:
            try:
                c.unload_lora_adapter(name)
            except RlhpcError as e:
                if L.not_loaded(name) not in e.problem:
                    log.warning("unloading adapter %s from %s: %s", name, c.base_url, e.problem)
        log.info("adapter %s unloaded from the shared fleet", name)

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.servers:
            s.shutdown()
        self.sweep.fleet_file.unlink(missing_ok=True)  # no engines behind it any more


def run_shared(
    sweep: SweepDir,
    tasks: list[SweepTask],
    run_one: Callable[[SweepTask], submitit.Job],
    follow: Callable[[SweepTask, submitit.Job], int],
) -> list[tuple[SweepTask, str]]:
    """The unfinished tasks all at once on one fleet; a task that fails does not stop the others
    (its adapter is unloaded as it ends). Returns the failures, with why."""
    from rlhpc.launch.sweep import unfinished  # the sweep imports this module
    from rlhpc.rollout.engines.fleet import adapter_name  # late, as Fleet.start's

    sweep.write_spec([list(t.overrides) for t in tasks])
    pending = unfinished(tasks)
    if not pending:
        return []
    fleet = Fleet(sweep, pending[0].cfg, fleet_settings(pending))
    running: dict[int, tuple[SweepTask, submitit.Job]] = {}
    failed: list[tuple[SweepTask, str]] = []
    try:
        fleet.start()
        for t in pending:
            log.info("sweep task %d (%s) on the shared fleet: %s", t.index, t.describe(), t.run)
            running[t.index] = (t, run_one(t))
        while running:
            for i, (t, job) in list(running.items()):
                if not job.done():
                    continue
                del running[i]
                try:
                    follow(t, job)  # its output, and its failure raised
                except RlhpcError as e:
                    log.error("sweep task %d failed: %s", t.index, e)
                    failed.append((t, e.problem))
                fleet.unload(adapter_name(t.run.path))
            time.sleep(POLL_S)
    finally:
        for _, job in running.values():  # left early (Ctrl-C, an error here): no task outlives its engines
            job.cancel(check=False)
        fleet.stop()
    return sorted(failed, key=lambda f: f[0].index)
