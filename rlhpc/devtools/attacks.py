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

UID = 65534  # nobody

# Shared by every script: the record printed at the end, however the script ends.
_PROLOGUE = r"""
import json, os, signal, socket, sys, time, base64, urllib.request, urllib.error
record = {"steps": {}, "received": []}
def _stop(*_):
    raise SystemExit(0)
signal.signal(signal.SIGTERM, _stop)
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

# bad_pickle: payloads that, unpickled, would set state on a class found by name (BUILD) or call
# it (REDUCE); sent to the weight-update routes without the key and with a wrong one. argv: url.
BAD_PICKLE = r"""
    url = sys.argv[1]
    payloads = {
        "BUILD on a torch class": b"ctorch.storage\nUntypedStorage\nN}X\x04\x00\x00\x00evilK\x01s\x86b.",
        "a call of os.system": b"cos\nsystem\n(X\x04\x00\x00\x00trueo.",
    }
    record["answers"] = {}
    for name, raw in payloads.items():
        body = json.dumps({"serialized_named_tensors": [base64.b64encode(raw).decode()]}).encode()
        for who, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer not-the-key"})):
            for route in ("/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"):
                record["answers"][f"{name}, {who}, {route}"] = post(url + route, body if "tensor" in route else b"{}", headers)[0]
"""

# huge_request: generations no engine could serve and bodies no engine could parse, sent without
# the key. argv: url.
HUGE_REQUEST = r"""
    url = sys.argv[1]
    record["answers"] = {}
    for name, body in BAD_BODIES.items():
        record["answers"][name] = post(url + "/generate", body)[0]
"""

# The bodies huge_request sends (the key-holder's variant too): each must be refused with 401
# without the key, 400 with it, and leave the engine serving. Source, run here and in the script
# (a million-token body is too long for a command line).
_BAD_BODIES = """
BAD_BODIES = {
    "max_new_tokens 10^9": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}},
    "n 10^9": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "n": 10**9}},
    "temperature nan": {"input_ids": [1, 2], "sampling_params": {"temperature": "nan"}},
    "a million-token prompt": {"input_ids": [1] * 10**6, "sampling_params": {"max_new_tokens": 1}},
    "input_ids not ints": {"input_ids": [[["x"]]], "sampling_params": {}},
}
BAD_BODIES = {k: json.dumps(v).encode() for k, v in BAD_BODIES.items()}
BAD_BODIES["not JSON"] = b"{" * 100_000
"""
_namespace: dict = {"json": json}
exec(_BAD_BODIES, _namespace)  # noqa: S102 - our own constant source
BAD_BODIES: dict[str, bytes] = _namespace["BAD_BODIES"]

SCRIPTS = {"ready_swap": READY_SWAP, "stage_plant": STAGE_PLANT, "conn_flood": CONN_FLOOD,
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
        return cls(kind, proc)

    def wait_for_first_steps(self, timeout: float = 120) -> None:
        """Until the attack says its first steps are taken (stage_plant: it tried the stage root
        and now waits for the name to be free), so the caller's next move meets the waiting part."""
        deadline, said = time.monotonic() + timeout, b""
        fd = self.proc.stdout.fileno()  # read raw: what finish()'s communicate() reads comes after
        while b"first steps taken\n" not in said:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:  # past the deadline, or the script ended
                self.early = said.decode(errors="replace")
                raise AttackError(f"the {self.kind} attack did not take its first steps: {self.finish()}")
            said += chunk
        self.early = said.decode(errors="replace").split("first steps taken\n", 1)[1]

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
    if kind == "ready_swap" and record["received"]:
        problems.append(f"{kind}: the other user's port was sent {record['received'][:2]!r}")
    for what, code in record.get("answers", {}).items():
        # a name (ConnectionResetError): the engine answered 401 and closed before the body was sent
        if isinstance(code, int) and code != 401:
            problems.append(f"{kind}: {what} was answered {code}, not 401, without the key")
    return problems


def keyed_bad_requests(url: str, key: str) -> list[str]:
    """The key-holder's variant of huge_request: each bad body must be a 400 and the engine must
    serve on; the problems found."""
    problems = []
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    for name, body in BAD_BODIES.items():
        req = urllib.request.Request(url + "/generate", data=body, headers=headers)
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
