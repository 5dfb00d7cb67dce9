"""The second user of the chaos soak's attacker kinds (issue 32): what another user of the node
tries against a live job, run as that user (``nobody``, via ``setpriv``, no groups).

Each attack is a stdlib-only script run by the system's ``/usr/bin/python3`` (the soak's venv
may not be readable by that uid). It acts until it is done or gets SIGTERM, then prints one JSON
record: ``steps`` (what it tried, each "done" or the error that stopped it) and ``received``
(every byte anyone sent it, and whatever it read). The soak checks that no step it must not
manage was done and that no engine key appears anywhere in the record.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

UID = 65534  # nobody

# Shared by every script: the record printed at the end, however the script ends.
_PROLOGUE = r"""
import json, os, signal, socket, sys, time, base64, urllib.request, urllib.error
record = {"steps": {}, "received": []}
def _stop(*_):
    raise SystemExit(0)
signal.signal(signal.SIGTERM, _stop)
print("attack running", flush=True)  # start() waits for this: a SIGTERM before it would print nothing
def step(name, fn):
    try:
        out = fn()
        record["steps"][name] = "done"
        return out
    except OSError as e:
        record["steps"].setdefault(name, type(e).__name__)
def post(url, body, headers=None, timeout=30):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()[:300].decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:300].decode(errors="replace")
    except OSError as e:
        return type(e).__name__, ""
try:
"""
_EPILOGUE = r"""
finally:
    print(json.dumps(record), flush=True)
"""

# ready_swap: take the engine's dir away and put one of ours in its place, holding a ready file
# that names our own port; listen there, and keep at it (the engine is restarted meanwhile, so a
# ready file is read while we try). argv: engine dir, engine pid.
READY_SWAP = r"""
    engine_dir, pid = sys.argv[1], int(sys.argv[2])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    record["port"] = listener.getsockname()[1]
    fake = json.dumps({"host": "127.0.0.1", "port": record["port"], "pid": pid})
    def plant_dir():
        os.mkdir(engine_dir)
        with open(os.path.join(engine_dir, "ready.json"), "w") as f:
            f.write(fake)
    def plant_file():
        with open(os.path.join(engine_dir, "ready.json"), "w") as f:
            f.write(fake)
    while True:
        step("rename the engine dir", lambda: os.rename(engine_dir, engine_dir + ".away"))
        step("plant a dir in its place", plant_dir)
        step("write its ready file", plant_file)
        step("read its ready file", lambda: record["received"].append(open(os.path.join(engine_dir, "ready.json")).read()))
        try:
            conn, _ = listener.accept()
            conn.settimeout(5)
            record["received"].append(conn.recv(65536).decode(errors="replace"))
            conn.close()
        except (BlockingIOError, socket.timeout):
            pass
        time.sleep(0.01)
"""

# stage_plant: a staged copy of our own (a poisoned model, its manifest empty), put where the
# job stages (<stage_dir>/rlhpc-JOB) the moment that name is free. argv: the job's stage root.
STAGE_PLANT = r"""
    root = sys.argv[1]
    step("list the job's stage root", lambda: os.listdir(root))
    step("write into the job's stage root", lambda: open(os.path.join(root, "planted"), "w").close())
    print("first steps taken", flush=True)  # the caller may now free the name
    def plant():
        os.mkdir(root)
        os.chmod(root, 0o755)  # as a helpful copy would be
        record["steps"]["plant a copy where the job stages"] = "done"  # the name is ours from here on
        os.mkdir(os.path.join(root, "model"))
        for name, text in (("config.json", "planted"), (".rlhpc-staged.json", "[]")):
            with open(os.path.join(root, "model", name), "w") as f:
                f.write(text)
    while record["steps"].get("plant a copy where the job stages") != "done":
        record["steps"].pop("plant a copy where the job stages", None)
        step("plant a copy where the job stages", plant)
        time.sleep(0.002)
    while True:
        time.sleep(1)
