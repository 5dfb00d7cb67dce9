#!/usr/bin/env python3
"""Checkpoint cost: rlhpc's save/load path against plain file I/O, and resume against a fresh start.

1. Save/load throughput. One actor rank (a real ``TrainWorker`` on a local Ray) holds a
   tiny-architecture model made big enough that I/O dominates, trained for one step so AdamW
   has state. Saves are timed as the driver does them (``CheckpointManager.save_async`` with
   the ranks' ``snapshot`` and ``write_snapshot``): blocking (``checkpoint.async_save: false``:
   snapshot, write, commit, all waited for) and asynchronous (the loop waits for the snapshot
   only; the write and the commit run on a background thread, timed until ``wait`` returns).
   The load is ``ActorGroup.load`` from a cold page cache (every file of the checkpoint is
   dropped from it with ``posix_fadvise(DONTNEED)`` first), into the rank that trained and
   again into ranks just started, as a resume loads. Beside it, in the same parent
   directory, the same number of bytes is written from memory to a new file (8 MiB
   ``os.write`` chunks + fsync; earlier files kept, as retained checkpoints are) and read back
   cold into a new buffer of its size (also printed: streamed through one reused 8 MiB buffer,
   which keeps nothing of what it reads).
2. Job start to first rollout. The real job runs twice through ``jobs/submit.py --cluster
   local``: fresh, then resumed from that run's last checkpoint. Measured from the
   submit.py process start to the arrival of the first new rollout record in metrics.jsonl.
3. The same resume with a staged start (``cluster.stage_dir``) on a copy of that run dir.

The last line is one JSON object of ratios:

- ``save_block_fraction``: time the loop is blocked by an asynchronous save / a blocking save.
- ``save_vs_write``: throughput of the asynchronous save's background part (write, fsync,
  checksums, commit) / a plain write + fsync of the same bytes.
- ``load_vs_read``: throughput of a checkpoint load / a plain read of the same bytes, both cold.
- ``fresh_load_vs_read``: the same for a resume's load, into a rank just started (no optimizer
  state yet: its memory is faulted in by the load).
- ``resume_over_fresh``: job start to first rollout, resumed / fresh (part 2).
- ``resume_staged_over_resume``: the same resume with ``cluster.stage_dir`` / without (part 3:
  a copy of the interrupted run dir, resumed with the model and checkpoint staged first).

    python tools/bench/checkpoint.py
    python tools/bench/checkpoint.py --repeats 5 --dir /scratch/me --job-model bench
    python tools/bench/checkpoint.py --backend megatron --skip resume
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy

REPO = Path(__file__).resolve().parents[2]

log = logging.getLogger("bench.checkpoint")

CHUNK = 8 * 2**20
SUBMIT = [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", "local"]
POLL_S = 0.025


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def filesystem_of(path: Path) -> str:
    """'<device> (<type>)' of the mount holding ``path``, from /proc/mounts (Linux)."""
    best, found = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mount, fstype = line.split()[:3]
            if str(path).startswith(mount) and len(mount) >= len(best):
                best, found = mount, f"{dev} ({fstype}) on {mount}"
    except OSError:
        pass
    return found


# ---------------------------------------------------------------- plain I/O


def plain_write(path: Path, data: memoryview) -> float:
    """``data`` into a new file (8 MiB writes + fsync). Earlier files stay, as retained checkpoints do
    (writing over a just-deleted file is faster on ext4, and no checkpoint gets that)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, len(data), CHUNK):
            chunk = data[start : start + CHUNK]
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def drop_cached(root: Path) -> None:
    """Drop ``root``'s files (or the file ``root``) from the page cache: the next read comes from disk.
    Their pages are clean (fsynced), so the kernel can let them go."""
    for path in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(path: Path, cold: bool = False, stream: bool = False) -> float:
    """Read the whole file into a new buffer of its size, as a loader must hold what it reads
    (``stream``: 8 MiB reads into one reused buffer, the bytes dropped as they come)."""
    if cold:
        drop_cached(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        if stream:
            buf = bytearray(CHUNK)
            while f.readinto(buf):
                pass
        else:
            # numpy.empty: memory as a loader gets it (bytearray would zero it first: twice the work)
            view = memoryview(numpy.empty(os.fstat(f.fileno()).st_size, dtype=numpy.uint8))
            while view:
                view = view[f.readinto(view) :]
    return time.perf_counter() - t0


# ---------------------------------------------------------------- part 1: save/load


def synthetic_batch(n: int, vocab: int, seed: int = 0):
    import torch

    from rlhpc.batch import RolloutBatch

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 8))] for _ in range(n)]
    responses = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))] for _ in range(n)]
    logprobs = [[-rng.random() * 3 for _ in r] for r in responses]
    rewards = torch.tensor([float(rng.random() > 0.5) for _ in range(n)])
    advantages = torch.tensor([rng.uniform(-1.5, 1.5) for _ in range(n)])
    return RolloutBatch(prompts, responses, logprobs, rewards, advantages, group_size=2)


