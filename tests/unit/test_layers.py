"""The house keeps its floors: a package imports only from its own floor or below.

Packages are arranged by the process they run in (docs/architecture/map.md). An import that runs
upward (a lower floor taking something from a higher one) ties the floors into a knot that every
later change has to untie; one that must stay says why on its own line, ending in ``# upward: why``.
Imports under ``if TYPE_CHECKING:`` are annotations only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Bottom floor first. A module's package is ``rlhpc.X`` (``rlhpc.X.Y`` counts as ``rlhpc.X``).
FLOORS: list[set[str]] = [
    {"rlhpc.errors", "rlhpc.logs", "rlhpc.util"},
    {"rlhpc.wire", "rlhpc.algo", "rlhpc.batch", "rlhpc.metric_names", "rlhpc.foreign_keys"},
    {"rlhpc.config"},
    {
        "rlhpc.model",
        "rlhpc.moe_routing",
        "rlhpc.weights",
        "rlhpc.data",
        "rlhpc.cluster",
        "rlhpc.run_dir",
        "rlhpc.checkpoint",
        "rlhpc.sandbox",
    },
    {"rlhpc.runtime"},
    {"rlhpc.engine_server", "rlhpc.actor", "rlhpc.schedule", "rlhpc.metrics"},
    {"rlhpc.rollout"},
    {"rlhpc.preflight", "rlhpc.rewards", "rlhpc.invariants", "rlhpc.driver"},
    {"rlhpc.launch"},
    {"rlhpc.cli", "rlhpc.devtools"},
]


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _floor_of(package: str) -> int | None:
    return next((k for k, floor in enumerate(FLOORS) if package in floor), None)


def _annotation_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for n in ast.walk(node))
    return inside


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``rlhpc`` import in a file, at any depth, not counting annotations."""
    tree = ast.parse(path.read_text())
    skip = _annotation_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rlhpc"):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("rlhpc")]
    return found


def house_problems(root: Path) -> list[str]:
    """Every upward import without its reason, and every package no floor names."""
    problems = []
    for path in sorted((root / "rlhpc").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        here = _package(module)
        if module == "rlhpc":
            continue
        floor = _floor_of(here)
        if floor is None:
            problems.append(f"{path.relative_to(root)}: package {here} is on no floor; add it to FLOORS")
            continue
        lines = path.read_text().splitlines()
        for line, target in imports_of(path):
            there = _floor_of(_package(target))
            if there is not None and there > floor and "# upward:" not in lines[line - 1]:
                problems.append(
                    f"{path.relative_to(root)}:{line} imports {target} (floor {there}) from floor {floor}; "
                    "move what it needs down, or say why on the line with '# upward: why'"
                )
    return problems


def test_no_package_imports_from_a_floor_above_it():
    problems = house_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_an_upward_import_is_found_and_a_reasoned_one_allowed(tmp_path):
    pkg = tmp_path / "rlhpc"
    (pkg / "util").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "util" / "__init__.py").write_text("")
    (pkg / "driver.py").write_text("from rlhpc.util import x\n")
    (pkg / "util" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhpc.driver import Loop\n\n"
        "def f():\n    from rlhpc.driver import run\n"
    )
    (pkg / "util" / "b.py").write_text("import rlhpc.driver  # upward: the plugin hook is looked up by name\n")
    (pkg / "nowhere.py").write_text("")
    problems = house_problems(tmp_path)
    assert len(problems) == 2, problems
    assert problems[0].startswith("rlhpc/nowhere.py: package rlhpc.nowhere is on no floor")
    assert problems[1].startswith("rlhpc/util/a.py:6 imports rlhpc.driver")


# Walls between the processes (docs/architecture/map.md): a package on a floor may still not
# reach into the packages that run in another process. Checked at any depth, annotations aside.
WALLS: dict[str, set[str]] = {
    # the engine server runs on a GPU node beside SGLang's place: none of the trainer or the loop
    "rlhpc.engine_server": {"rlhpc.actor", "rlhpc.rollout", "rlhpc.driver", "rlhpc.schedule", "rlhpc.launch"},
    # the training ranks: neither the loop's rollout side nor the engines
    "rlhpc.actor": {"rlhpc.rollout", "rlhpc.engine_server", "rlhpc.schedule", "rlhpc.driver", "rlhpc.launch"},
}


def wall_problems(root: Path) -> list[str]:
    problems = []
    for package, forbidden in WALLS.items():
        for path in sorted((root / Path(*package.split("."))).rglob("*.py")):
            for line, target in imports_of(path):
                if _package(target) in forbidden:
                    problems.append(f"{path.relative_to(root)}:{line} imports {target} across the wall of {package}")
    return problems


def test_the_process_walls_hold():
    problems = wall_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_a_wall_crossing_is_found(tmp_path):
    (tmp_path / "rlhpc" / "actor").mkdir(parents=True)
    (tmp_path / "rlhpc" / "engine_server").mkdir(parents=True)
    (tmp_path / "rlhpc" / "actor" / "a.py").write_text("def f():\n    from rlhpc.rollout.generation import x\n")
    (tmp_path / "rlhpc" / "engine_server" / "b.py").write_text("import rlhpc.wire\n")
    assert wall_problems(tmp_path) == [
        "rlhpc/actor/a.py:2 imports rlhpc.rollout.generation across the wall of rlhpc.actor"
    ]


def test_the_login_node_imports_no_torch(tmp_path):
    """What runs on a login node (submit, its dry run and preview, status, sweeps) imports no
    torch, transformers or ray: they are slow to import there, and may not be installed."""
    import os
    import subprocess
    import sys

    import rlhpc

    env = {**os.environ, "PYTHONPATH": str(Path(rlhpc.__file__).resolve().parents[1])}
    login = [
        "rlhpc.cli.submit",
        "rlhpc.launch.submission",
        "rlhpc.launch.preview",
        "rlhpc.launch.sweep",
        "rlhpc.cli.status",
    ]
    # and a whole dry run of a Slurm job (its preview of every engine pool's launch line)
    submit = Path(rlhpc.__file__).resolve().parents[1] / "jobs" / "submit.py"
    argv = [str(submit), "--dry-run", "--run-dir", str(tmp_path / "run"), "--gpus-per-node", "8"]
    code = (
        "import contextlib, importlib, io, runpy, sys\n"
        f"for m in {login!r}:\n    importlib.import_module(m)\n"
        f"sys.argv = {argv!r}\n"
        "out = io.StringIO()\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "assert '#SBATCH' in out.getvalue(), out.getvalue()[-2000:]  # the dry run ran through\n"
        "heavy = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True)