"""

# stage_link: names in a shared stage dir, planted before a job stages there: a dangling link
# named as a job's stage root, a link to a dir of the job's user (the canary) and one to a file
# in it, named as an ended job's root and archive, and a dir of our own. argv: stage dir, canary.
STAGE_LINK = r"""
    shared, canary = sys.argv[1], sys.argv[2]
    for name, target in (("rlhpc-1", "/nonexistent"), ("rlhpc-4000000", canary),
                         (".rlhpc-4000001.tar", os.path.join(canary, "keep"))):
        step(f"link {name}", lambda: os.symlink(target, os.path.join(shared, name)))
    step("make rlhpc-4000002", lambda: os.mkdir(os.path.join(shared, "rlhpc-4000002")))
"""
STAGE_LINK_NAMES = ("rlhpc-1", "rlhpc-4000000", ".rlhpc-4000001.tar", "rlhpc-4000002")

# cwd_plant: modules every part of a job imports, planted in a dir the job is submitted from
# (one others can write): each notes which process ran it in "ran" there, then hands over to the
# real module, so the job goes on as if nothing happened. argv: the dir, module names.
CWD_PLANT = r"""
    d = sys.argv[1]
    code = (
        "import importlib, os, sys\n"
        "here = os.path.dirname(os.path.abspath(__file__))\n"
        "with open(os.path.join(here, 'ran'), 'a') as f:\n"
        "    f.write(f'{__name__} in pid {os.getpid()}: {\" \".join(sys.argv)[:200]}\\n')\n"
        "sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != here]\n"
        "del sys.modules[__name__]\n"
        "sys.modules[__name__] = importlib.import_module(__name__)\n"
    )
    def plant(name):
        with open(os.path.join(d, name + ".py"), "w") as f:
            f.write(code)
    for name in sys.argv[2:]:
        step(f"plant {name}.py", lambda: plant(name))
    def ran():
        open(os.path.join(d, "ran"), "w").close()
        os.chmod(os.path.join(d, "ran"), 0o666)  # the job's user writes to it, if it runs our code
    step("make ran", ran)
"""
# what the driver, the engine servers and Ray's workers import
CWD_PLANT_NAMES = ("uvloop", "orjson", "safetensors")

# ray_probe: GET /metrics on every port the job's Ray listens on (Prometheus endpoints take no
# token); what answered is kept. argv: HOST:PORT of each.
RAY_PROBE = r"""
    record["metrics"] = {}
    for port in sys.argv[1:]:
        try:
            with urllib.request.urlopen(f"http://{port}/metrics", timeout=3) as r:
                record["metrics"][port] = r.status
                record["received"].append(r.read(1 << 20).decode(errors="replace"))
        except urllib.error.HTTPError as e:
            record["metrics"][port] = e.code
        except Exception as e:  # not HTTP at all (gRPC), refused, reset
            record["metrics"][port] = type(e).__name__
"""

# ray_squat: a dir of ours under the name a job would make for its local Ray. argv: the name.
RAY_SQUAT = r"""
    step("make the local Ray dir's old name", lambda: os.mkdir(sys.argv[1], 0o700))
"""

# conn_flood: many connections to an engine, each holding half a request's headers, opened
# again as the engine closes them, until stopped. argv: host, port, connections.
CONN_FLOOD = r"""
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    socks, record["opened"], record["closed_by_engine"] = [], 0, 0
    while True:
        while len(socks) < n:
            try:
                s = socket.create_connection((host, port), timeout=5)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n")  # never the blank line
                s.setblocking(False)
                socks.append(s)
                record["opened"] += 1
            except OSError as e:
                record["steps"]["connect"] = type(e).__name__
                break
        alive = []
        for s in socks:
            try:
                data = s.recv(65536)
                if data:
                    record["received"].append(data.decode(errors="replace")[:200])
                    alive.append(s)
                else:
                    record["closed_by_engine"] += 1
                    s.close()
            except BlockingIOError:
                alive.append(s)
            except OSError:
                record["closed_by_engine"] += 1
                s.close()
        socks = alive
        time.sleep(0.05)