def bench_save_load(work: Path, tiny, repeats: int, backend: str) -> dict:
    import ray

    from rlhpc.actor.group import ActorGroup, ActorSpec
    from rlhpc.checkpoint import CheckpointManager
    from rlhpc.cluster.placement import create_placement
    from rlhpc.config import Config
    from rlhpc.model import build_tiny_model, load_tokenizer

    model_path = str(build_tiny_model(work / "base_model", tiny))
    cfg = Config()
    cfg.logging.level = "WARNING"
    cfg.actor.backend = backend
    # keep_last > saves: no retention pruning inside the timed commits, so every repeat does the same work
    manager = CheckpointManager(work / "checkpoints", keep_last=2 * repeats + 3)
    ray_tmp = tempfile.mkdtemp(prefix="rlhpc-bench-ray-")
    ray.init(
        num_cpus=4,
        num_gpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        _temp_dir=ray_tmp,
    )
    placement = group = None

    def start_rank() -> ActorGroup:
        return ActorGroup(ActorSpec.from_config(cfg), model_path, placement, (0,), cfg.cluster.colocate)

    try:
        placement = create_placement(1)
        group = start_rank()
        group.load(None)
        group.train(0, synthetic_batch(16, len(load_tokenizer(model_path))))  # AdamW state now exists
        trained = group.fingerprints()[0]

        def snapshot(staging: Path):
            group.snapshot(str(staging))
            return group.write_snapshot

        def save(rollout_id: int, background: bool) -> tuple[float, float, Path]:
            """(seconds the caller was blocked, seconds until committed, checkpoint)"""
            t0 = time.perf_counter()
            manager.save_async(rollout_id, snapshot, {"weight_version": rollout_id + 1}, background=background)
            blocked = time.perf_counter() - t0
            ck = manager.wait()
            return blocked, time.perf_counter() - t0, ck.path

        # One untimed save of each kind first: the worker's first save pays one-off imports and allocations.
        save(0, False)
        ckpt = save(1, True)[2]
        nbytes = dir_bytes(ckpt)
        files = sorted((str(p.relative_to(ckpt)), p.stat().st_size) for p in ckpt.rglob("*") if p.is_file())
        data = memoryview(os.urandom(nbytes))  # incompressible, in case the filesystem compresses
        plain = work / "plain-warmup.bin"
        plain_write(plain, data)  # untimed warm-up, as on the rlhpc side

        # Each turn times rlhpc's side and then the plain one, so a machine whose speed drifts
        # (a neighbour's load, this VM's disk) moves both alike; ratios are medians over turns.
        t: dict[str, list[float]] = collections.defaultdict(list)
        for i in range(repeats):
            t["blocking save"].append(save(2 + 2 * i, False)[1])
            blocked, committed, ckpt = save(3 + 2 * i, True)
            t["async save, loop blocked"].append(blocked)
            t["async save, to commit"].append(committed)
            t["write"].append(plain_write(work / f"plain-{i}.bin", data))  # earlier files kept, as checkpoints are

        def load(cold: bool) -> float:
            if cold:
                drop_cached(ckpt)
            t0 = time.perf_counter()
            group.load(str(ckpt))
            return time.perf_counter() - t0

        load(False)  # untimed, as for save
        plain_read(plain)
        for _ in range(repeats):
            t["load"].append(load(True))
            t["read"].append(plain_read(plain, cold=True))
            t["read, streamed"].append(plain_read(plain, cold=True, stream=True))
            t["load, warm"].append(load(False))
            t["read, warm"].append(plain_read(plain))
        restored_ok = group.fingerprints()[0] == trained
        group.shutdown()
        group = None

        def fresh_load() -> float:
            """A resume's load: into a rank just started (no optimizer state yet, nothing faulted in)."""
            fresh = start_rank()
            try:
                drop_cached(ckpt)
                t0 = time.perf_counter()
                fresh.load(str(ckpt))
                seconds = time.perf_counter() - t0
                if fresh.fingerprints()[0] != trained:
                    raise RuntimeError("a fresh rank restored other weights than the saved ones")
                return seconds
            finally:
                fresh.shutdown()

        for _ in range(repeats):
            t["load, fresh rank"].append(fresh_load())
            t["read, beside fresh loads"].append(plain_read(plain, cold=True))
    finally:
        if group is not None:
            group.shutdown()
        if placement is not None:
            placement.remove()
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        for p in work.glob("plain-*.bin"):
            p.unlink()

    def per_turn(num: str, den: str) -> float:
        return statistics.median(a / b for a, b in zip(t[num], t[den]))

    return {
        "bytes": nbytes,
        "files": files,
        "times": dict(t),
        "restored_ok": restored_ok,
        "ratios": {
            "save_block_fraction": per_turn("async save, loop blocked", "blocking save"),
            "save_vs_write": per_turn("write", "async save, to commit"),
            "load_vs_read": per_turn("read", "load"),
            "load_vs_streamed_read": per_turn("read, streamed", "load"),
            "fresh_load_vs_read": per_turn("read, beside fresh loads", "load, fresh rank"),
            "warm_load_vs_read": per_turn("read, warm", "load, warm"),
        },
    }


