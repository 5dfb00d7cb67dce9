"""The same install everywhere: the CPU set pinned in constraints/cpu.txt (what `make install`
installs through, and what this venv holds), and the GPU stack in constraints/gpu.txt kept in step
with the sglang wheel's own requirements and the GPU extra of pyproject.toml."""

import re
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support.sglang_wheel import wheel_path

from rlhpc.wire.protocol import SGLANG_VERSION

REPO = Path(__file__).resolve().parents[2]
OURS = {"sglang": SGLANG_VERSION, "sglang-router": "0.3.2", "megatron-core": "0.16.1"}


def requirements(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def key(r: Requirement) -> tuple[str, str, str]:
    return canonicalize_name(r.name), str(r.specifier), str(r.marker or "")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_the_gpu_constraints_are_the_sglang_wheels_own_pins_and_ours():
    with zipfile.ZipFile(wheel_path()) as z:
        text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert re.search(rf"^Version: {re.escape(SGLANG_VERSION)}$", text, re.M)
    wheel = [Requirement(v) for v in re.findall(r"^Requires-Dist: (.+)$", text, re.M)]
    pinned = {
        key(r) for r in wheel
        if not (r.marker and "extra" in str(r.marker)) and [s.operator for s in r.specifier] == ["=="]
    }  # fmt: skip
    assert {("torch", "==2.14.1", ""), ("transformers", "==5.19.0", "")} <= pinned  # the docs say so
    ours = {(canonicalize_name(n), f"=={v}", "") for n, v in OURS.items()}
    listed = requirements(REPO / "constraints" / "gpu.txt")
    assert not [r for r in listed if r.extras], "pip refuses extras in a constraints file"
    assert {key(r) for r in listed} == pinned | ours
    # the GPU extra asks for exactly those versions, and the test extra agrees where it names one
    extras = pyproject()["optional-dependencies"]
    assert {key(Requirement(r)) for r in extras["gpu"]} == ours
    for r in map(Requirement, extras["test"]):
        if canonicalize_name(r.name) in OURS:
            assert str(r.specifier) == f"=={OURS[canonicalize_name(r.name)]}", r


def test_the_cpu_constraints_pin_every_dependency_and_are_what_this_venv_holds():
    pins = {canonicalize_name(r.name): r for r in requirements(REPO / "constraints" / "cpu.txt")}
    assert all([s.operator for s in r.specifier] == ["=="] and not r.marker for r in pins.values())
    assert "rlhpc" not in pins
    project = pyproject()
    for spec in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        wanted = Requirement(spec)
        pin = pins.get(canonicalize_name(wanted.name))
        assert pin is not None, f"{wanted.name} is a dependency but constraints/cpu.txt does not pin it"
        version = next(iter(pin.specifier)).version
        assert wanted.specifier.contains(version, prereleases=True), f"{pin} does not meet {wanted}"
    drift = {}
    for name, pin in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if installed.split("+", 1)[0] != next(iter(pin.specifier)).version:  # torch's +cpu: any build
            drift[name] = (installed, str(pin.specifier))
    assert not drift, f"the venv differs from constraints/cpu.txt (update one or the other): {drift}"