"""

# keepalive_flood: many connections that each send one complete GET /health (the probe, no key
# needed) and read its answer, then, on every other one, half of a second request; kept open,
# opened again as the engine closes them, until stopped. How long the oldest half-sent second
# request has been held is recorded. argv: host, port, connections.
KEEPALIVE_FLOOD = r"""
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    socks, record["opened"], record["closed_by_engine"], record["answered"] = {}, 0, 0, 0
    record["half_sent_held_s"], record["half_sent_closed"] = 0.0, 0
    def open_one(k):
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                raise ConnectionResetError("closed before its answer")
            head += chunk
        record["answered"] += 1
        if k % 2:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n")  # and never the blank line
        s.setblocking(False)
        return s, (time.monotonic() if k % 2 else None)
    while True:
        while len(socks) < n:
            try:
                s, since = open_one(record["opened"])
                socks[s] = since
                record["opened"] += 1
            except OSError as e:
                record["steps"]["connect"] = type(e).__name__
                break
        for s in list(socks):
            try:
                gone = s.recv(65536) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                record["closed_by_engine"] += 1
                record["half_sent_closed"] += socks.pop(s) is not None
                s.close()
        now = time.monotonic()
        record["half_sent_held_s"] = max([record["half_sent_held_s"]] + [now - t for t in socks.values() if t])
        time.sleep(0.05)
"""

# header_flood: connections that send header lines without end, as fast as the engine reads
# them; what each got to send before the engine closed it is recorded. argv: host, port.
HEADER_FLOOD = r"""
    host, port = sys.argv[1], int(sys.argv[2])
    record["accepted_bytes"] = []
    line = b"X-Flood: " + b"a" * 1000 + b"\r\n"
    for _ in range(4):
        sent = 0
        try:
            s = socket.create_connection((host, port), timeout=10)
        except OSError as e:
            record["steps"]["connect"] = type(e).__name__
            continue
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n")
            while sent < HEADER_FLOOD_BYTES:
                s.sendall(line * 64)
                sent += len(line) * 64
        except OSError:
            pass
        record["accepted_bytes"].append(sent)
        try:
            s.settimeout(5)
            record["received"].append(s.recv(200).decode(errors="replace"))
        except OSError:
            pass
        s.close()
"""
HEADER_FLOOD_BYTES = 64 << 20  # what the flood tries to send on one connection
# More than this sent on one connection (the engine's cap, 32 KB, plus what the kernel's socket
# buffers take before the close is seen): the engine read headers without a cap.
HEADER_FLOOD_LIMIT = 16 << 20
# A half-sent request held longer than this (the engine's 10 s, plus a loaded machine's slack)
HALF_SENT_LIMIT_S = 30.0

# store_probe: torch's TCPStore protocol (no key: torch has none) spoken to every port the job's
# training ranks listen on: set a key, read it back. argv: HOST:PORT of each.
STORE_PROBE = r"""
    import struct
    record["stores"] = {}
    key, value = b"rlhpc-probe", b"planted"
    for port in sys.argv[1:]:
        try:
            s = socket.create_connection(tuple(port.rsplit(":", 1)), timeout=2)
            s.settimeout(3)
            msg = struct.pack("<BI", 0, 0x3C85F7CE)  # VALIDATE, with torch's magic number
            msg += struct.pack("<BQ", 1, len(key)) + key + struct.pack("<Q", len(value)) + value  # SET
            msg += struct.pack("<BQ", 3, len(key)) + key  # GET
            s.sendall(msg)
            got = b""
            while len(got) < 8 + len(value):
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            s.close()
            record["stores"][str(port)] = "set and read a key" if got.endswith(value) else "no store"
        except OSError as e:
            record["stores"][str(port)] = type(e).__name__