# ---------------------------------------------------------------- part 2: job start -> first rollout


def has_rollout(metrics: Path, first_id: int) -> bool:
    """Whether metrics.jsonl holds a rollout record with id >= ``first_id``."""
    try:
        # rewind replaces the file atomically on resume, so it is re-read whole (it is small)
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return False
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line caught half-written: seen on the next poll
            continue
        if r.get("kind") == "rollout" and r["rollout_id"] >= first_id:
            return True
    return False


def timed_job(run: Path, overrides: list[str], first_id: int, out: Path, timeout_s: float) -> float:
    """Run submit.py to completion; seconds from its start to the first rollout record >= first_id."""
    metrics = run / "metrics.jsonl"
    args = [*SUBMIT, "--run-dir", str(run)]
    for o in overrides:
        args += ["--set", o]
    first: float | None = None
    with open(out, "wb") as f:
        t0 = time.time()
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            while True:
                done = proc.poll() is not None  # before the scan: a record written before exit is still seen
                if first is None and has_rollout(metrics, first_id):
                    first = time.time()
                if done:
                    break
                if time.time() > t0 + timeout_s:
                    raise TimeoutError(f"job in {run} still running after {timeout_s:.0f} s")
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the job, its Ray and engines
            proc.wait()
    if proc.returncode != 0 or first is None:
        tail = out.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"job in {run} exited {proc.returncode} (first rollout seen: {first is not None}):\n{tail}")
    return first - t0


