"""Where a run's numbers go: a console line, ``metrics.jsonl``, wandb, and HDF5 rollout dumps.

A job killed while appending leaves a torn last line in ``metrics.jsonl``: readers skip it with
a warning, and the logger of the next job drops it (rewriting the file atomically) before it
appends. A bad line anywhere else is a real corruption and raises ``MetricsFileCorrupt``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from rlhpc.config import LoggingConfig
from rlhpc.errors import RlhpcError
from rlhpc.metric_names import eval_means, undocumented, upgrade_eval_record
from rlhpc.run_dir import RunDir
from rlhpc.util.files import disk_full, disk_space, write_atomic
from rlhpc.wire.images import ImageRef

if TYPE_CHECKING:  # status reads metrics on the login node, without torch
    from rlhpc.batch import RolloutBatch

log = logging.getLogger("rlhpc.metrics")


class MetricsFileCorrupt(RlhpcError):
    """A line other than the last of ``metrics.jsonl`` is not a JSON record."""


def _load(path: Path) -> tuple[list[dict], list[str], int | None]:
    """The records of ``path``, their lines, and the number of a torn last line (None if none).

    Only the last line can be half-written (the job killed during ``log``'s append): it is
    reported, not returned. A bad line before it is a real corruption and raises.
    """
    if not path.is_file():
        return [], [], None
    numbered = [(n, line) for n, line in enumerate(path.read_bytes().split(b"\n"), 1) if line.strip()]
    records, lines, torn = [], [], None
    for i, (n, raw) in enumerate(numbered):
        try:
            record = json.loads(raw)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if i == len(numbered) - 1:
                torn = n
                break
            raise MetricsFileCorrupt(
                f"{path} line {n} of {numbered[-1][0]} is corrupt ({e}): {raw[:80]!r}",
                "only a torn last line is repaired automatically; fix or delete that line by hand, then resubmit",
            ) from e
        records.append(record)
        lines.append(raw.decode())
    return records, lines, torn


def read_metrics(run: RunDir | str | Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl``, named as today (an eval record logged before its
    names began with ``eval/`` is read under today's names)."""
    path = RunDir.of(run).metrics_file
    records, _, torn = _load(path)
    if torn is not None:
        log.warning("%s line %d is torn (the job was killed while writing it); skipping it", path, torn)
    return [upgrade_eval_record(r) for r in records]


_ROLLOUT_LINE = (
    ("reward", "reward {:.3f}"),
    ("response_len", "len {:.1f}"),
    ("loss", "loss {:+.4f}"),
    ("kl", "kl {:.4f}"),
    ("grad_norm", "gnorm {:.3f}"),
    ("time/step", "step {:.2f}s"),
    ("time/generate", "(gen {:.2f}s"),
    ("time/train", "train {:.2f}s"),
    ("time/update_weights", "sync {:.2f}s)"),
)


def rollout_label(rollout_id: int, num_rollout: int) -> str:
    """How the console names rollout ``rollout_id``: by its id, as ``metrics.jsonl``, its
    checkpoint (``rollout_000003``) and rlhpc-eval do, with the count trained so far."""
    return f"rollout {rollout_id} ({rollout_id + 1}/{num_rollout})"


def _console_line(kind: str, rollout_id: int, num_rollout: int, values: dict) -> str:
    if kind == "eval":  # each set's mean reward, by its name (the default set's as "reward")
        when = "before rollout 0" if rollout_id < 0 else f"after rollout {rollout_id}"
        means = " ".join(f"{'reward' if n == 'eval' else n} {v:.3f}" for n, v in eval_means(values).items())
        length = values.get("eval/response_len")
        return f"eval {when} | {means}" + (f" len {length:.1f}" if length is not None else "")
    parts = [fmt.format(values[k]) for k, fmt in _ROLLOUT_LINE if k in values]
    return f"{rollout_label(rollout_id, num_rollout)} | " + " ".join(parts)


def _ragged(f: h5py.File, name: str, rows: list[list], dtype: type) -> None:
    data = np.empty(len(rows), dtype=object)  # filled one by one: equal lengths must stay ragged
    for i, row in enumerate(rows):
        data[i] = np.asarray(row, dtype=dtype)
    f.create_dataset(name, data=data, dtype=h5py.vlen_dtype(dtype))


class MetricsLogger:
    """One JSON object per rollout/eval in ``metrics.jsonl``; mirrored to wandb and the console."""

    def __init__(self, run: RunDir, cfg: LoggingConfig, config: dict, num_rollout: int, wandb_id: str | None):
        self.run = run
        self.cfg = cfg
        self.num_rollout = num_rollout
        self.path = run.metrics_file
        self._repair()  # before wandb: a corrupt file stops the job before anything starts
        self._dumper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-dump")
        self._dump: Future | None = None  # the rollout dump being written
        self._warned: set[str] = set()  # undocumented names already warned of
        self._wandb = None
        self.wandb_id = wandb_id
        if cfg.wandb_mode != "disabled":
            import wandb

            # A resumed job passes the id from its checkpoint and continues the same wandb run.
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                dir=str(run.path),
                mode=cfg.wandb_mode,
                id=wandb_id,
                resume="allow",
                config=config,
                name=run.path.name,
                settings=wandb.Settings(quiet=True, console="off"),
            )
            self.wandb_id = self._wandb.id

    def _repair(self) -> None:
        """Drop a torn last line before anything is appended after it (it would corrupt the next record)."""
        _, lines, torn = _load(self.path)
        if torn is not None:
            log.warning("%s line %d is torn (the job was killed while writing it); dropping it", self.path, torn)
        elif not lines or self.path.read_bytes().endswith(b"\n"):
            return  # a complete last line killed before its newline is kept, and the newline added
        write_atomic(self.path, "".join(line + "\n" for line in lines))

    def rewind(self, next_rollout_id: int) -> None:
        """Drop records of rollouts after the checkpoint we resume from: they are recomputed."""
        if not self.path.is_file():
            return
        kept = [r for r in read_metrics(self.run) if r["rollout_id"] < next_rollout_id]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def restore(self, rollout_id: int, values: dict[str, float]) -> None:
        """Re-add a checkpointed rollout's record if the job died before writing it."""
        if not any(r["kind"] == "rollout" and r["rollout_id"] == rollout_id for r in read_metrics(self.run)):
            self.log("rollout", rollout_id, values)

    def log(self, kind: str, rollout_id: int, values: dict[str, float]) -> None:
        """One record, each value under its name (``rlhpc.metric_names``), in the file, on the
        console and in wandb alike."""
        record = {"kind": kind, "rollout_id": rollout_id, **values}
        for name in undocumented(record):
            if name not in self._warned:
                self._warned.add(name)
                log.warning("metric %s is not in rlhpc/metric_names.py: this is a bug of rlhpc, report it", name)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        log.info(_console_line(kind, rollout_id, self.num_rollout, values))
        if self._wandb is not None:
            # wandb steps count trained rollouts, so the untrained baseline (rollout_id -1) is step 0.
            self._wandb.log(values, step=rollout_id + 1)

    def dump_rollout(self, rollout_id: int, batch: RolloutBatch, texts: dict[str, list[str]]) -> None:
        """Write one rollout's tokens, texts, rewards and advantages to ``rollouts/rollout_NNNNNN.h5``
        beside the loop: the next rollout does not wait for it (3.5 ms for the embedded default's
        256 samples, more with long responses). One write in flight: this first waits for the one
        before and raises its error (a full disk stops the run at the next rollout)."""
        if not self.cfg.dump_rollouts:
            return
        self.wait_dumps()
        self._dump = self._dumper.submit(
            write_rollout_dump, self.run.rollout_dump(rollout_id), rollout_id, batch, texts
        )

    def wait_dumps(self) -> None:
        """The dump in flight is on disk (or its error raised)."""
        dump, self._dump = self._dump, None
        if dump is not None:
            dump.result()

    def close(self) -> None:
        """Always, also when leaving on an error: the dump in flight is still written if it can be."""
        try:
            self.wait_dumps()
        except Exception as e:
            log.warning("writing the last rollout dump failed: %s", e)
        finally:
            self._dumper.shutdown()
            if self._wandb is not None:
                self._wandb.finish()
                self._wandb = None