"""

# bad_pickle: payloads that, unpickled, would set state on a class found by name (BUILD), call it
# (REDUCE), or call it through the `append` a BUILD gave an allowed SimpleNamespace (APPEND); sent
# to the weight-update routes without the key and with a wrong one. argv: url.
BAD_PICKLE = r"""
    url = sys.argv[1]
    payloads = {
        "BUILD on a torch class": b"ctorch.storage\nUntypedStorage\nN}X\x04\x00\x00\x00evilK\x01s\x86b.",
        "a call of os.system": b"cos\nsystem\n(X\x04\x00\x00\x00trueo.",
        "BUILD then APPEND on a SimpleNamespace": b"ctypes\nSimpleNamespace\n)R}X\x06\x00\x00\x00appendctorch.storage\nUntypedStorage\nsbJ\x00\x00\x10\x00a.",
    }
    record["answers"] = {}
    for name, raw in payloads.items():
        body = json.dumps({"serialized_named_tensors": [base64.b64encode(raw).decode()]}).encode()
        for who, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer not-the-key"})):
            for route in ("/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"):
                record["answers"][f"{name}, {who}, {route}"] = post(url + route, body if "tensor" in route else b"{}", headers)[0]
"""

# huge_request: generations no engine could serve, bodies no engine could parse, and requests
# that would make an engine render a template of the request's own or build millions of rows,
# sent without the key. argv: url.
HUGE_REQUEST = r"""
    url = sys.argv[1]
    record["answers"] = {}
    for name, (route, body) in BAD_BODIES.items():
        record["answers"][name] = post(url + route, body)[0]
