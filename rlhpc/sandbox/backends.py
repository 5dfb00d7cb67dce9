"""The command line of one warm sandbox, per backend (``sandbox.backend``), and the checks that
make a missing piece one clear error.

- ``bwrap``: bubblewrap in unprivileged user namespaces, what a Slurm job may use on most
  nodes: its own user, PID, network (loopback only), IPC and UTS namespaces; the system
  directories read-only (``/usr`` and its links, a few files of ``/etc``), a private tmpfs
  ``/tmp`` and ``/dev/shm`` of ``sandbox.disk_mb``, a fresh ``/proc`` and a minimal ``/dev``;
  nothing of the run dir, the home directory, the job's environment (the engine key's
  variables included) or other jobs. Started as root (CI, some containers), it first drops to
  the user ``nobody`` (``setpriv``): the sandbox never holds root's credentials, and its
  process limit then counts (the kernel exempts root from it).
- ``apptainer``: ``apptainer exec --containall --no-init --net --network none`` of
  ``sandbox.image``: the same namespaces where the site runs Apptainer instead.
- ``subprocess``: the worker as a plain process, with the limits and none of the isolation.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from rlhpc.errors import ConfigError, RlhpcError

if TYPE_CHECKING:
    from rlhpc.config import SandboxConfig

WORKER = Path(__file__).with_name("worker.py")
BWRAP_PACKAGE = "bubblewrap"
NOBODY = 65534
# What a Python or a shell needs of the host, read-only: the system's programs and libraries
# (each a directory, or on a merged-/usr system a link into /usr, made the same link inside) ...
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# ... and the few files of /etc that the dynamic loader, Python and bash read (not passwd,
# hosts, the munge key or Slurm's configuration).
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


def worker_source() -> str:
    return WORKER.read_text()


def python_of(cfg: SandboxConfig) -> str:
    """The interpreter that runs the worker inside: sandbox.python, else the node's python3 (in
    the image, for apptainer)."""
    if cfg.python:
        return cfg.python
    return "python3" if cfg.backend == "apptainer" else "/usr/bin/python3"


def _missing_binary(name: str, package: str, cfg: SandboxConfig) -> RlhpcError:
    other = "apptainer (sandbox.backend: apptainer)" if cfg.backend == "bwrap" else "bwrap (sandbox.backend: bwrap)"
    return RlhpcError(
        f"sandbox.backend = {cfg.backend!r} needs {name}, which is not on this node's PATH",
        f"install the package {package!r} on the job's nodes (Debian/Ubuntu: apt-get install {package}; "
        f"RHEL: dnf install {package}), or load the site's module; or use {other}",
    )


def check(cfg: SandboxConfig) -> None:
    """What this node needs to start the configured sandboxes: the backend's binary (and as root
    ``setpriv``), the interpreter and every bound path. Each missing piece is one error naming
    it and the fix."""
    if cfg.backend == "bwrap":
        if shutil.which("bwrap") is None:
            raise _missing_binary("bwrap", BWRAP_PACKAGE, cfg)
        if os.geteuid() == 0 and shutil.which("setpriv") is None:
            raise RlhpcError(
                "the sandbox runs as root here, and drops to the user nobody with setpriv, which is missing",
                "install util-linux (it has setpriv), or run the job as a user other than root",
            )
    elif cfg.backend == "apptainer":
        if apptainer_binary() is None:
            raise _missing_binary("apptainer (or singularity)", "apptainer", cfg)
        if cfg.image and not Path(cfg.image).exists():
            raise ConfigError(f"sandbox.image {cfg.image} does not exist", "point it at a .sif image with python3")
    if cfg.backend != "apptainer":
        python = python_of(cfg)
        if not os.access(python, os.X_OK):
            raise ConfigError(
                f"sandbox.python {python} is not an executable on this node",
                "set sandbox.python to a Python 3.6+ interpreter the job's nodes have (e.g. /usr/bin/python3)",
            )
    for path in cfg.binds:
        if not Path(path).exists():
            raise ConfigError(f"sandbox.binds has {path}, which does not exist on this node", "bind paths that exist")


def apptainer_binary() -> str | None:
    return shutil.which("apptainer") or shutil.which("singularity")


def _system_binds() -> list[str]:
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for f in ETC_FILES:
        args += ["--ro-bind-try", f, f]
    return args


def _covered(path: str) -> bool:
    """Whether ``path`` lies under a directory the sandbox already has."""
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d + "/") for d in SYSTEM_DIRS if not os.path.islink(d))


def _python_binds(python: str) -> list[str]:
    """An interpreter outside /usr: its prefix (the directory above its bin/), read-only."""
    if _covered(python):
        return []
    prefix = str(Path(os.path.realpath(python)).parent.parent)
    return ["--ro-bind", prefix, prefix]


def bwrap_command(cfg: SandboxConfig, source: str) -> list[str]:
    python = python_of(cfg)
    size = str(cfg.disk_mb << 20)
    drop = (
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all", "--"]
        if os.geteuid() == 0
        else []
    )
    return [
        *drop, "bwrap",
        "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--as-pid-1", "--hostname", "sandbox",
        *_system_binds(), *_python_binds(python),
        *(a for p in cfg.binds for a in ("--ro-bind", p, p)),
        "--proc", "/proc", "--dev", "/dev",
        "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm",
        "--chdir", "/tmp", "--clearenv",
        "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
        "--", python, "-I", "-c", source, "isolated", "/tmp",
    ]  # fmt: skip


def apptainer_command(cfg: SandboxConfig, source: str, binary: str = "apptainer") -> list[str]:
    # --containall: its own PID and IPC namespaces, a clean environment, no home, a private /tmp;
    # --no-init: the worker is PID 1 (no shim), so the code cannot kill it; --network none:
    # loopback only, which Apptainer lets unprivileged users ask for.
    assert cfg.image is not None
    return [
        binary, "exec", "--containall", "--no-init", "--no-home", "--net", "--network", "none",
        "--hostname", "sandbox", "--pwd", "/tmp", "--env", f"PATH={SANDBOX_PATH}",
        *(a for p in cfg.binds for a in ("--bind", f"{p}:{p}:ro")),
        cfg.image, python_of(cfg), "-I", "-c", source, "isolated", "/tmp",
    ]  # fmt: skip


def subprocess_command(cfg: SandboxConfig, source: str, tmp: str) -> list[str]:
    return [python_of(cfg), "-I", "-c", source, "plain", tmp]


def start_problem(cfg: SandboxConfig, said: str) -> str:
    """What to do about a sandbox that did not start, from what it printed."""
    if cfg.backend == "bwrap" and ("namespace" in said or "uid map" in said or "Operation not permitted" in said):
        return (
            "this node does not let unprivileged users create user namespaces (sysctl "
            "user.max_user_namespaces, kernel.unprivileged_userns_clone, or an AppArmor/SELinux rule): ask "
            "the site to allow them for bwrap, or use sandbox.backend: apptainer"
        )
    if cfg.backend == "apptainer":
        return "check that sandbox.image runs here (apptainer exec IMAGE python3 -V) and has a Python 3.6+"
    return f"check that {python_of(cfg)} runs on this node (and its Python is 3.6 or newer)"
