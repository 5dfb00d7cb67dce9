"""What a local submit does without torch: the tiny model a run dir gets is the same bytes whether
built or copied from the user's cache (a config or builder change builds anew; a hit imports
neither torch nor transformers), and the machine's GPUs are counted as CUDA counts them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlhpc
from rlhpc.config import TinyModelConfig
from rlhpc.errors import RlhpcError
from rlhpc.model import build_tiny_model
from rlhpc.run_dir import tiny_model, tiny_model_key


def files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_cached_tiny_model_is_the_built_one(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHPC_CACHE_DIR", str(tmp_path / "cache"))
    tiny = TinyModelConfig(tokenizer="bpe", seed=5)
    tiny_model(tmp_path / "first", tiny)  # built, then cached and copied
    cached = list((tmp_path / "cache" / "tiny").iterdir())
    assert [p.name for p in cached] == [tiny_model_key(tiny, False)]
    tiny_model(tmp_path / "second", tiny)  # copied
    build_tiny_model(tmp_path / "fresh", tiny)
    assert files(tmp_path / "first") == files(tmp_path / "second") == files(tmp_path / "fresh") != {}
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == "0o700"
    # another config, or a classifier of the same one, is another model
    assert tiny_model_key(TinyModelConfig(tokenizer="bpe", seed=6), False) != tiny_model_key(tiny, False)
    assert tiny_model_key(tiny, True) != tiny_model_key(tiny, False)
    tiny_model(tmp_path / "rm", tiny, classifier=True)
    assert files(tmp_path / "rm") != files(tmp_path / "first")


def test_a_hit_imports_neither_torch_nor_transformers(tmp_path):
    env = {**os.environ, "RLHPC_CACHE_DIR": str(tmp_path / "cache")}
    env["PYTHONPATH"] = str(Path(rlhpc.__file__).resolve().parents[1])
    code = (
        "import sys\nfrom pathlib import Path\nfrom rlhpc.config import TinyModelConfig\n"
        "from rlhpc.run_dir import tiny_model\n"
        "tiny_model(Path(sys.argv[1]), TinyModelConfig())\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    run = [sys.executable, "-c", code]
    built = subprocess.run([*run, str(tmp_path / "a")], env=env, capture_output=True, text=True, check=True)
    hit = subprocess.run([*run, str(tmp_path / "b")], env=env, capture_output=True, text=True, check=True)
    assert built.stdout.split() == ["['torch',", "'transformers']"] and hit.stdout.strip() == "[]"
    assert files(tmp_path / "a") == files(tmp_path / "b")


def test_a_link_planted_in_the_cache_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / "tiny").symlink_to(tmp_path)  # a link planted where the models go
    monkeypatch.setenv("RLHPC_CACHE_DIR", str(cache))
    with pytest.raises(RlhpcError, match="link"):
        tiny_model(tmp_path / "m", TinyModelConfig())


def test_a_local_job_counts_the_visible_gpus_as_cuda_does(tmp_path, monkeypatch):
    from rlhpc.launch.submission import _local_gpus

    driver = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (driver / bus).mkdir(parents=True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _local_gpus(driver) == 3 and _local_gpus(tmp_path / "none") == 0  # no NVIDIA driver: no GPU
    for visible, n in [("0,2", 2), ("", 0), ("-1", 0), ("1,-1,2", 1), ("GPU-5d1c,GPU-77aa", 2), ("0,1,2,3,4", 3)]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert _local_gpus(driver) == n, visible