def bench_resume(work: Path, first_leg: int, total: int, job_overrides: list[str], timeout_s: float) -> dict:
    """One fresh job in a new run dir, then the same run dir resumed; seconds to first rollout each."""
    work.mkdir(parents=True)
    run = work / "job"
    common = [
        "logging.wandb_mode=disabled",
        "logging.dump_rollouts=false",
        "logging.level=INFO",  # "resuming from ..." is an INFO line
        "eval.interval=null",
        "checkpoint.save_interval=1",
        *job_overrides,
    ]
    # Build the base model before any clock starts: the fresh job would otherwise pay for it and
    # the resumed one not (both submissions then only re-check the run dir).
    subprocess.run(
        [*SUBMIT, "--run-dir", str(run), "--prepare-only", *sum((["--set", o] for o in common), [])],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    fresh = timed_job(run, [f"rollout.num_rollout={first_leg}", *common], 0, work / "fresh.log", timeout_s)
    if "resuming from" in (work / "fresh.log").read_text(errors="replace"):
        raise RuntimeError(f"the fresh job in {run} resumed from something")
    # The first job ran to its end and saved its last rollout. Removing FINISHED leaves the run dir
    # as a job killed right after that save would (the tests' "pretend it was interrupted").
    (run / "FINISHED").unlink()
    twin = work / "job-staged"  # the same interrupted run, resumed with a staged start (part 3)
    shutil.copytree(run, twin, symlinks=True)
    resumed = timed_job(run, [f"rollout.num_rollout={total}", *common], first_leg, work / "resumed.log", timeout_s)
    stage = work / "node-local"
    staged = timed_job(
        twin, [f"rollout.num_rollout={total}", f"cluster.stage_dir={stage}", *common], first_leg,
        work / "staged.log", timeout_s,
    )  # fmt: skip
    from rlhpc.run_dir import RunDir
    from rlhpc.runtime.startup import read_startup

    stage_s = next(p["seconds"] for p in read_startup(RunDir(twin)) if p["phase"] == "stage")
    text = (work / "resumed.log").read_text(errors="replace")
    marker = f"resuming from rollout_{first_leg - 1:06d}"
    if marker not in text:
        raise RuntimeError(f"the second job did not resume ('{marker}' not in its log):\n{text[-3000:]}")
    ckpt_bytes = dir_bytes(next((run / "checkpoints").glob("rollout_*")))
    shutil.rmtree(work)  # one run dir at a time on disk
    return {"fresh": fresh, "resumed": resumed, "ckpt_bytes": ckpt_bytes, "staged": staged, "stage_s": stage_s}


# ---------------------------------------------------------------- main


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="timed saves, loads, writes and reads (median printed)")
    p.add_argument("--hidden", type=int, default=512, help="bench model hidden size")
    p.add_argument("--intermediate", type=int, default=1024, help="bench model MLP size")
    p.add_argument("--layers", type=int, default=3, help="bench model layers")
    p.add_argument("--backend", choices=("torch", "megatron"), default="torch", help="part 1 actor backend")
    p.add_argument("--dir", type=Path, default=None, help="parent of the temp dir (default: the system temp dir)")
    p.add_argument("--first-leg", type=int, default=3, help="rollouts of the fresh job (the resumed one continues)")
    p.add_argument("--total", type=int, default=6, help="rollouts of the resumed job, counting the first leg")
    p.add_argument(
        "--job-model",
        choices=("embedded", "bench"),
        default="embedded",
        help="part 2 model: the embedded tiny one, or the part 1 model (a checkpoint worth loading)",
    )
    p.add_argument("--job-repeats", type=int, default=3, help="fresh + resumed job pairs (median printed)")
    p.add_argument("--job-timeout", type=float, default=300.0, help="seconds per job before it is killed")
    p.add_argument("--skip", choices=("saveload", "resume"), action="append", default=[])
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.total <= args.first_leg:
        p.error("--total must exceed --first-leg")

    from rlhpc.model import TinyModelConfig

    tiny = TinyModelConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    work = Path(tempfile.mkdtemp(prefix="rlhpc-bench-ckpt-", dir=args.dir))
    started = time.time()
    ratios: dict[str, float] = {}
    try:
        import torch

        load1, _, _ = os.getloadavg()  # other work on the machine shows up in every number below
        gpus = torch.cuda.device_count()
        print(
            f"machine: {os.cpu_count()} cores, {f'{gpus} GPUs' if gpus else 'no GPU'}, {os.uname().sysname} "
            f"{os.uname().release}, python {sys.version.split()[0]}, load average {load1:.2f} at start"
        )
        print(f"disk   : {work} on {filesystem_of(work)}")
        if "saveload" not in args.skip:
            r = bench_save_load(work / "saveload", tiny, args.repeats, args.backend)
            n = r["bytes"]
            big = ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in r["files"] if size > 2**20)
            print(
                f"\n[1] actor checkpoint: llama hidden {tiny.hidden_size}, MLP {tiny.intermediate_size}, "
                f"{tiny.num_hidden_layers} layers, 1 {args.backend} rank, after one AdamW step"
            )
            print(f"    committed dir {n / 1e6:.1f} MB in {len(r['files'])} files ({big})")
            print(
                f"    {args.repeats} turns (each after one untimed warm-up), rlhpc's side then the plain one in "
                "each; times in s (median [all]); ratios: median over the turns"
            )
            rows = [
                ("blocking save (async_save: false)", "blocking save"),
                ("async save: the loop blocked", "async save, loop blocked"),
                ("async save: until committed", "async save, to commit"),
                ("plain write (8 MiB os.write+fsync)", "write"),
                ("rlhpc load, cold (ActorGroup.load)", "load"),
                ("plain read, cold (into a new buffer)", "read"),
                ("plain read, cold, 8 MiB reused buffer", "read, streamed"),
                ("rlhpc load, page cache", "load, warm"),
                ("plain read, page cache", "read, warm"),
                ("rlhpc load, cold, into a fresh rank", "load, fresh rank"),
                ("plain read, cold, beside those", "read, beside fresh loads"),
            ]
            for label, key in rows:
                all_ = r["times"][key]
                med = statistics.median(all_)
                print(f"    {label:<37} {mbps(n, med):8.1f} MB/s  {med:6.3f} s  [{' '.join(f'{t:.3f}' for t in all_)}]")
            q = r["ratios"]
            print(f"    loop blocked, async / blocking save   {q['save_block_fraction']:8.2f}")
            print(f"    async save / plain write              {q['save_vs_write']:8.2f}x throughput")
            print(f"    load / plain read, cold               {q['load_vs_read']:8.2f}x throughput")
            print(f"    load / streamed read, cold            {q['load_vs_streamed_read']:8.2f}x throughput")
            print(f"    load into a fresh rank / plain read   {q['fresh_load_vs_read']:8.2f}x throughput")
            print(f"    load / plain read, page cache         {q['warm_load_vs_read']:8.2f}x throughput")
            for key in ("save_block_fraction", "save_vs_write", "load_vs_read", "fresh_load_vs_read"):
                ratios[key] = q[key]
            print(f"    restored weights equal the saved ones: {'yes' if r['restored_ok'] else 'NO'}")
        if "resume" not in args.skip:
            job = []
            if args.job_model == "bench":
                job = [f"model.tiny.{k}={v}" for k, v in dataclasses.asdict(tiny).items()]
            # fresh and resumed alternate, so a neighbour's load on the machine hits both alike
            runs = [
                bench_resume(work / f"resume{i}", args.first_leg, args.total, job, args.job_timeout)
                for i in range(args.job_repeats)
            ]
            fresh = [r["fresh"] for r in runs]
            resumed = [r["resumed"] for r in runs]
            print(
                f"\n[2] jobs/submit.py --cluster local, {args.job_model} model (checkpoint "
                f"{runs[0]['ckpt_bytes'] / 1e6:.1f} MB), wandb off, no eval, save every rollout"
            )
            print(
                f"    submit.py start -> first new rollout record in metrics.jsonl (polled every "
                f"{POLL_S * 1000:.0f} ms), median of {args.job_repeats}"
            )
            legs = [
                ("fresh   (rollout 0, new run dir)", fresh),
                (f"resumed (rollout {args.first_leg}, from rollout_{args.first_leg - 1:06d})", resumed),
            ]
            for label, times in legs:
                print(f"    {label:<44} {statistics.median(times):7.2f} s  [{' '.join(f'{t:.2f}' for t in times)}]")
            ratios["resume_over_fresh"] = statistics.median(resumed) / statistics.median(fresh)
            print(f"    {'resumed / fresh':<44} {ratios['resume_over_fresh']:7.2f}x")
            print(
                f"    note: the fresh job runs {args.first_leg} rollouts and finishes; its FINISHED marker is "
                f"removed before the resume (as if killed after its last save)"
            )
            staged = [r["staged"] for r in runs]
            stage_s = [r["stage_s"] for r in runs]
            ratios["resume_staged_over_resume"] = statistics.median(staged) / statistics.median(resumed)
            print("\n[3] the same resume with a staged start (cluster.stage_dir: base model + checkpoint copied first)")
            print(
                f"    {'resumed, staged':<44} {statistics.median(staged):7.2f} s  [{' '.join(f'{t:.2f}' for t in staged)}]"
            )
            print(f"    {'  of which the stage phase':<44} {statistics.median(stage_s):7.2f} s")
            print(f"    {'resumed staged / resumed':<44} {ratios['resume_staged_over_resume']:7.2f}x")
            print(
                "    note: here the stage dir and the run dir share one disk, so staging is only a cost; on a "
                "cluster it turns every node's reads of the shared filesystem into one broadcast (sbcast) or "
                "parallel copies to local disks"
            )
        print(f"\ntotal bench time {time.time() - started:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: round(v, 3) for k, v in ratios.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