class RolloutDumpError(RlhpcError):
    """A rollout's HDF5 dump could not be written (nothing of it is left on disk)."""


def write_rollout_dump(path: Path, rollout_id: int, batch: RolloutBatch, texts: dict[str, list[str]]) -> None:
    """One rollout's HDF5 dump, written under a temporary name and renamed: readers see it whole or not at all."""
    tmp = path.with_suffix(".h5.tmp")
    # Built in memory, written with a plain write: HDF5 crashes the process (SIGSEGV, the run's
    # driver with it) when the disk fills under its own writes, where a write() raises ENOSPC.
    data = _dump_bytes(rollout_id, batch, texts)
    try:
        path.parent.mkdir(exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        fix = (
            "free space on that filesystem (or raise the quota)"
            if disk_full(e)
            else f"check that {path.parent} is writable and its filesystem healthy"
        )
        raise RolloutDumpError(
            f"writing the dump of rollout {rollout_id} ({path}) failed: {e}; {disk_space(path.parent)}",
            f"{fix}, or set logging.dump_rollouts=false",
        ) from e


def _dump_bytes(rollout_id: int, batch: RolloutBatch, texts: dict[str, list[str]]) -> memoryview:
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f.attrs["rollout_id"] = rollout_id
        # every field of the batch, under the name and type its metadata gives (rlhpc.batch)
        for fld, value in zip(dataclasses.fields(batch), batch.values()):
            name, dtype = fld.metadata["dump"], fld.metadata.get("dtype")
            if fld.default_factory is not dataclasses.MISSING and not value:
                continue  # an optional field, unknown for this rollout
            if fld.name == "images":
                _image_table(f, value)
                continue
            if fld.type == "int":
                f.attrs[name] = value  # group_size
            elif fld.type == "torch.Tensor":  # by its annotation: status reads dumps without torch
                f.create_dataset(name, data=value.numpy())
            elif fld.type == "list[torch.Tensor]":  # per token, per layer, top-k: flattened per sample
                _ragged(f, name, [t.reshape(-1).numpy() for t in value], np.dtype(dtype))
                f.attrs[f"{name}_shape"] = list(value[0].shape[1:])  # [layers, top-k]
            elif fld.type.startswith("list[list["):  # per token
                _ragged(f, name, value, np.dtype(dtype))
            else:  # per sample
                f.create_dataset(name, data=np.asarray(value, dtype=dtype))
        for name, values in texts.items():
            f.create_dataset(name, data=[readable(v) for v in values], dtype=h5py.string_dtype())
    return buf.getbuffer()


def _image_table(f: h5py.File, images: list[list]) -> None:
    """A rollout's images, each distinct one once: ``image_source`` (where it came from),
    ``image_bytes`` (its encoded bytes where no file has it: a generated image; empty otherwise),
    and per sample ``image_index`` into them, in its prompt's order."""

    def key(ref: ImageRef) -> tuple:  # a group's samples share one image (its bytes one object, also once resumed)
        return ref.source, ref.path, id(ref.data)

    index: dict[tuple, int] = {}
    table: list = []
    for refs in images:
        for ref in refs:
            if key(ref) not in index:
                index[key(ref)] = len(table)
                table.append(ref)
    f.create_dataset("image_source", data=[readable(r.source) for r in table], dtype=h5py.string_dtype())
    empty = np.zeros(0, np.uint8)
    _ragged(f, "image_bytes", [empty if r.durable else np.frombuffer(r.read(), np.uint8) for r in table], np.uint8)
    _ragged(f, "image_index", [[index[key(r)] for r in refs] for refs in images], np.int32)


_SURROGATE = re.compile("[\ud800-\udfff]")


def readable(text: str) -> str:
    """A text as the dump stores it: HDF5 strings end at NUL, so a NUL (a byte-level token can
    decode to one) is written as U+2400 (␀), and a lone surrogate as U+FFFD. The token ids
    beside it are exact; the text is for reading."""
    return _SURROGATE.sub("\ufffd", text.replace("\x00", "\u2400"))


# ------------------------------------------------------------------ reading a dump


def printable(text: object) -> str:
    """``text`` for a terminal: control characters (escape sequences that move the cursor, set
    the window title, clear the screen), line breaks and the invisible ones that reorder what
    is shown, written as Python escapes (``\\x1b``, ``\\u202e``), whoever wrote the text."""
    text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


@contextlib.contextmanager
def open_rollout_dump(path: Path) -> Iterator[h5py.File]:
    """An HDF5 dump opened for reading, whoever wrote it (a dump may come from elsewhere): refused,
    naming why, unless every object in it lies in the file itself and declares no more bytes than
    the file holds (issue 43, item 10). HDF5 reads, on a dataset's first access, the files an
    external dataset, an external link or a virtual dataset names (any file the reader can read),
    and a dataset of 10^9 values with nothing stored hands back 10^9 fill values: a 4.7 KB file
    allocated 3.9 GB. Its texts are the writer's: print them through ``printable``."""
    path = Path(path)
    size = os.path.getsize(path)
    with h5py.File(path, "r") as f:
        problem = _foreign(f, size)
        if problem is not None:
            raise RlhpcError(
                f"{path} is not a rollout dump rlhpc can read safely: {printable(problem)}",
                "read only dumps a run wrote (RUN_DIR/rollouts/); a file made to look like one can make HDF5 "
                "read other files or allocate without bound",
            )
        yield f


def _foreign(group: h5py.Group, size: int) -> str | None:
    """Why ``group`` (a file, recursively) is no plain self-contained dump, or None."""
    for what in (group.attrs.get_id(name) for name in group.attrs):
        if _declared(what.shape, what.dtype) > size:
            return f"an attribute of {group.name} declares more bytes than the file's {size}"
    for name in group:
        link = group.get(name, getlink=True)
        where = f"{group.name.rstrip('/')}/{name}"
        if not isinstance(link, h5py.HardLink):
            target = getattr(link, "filename", "") or getattr(link, "path", "")
            return f"{where} is a link ({type(link).__name__}) to {target}"
        obj = group[name]
        if isinstance(obj, h5py.Group):
            if (problem := _foreign(obj, size)) is not None:
                return problem
            continue
        if not isinstance(obj, h5py.Dataset):
            return f"{where} is a {type(obj).__name__}, not a dataset"
        if obj.is_virtual:
            return f"{where} is a virtual dataset (its data lies in other files)"
        if obj.external:
            return f"{where} is an external dataset (its data lies in {obj.external[0][0]!r})"
        if obj.id.get_create_plist().get_nfilters():
            return f"{where} has filters (compression): a dump has none, and a few bytes may unpack to any size"
        if _declared(obj.shape, obj.dtype) > size:
            return f"{where} declares {_declared(obj.shape, obj.dtype)} bytes in a file of {size}"
        for attr in (obj.attrs.get_id(n) for n in obj.attrs):
            if _declared(attr.shape, attr.dtype) > size:
                return f"an attribute of {where} declares more bytes than the file's {size}"
    return None


def _declared(shape: tuple[int, ...] | None, dtype: np.dtype) -> int:
    """Bytes a dataset or attribute of ``shape`` declares (a variable-length item: its reference)."""
    return int(np.prod(shape or (), dtype=np.int64)) * max(1, dtype.itemsize)
