"""The program a warm sandbox runs: one execution at a time, each in a fresh forked child.

It is started inside the sandbox (``rlhpc.sandbox.backends``) as ``python -I -c <this file's
text> MODE TMP`` and speaks length-prefixed JSON on its stdin and stdout: a ``ready`` message,
then one answer per request. Standard library only, and Python 3.6 or newer: it runs under
whatever interpreter the site's nodes (or the Apptainer image) have, never the job's venv.

Each request forks a child that lowers its limits (CPU seconds, address space, processes, file
size) and runs the code: Python source executed in the child's fresh ``__main__`` (the
interpreter is already loaded: that is the warm start), or ``bash -c``. The worker reads the
child's stdout and stderr, keeps the first ``output`` bytes of each, and ends it at the wall
limit. Then everything the code left running is killed and its files are removed, so an
execution sees nothing of the one before.

As PID 1 of its own PID namespace (bwrap's ``--as-pid-1``, Apptainer's ``--pid --no-init``) the
worker cannot be killed by the code it runs (the kernel delivers to a namespace's init only the
signals it handles), and ``kill(-1)`` ends every other process in the sandbox. Without one (the
``subprocess`` backend) it kills the child's session only.

How a time-out is told apart (``rlhpc.sandbox.pool``'s classification reads ``waited_s``): at the
wall limit the worker sums, over the code's live processes, the CPU time they had and the time
they spent runnable but waiting for a CPU (``/proc/PID/schedstat``'s run delay). Code that spun
or slept past its limit had the CPU whenever it wanted it; code the node starved did not.
"""

import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time

MODE, TMP = sys.argv[1], sys.argv[2]  # MODE: "isolated" (its own namespaces) or "plain"
PID1 = os.getpid() == 1
_HEADER = struct.Struct(">I")


def read_message(fd):
    head = _read_exactly(fd, _HEADER.size)
    if head is None:
        return None
    body = _read_exactly(fd, _HEADER.unpack(head)[0])
    return None if body is None else json.loads(body.decode("utf-8"))