"""

# The bodies huge_request sends (the key-holder's variant too): each must be refused with 401
# without the key, 400 with it, and leave the engine serving. Source, run here and in the script
# (a million-token body is too long for a command line).
_BAD_BODIES = """
HI = [{"role": "user", "content": "hi"}]
BAD_BODIES = {
    "max_new_tokens 10^9": ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}}),
    "n 10^9": ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "n": 10**9}}),
    "temperature nan": ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "nan"}}),
    "a million-token prompt": ("/generate", {"input_ids": [1] * 10**6, "sampling_params": {"max_new_tokens": 1}}),
    "input_ids not ints": ("/generate", {"input_ids": [[["x"]]], "sampling_params": {}}),
    "a template in chat_template_kwargs": ("/v1/chat/completions", {
        "messages": HI, "max_tokens": 1, "chat_template_kwargs": {"chat_template": "{{ 'x' * 300000000 }}"}}),
    "n 2,000,000 completions": ("/v1/completions", {"prompt": "ab", "max_tokens": 1, "n": 2 * 10**6}),
}
BAD_BODIES = {k: (route, json.dumps(v).encode()) for k, (route, v) in BAD_BODIES.items()}
BAD_BODIES["not JSON"] = ("/generate", b"{" * 100_000)
"""
_namespace: dict = {"json": json}
exec(_BAD_BODIES, _namespace)  # noqa: S102 - our own constant source
BAD_BODIES: dict[str, tuple[str, bytes]] = _namespace["BAD_BODIES"]

SCRIPTS = {"ready_swap": READY_SWAP, "stage_plant": STAGE_PLANT, "stage_link": STAGE_LINK, "conn_flood": CONN_FLOOD,
           "keepalive_flood": KEEPALIVE_FLOOD, "header_flood": HEADER_FLOOD, "store_probe": STORE_PROBE,
           "cwd_plant": CWD_PLANT, "ray_probe": RAY_PROBE, "ray_squat": RAY_SQUAT,
           "bad_pickle": BAD_PICKLE, "huge_request": HUGE_REQUEST}  # fmt: skip

# Steps of each attack that the other user must never manage.
MUST_FAIL = {
    "ready_swap": ("rename the engine dir", "plant a dir in its place", "write its ready file", "read its ready file"),
    "stage_plant": ("list the job's stage root", "write into the job's stage root"),
}


def script(kind: str) -> str:
    body = SCRIPTS[kind]
    if kind == "huge_request":
        body = "".join(f"    {line}\n" for line in _BAD_BODIES.strip().splitlines()) + body
    if kind == "header_flood":
        body = f"    HEADER_FLOOD_BYTES = {HEADER_FLOOD_BYTES}\n" + body
    return _PROLOGUE + body + _EPILOGUE


class AttackError(Exception):
    """The attack could not be run (no root, no setpriv, the script failed): not a finding."""


def available() -> str | None:
    """Why attacks cannot run here, or None."""
    if os.getuid() != 0:
        return "the attacker kinds need root (to become the second user, uid 65534, with setpriv)"
    if shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"):
        return "the attacker kinds need setpriv and /usr/bin/python3"
    return None


def command(kind: str, *args: str) -> list[str]:
    return ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "/usr/bin/python3", "-c", script(kind),
            *args]  # fmt: skip


@dataclass
class Attack:
    """One attack, running as the other user until ``finish``."""

    kind: str
    proc: subprocess.Popen
    early: str = ""  # output read before finish() (wait_for_first_steps) that was not its line

    @classmethod
    def start(cls, kind: str, *args: str) -> Attack:
        if why := available():
            raise AttackError(why)
        proc = subprocess.Popen(
            command(kind, *args), cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        attack = cls(kind, proc)
        attack._read_until("attack running\n", 120, "start")
        return attack

    def wait_for_first_steps(self, timeout: float = 120) -> None:
        """Until the attack says its first steps are taken (stage_plant: it tried the stage root
        and now waits for the name to be free), so the caller's next move meets the waiting part."""
        self._read_until("first steps taken\n", timeout, "take its first steps")

    def _read_until(self, line: str, timeout: float, what: str) -> None:
        deadline, said = time.monotonic() + timeout, self.early.encode()
        fd = self.proc.stdout.fileno()  # read raw: what finish()'s communicate() reads comes after
        while line.encode() not in said:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:  # past the deadline, or the script ended
                self.early = said.decode(errors="replace")
                raise AttackError(f"the {self.kind} attack did not {what}: {self.finish()}")
            said += chunk
        self.early = said.decode(errors="replace").split(line, 1)[1]

    def finish(self, timeout: float = 60) -> dict:
        """Stop the attack (if it still runs) and return its record."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        out = self.early + out
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError) as e:
            raise AttackError(
                f"the {self.kind} attack printed no record (exit {self.proc.returncode}): {err[-500:]}"
            ) from e


def run(kind: str, *args: str, timeout: float = 120) -> dict:
    """Run an attack that ends by itself; its record."""
    attack = Attack.start(kind, *args)
    try:
        attack.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    return attack.finish()


def findings(kind: str, record: dict, keys: set[str]) -> list[str]:
    """What the attack got that it must not have: a step done that must fail, an engine key
    anywhere in what it received or read, an engine answering it anything but 401."""
    problems = [
        f"{kind}: the other user managed to {s}" for s in MUST_FAIL.get(kind, ()) if record["steps"].get(s) == "done"
    ]
    text = json.dumps(record)
    problems += [f"{kind}: the engine key reached the other user" for k in keys if k and k in text]
    if kind == "header_flood" and max(record.get("accepted_bytes") or [0]) > HEADER_FLOOD_LIMIT:
        problems.append(f"{kind}: the engine read {max(record['accepted_bytes'])} bytes of one request's headers")
    if kind == "keepalive_flood" and record.get("half_sent_held_s", 0) > HALF_SENT_LIMIT_S:
        problems.append(f"{kind}: a half-sent second request was held {record['half_sent_held_s']:.0f} s")
    problems += [f"{kind}: the other user could {what} on port {port}"
                 for port, what in record.get("stores", {}).items() if what == "set and read a key"]  # fmt: skip
    if kind == "ready_swap" and record["received"]:
        problems.append(f"{kind}: the other user's port was sent {record['received'][:2]!r}")
    for what, code in record.get("answers", {}).items():
        # a name (ConnectionResetError): the engine answered 401 and closed before the body was sent
        if isinstance(code, int) and code != 401:
            problems.append(f"{kind}: {what} was answered {code}, not 401, without the key")
    return problems


def listening(pids: list[int]) -> list[str]:
    """HOST:PORT of every TCP port the processes ``pids`` listen on (one on every address: on loopback)."""
    import psutil  # late: only the soak and the tests look

    found = []
    for pid in pids:
        for c in psutil.Process(pid).net_connections("inet"):
            if c.status == psutil.CONN_LISTEN:
                ip = c.laddr.ip.removeprefix("::ffff:")
                found.append(f"{'127.0.0.1' if ip in ('0.0.0.0', '::') else ip}:{c.laddr.port}")
    return found


# What rlhpc-show-rollout is handed in hostile_dump: files shaped as a dump (the datasets and
# attributes it reads) whose first access would make HDF5 read ``secret`` (a file of the reader's)
# or allocate far more than the file holds, or put escapes on the terminal. HDF5 needs h5py, which
# the other user's Python lacks: they are made here and handed to that user (chown), as planted.
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\u202e"  # set the title, clear the screen, reverse what follows


def plant_dumps(where: Path, secret: Path) -> dict[str, Path]:
    """The hostile dumps, by what each tries; ``secret``'s first 64 bytes are what must not show."""
    import h5py  # late: only the soak and the tests make them
    import numpy as np

    def external(f: h5py.File) -> None:
        f.create_dataset("prompt", shape=(1,), dtype="S64", external=[(str(secret), 0, 64)])

    def other_file() -> str:
        other = where / "other.h5"
        with h5py.File(other, "w") as g:
            g["data"] = np.full(4, 42.0)
        return str(other)

    def virtual(f: h5py.File) -> None:
        layout = h5py.VirtualLayout(shape=(4,), dtype="f8")
        layout[:] = h5py.VirtualSource(other_file(), "data", shape=(4,))
        f.create_virtual_dataset("rewards", layout)

    def link(f: h5py.File) -> None:
        f["rewards"] = h5py.ExternalLink(other_file(), "data")

    def declared(f: h5py.File) -> None:
        f.create_dataset("rewards", shape=(10**8,), dtype="f4")  # nothing stored: 10^8 fill values on read

    def compressed(f: h5py.File) -> None:
        f.create_dataset("rewards", data=np.zeros(10**6), compression="gzip")  # a few KB unpacking to 8 MB

    def escapes(f: h5py.File) -> None:
        f.attrs["rollout_id"] = ESCAPES
        for k in ("prompt", "response", "answer"):
            f.create_dataset(k, data=[ESCAPES], dtype=h5py.string_dtype())

    made = {}
    for build in (external, virtual, link, declared, compressed, escapes):
        path = where / f"{build.__name__}.h5"
        with h5py.File(path, "w") as f:
            f.attrs["rollout_id"], f.attrs["group_size"] = 0, 1
            f["advantages"] = np.zeros(1)
            build(f)
            if "rewards" not in f:
                f["rewards"] = np.zeros(1)
        if os.getuid() == 0:
            os.chown(path, UID, UID)
        made[build.__name__] = path
    return made


def keyed_bad_requests(url: str, key: str) -> list[str]:
    """The key-holder's variant of huge_request: each bad body must be a 400 and the engine must
    serve on; the problems found."""
    problems = []
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    for name, (route, body) in BAD_BODIES.items():
        req = urllib.request.Request(url + route, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                problems.append(f"huge_request with the key: {name} was served ({r.status})")
        except urllib.error.HTTPError as e:
            if e.code != 400:
                problems.append(f"huge_request with the key: {name} was answered {e.code}, not 400")
        except OSError as e:
            problems.append(f"huge_request with the key: {name} got no answer ({e})")
    req = urllib.request.Request(url + "/health", headers=headers)
    try:
        urllib.request.urlopen(req, timeout=60).close()
    except OSError as e:
        problems.append(f"huge_request: the engine stopped serving after the bad bodies ({e})")
    return problems