def _read_exactly(fd, n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def write_message(fd, obj):
    body = json.dumps(obj).encode("utf-8")
    data = _HEADER.pack(len(body)) + body
    while data:
        data = data[os.write(fd, data) :]


def own_user_namespace():
    """True when this process's uids are mapped (a user namespace of its own): only there does
    RLIMIT_NPROC count the sandbox's processes and not every process of the user on the node."""
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() != ["0", "0", "4294967295"]
    except OSError:
        return False


USERNS = own_user_namespace()


def set_limits(limits):
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    memory = limits["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = limits["disk_mb"] << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if USERNS:  # the worker itself and the code's processes, threads included
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"] + 1, limits["processes"] + 1))


def child(request, work, stdin_fd, out_w, err_w):
    """In the forked child: never returns."""
    status = 127
    try:
        os.setsid()
        os.chdir(work)
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 16)  # the protocol's pipes too: the code cannot answer for the worker
        for sig in (signal.SIGPIPE, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        set_limits(request["limits"])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", "TMPDIR": TMP}
        if request["lang"] == "bash":
            os.execve("/bin/bash", ["bash", "-c", request["code"]], env)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["main.py"]
        sys.path.insert(0, work)
        status = 0
        try:
            namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
            exec(compile(request["code"], "main.py", "exec"), namespace)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            kind, value, tb = sys.exc_info()
            traceback.print_exception(kind, value, tb.tb_next)  # from the code's own frames
            status = 1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
    finally:
        os._exit(status & 0xFF if isinstance(status, int) else 1)


def proc_usage(pids):
    """(CPU seconds, seconds runnable but waiting for a CPU) of ``pids``, from schedstat."""
    ran = waited = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                fields = f.read().split()
            ran += int(fields[0]) / 1e9
            waited += int(fields[1]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
    return ran, waited


def code_processes(session):
    """The live processes of the code: every process but this one (PID 1), or those of the
    child's session where the worker shares its PID namespace."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid = int(name)
        if PID1:
            out.append(pid)
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            if int(stat[stat.rindex(")") + 2 :].split()[3]) == session:
                out.append(pid)
        except (OSError, ValueError):
            pass
    return out


def kill_code(session):
    """Every process the code left: all but this one as PID 1, else the child's session."""
    try:
        if PID1:
            os.kill(-1, signal.SIGKILL)
        else:
            os.killpg(session, signal.SIGKILL)
    except OSError:
        pass


def reap_orphans():
    """As PID 1, wait for every process the code left (killed by ``kill_code``), so none stays a
    zombie; elsewhere they are the worker's grandchildren, reaped by init."""
    while PID1:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.0005)
        except ChildProcessError:
            return


def clean(work):
    """Remove what the execution wrote: its directory, and as the sandbox's owner all of /tmp
    and /dev/shm, so the next execution sees nothing of this one."""
    shutil.rmtree(work, ignore_errors=True)
    if not PID1:
        return
    for root in (TMP, "/dev/shm"):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def run(request, serial):
    limits = request["limits"]
    work = os.path.join(TMP, f"run{serial}")
    os.mkdir(work, 0o700)
    for name, content in request.get("files", {}).items():
        path = os.path.join(work, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content)
    # stdin from a file already unlinked: the code reads it on fd 0 and finds it nowhere else
    stdin_path = os.path.join(TMP, f".stdin{serial}")
    with open(stdin_path, "w") as f:
        f.write(request.get("stdin", ""))
    stdin_fd = os.open(stdin_path, os.O_RDONLY)
    os.unlink(stdin_path)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(request, work, stdin_fd, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    os.close(stdin_fd)
    keep = limits["output_kb"] << 10
    kept = {out_r: bytearray(), err_r: bytearray()}
    open_fds = [out_r, err_r]
    truncated = False
    deadline = start + limits["wall_s"]
    status = usage = None
    ran = waited = 0.0
    pause = 0.0005
    while True:
        if status is None:
            got, code, rusage = os.wait4(pid, os.WNOHANG)
            if got:
                status, usage = code, rusage
        now = time.monotonic()
        if status is None and now >= deadline:
            ran, waited = proc_usage(code_processes(pid))
            break
        if status is not None and not open_fds:
            break
        if not open_fds:  # the child closed its output but runs on: poll its exit
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(pause * 2, 0.05)
            continue
        # once the child exited, only what is already in the pipes: a process it left may hold them
        wait = 0.0 if status is not None else min(0.05, max(0.0, deadline - now))
        readable = select.select(open_fds, [], [], wait)[0]
        if status is not None and not readable:
            break
        for fd in readable:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.remove(fd)
                continue
            room = keep - len(kept[fd])
            kept[fd] += chunk[: max(0, room)]
            truncated = truncated or len(chunk) > room
    timed_out = status is None
    kill_code(pid)
    if timed_out:
        _, status, usage = os.wait4(pid, 0)
    reap_orphans()
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    os.close(out_r)
    os.close(err_r)
    clean(work)
    return {
        "timed_out": timed_out,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "wall_s": wall,
        # every process of the code that was waited for (the child's own children included)
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "child_cpu_s": usage.ru_utime + usage.ru_stime,
        "ran_s": ran,  # at a time-out: the CPU time of the code's live processes
        "waited_s": waited,  # at a time-out: their time runnable but without a CPU
        "stdout": bytes(kept[out_r]).decode("utf-8", "replace"),
        "stderr": bytes(kept[err_r]).decode("utf-8", "replace"),
        "truncated": truncated,
    }


def die_with_parent():
    """Without namespaces of its own (bwrap's --die-with-parent does it there): end with the
    process that started it."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def main():
    if not PID1:
        die_with_parent()
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.makedirs(TMP, exist_ok=True)
    write_message(wfd, {"ready": True, "pid1": PID1, "userns": USERNS, "python": sys.version.split()[0]})
    serial = 0
    while True:
        request = read_message(rfd)
        if request is None:
            return
        serial += 1
        try:
            answer = run(request, serial)
        except Exception as e:  # the worker's own fault: the pool takes the sandbox as broken
            answer = {"worker_error": f"{type(e).__name__}: {e}"}
        write_message(wfd, answer)


if __name__ == "__main__":
    main()
