"""A grader that lives elsewhere, over real HTTP on loopback: what it receives, its key, retries,
its time limit and how many calls it gets at once."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhpc.errors import ConfigError, RlhpcError
from rlhpc.preflight import load_config
from rlhpc.rollout.generation import task_reward
from rlhpc.rollout.scoring import Sample

SAMPLES = [Sample(f"{i}+1=", str(i + 1) if i % 2 else "0", str(i + 1), [7], row={"i": i}) for i in range(8)]


class Grader(BaseHTTPRequestHandler):
    """Scores exact answers; fails the first call with 503 when asked; when asked to hang, holds
    each call until ``release`` is set."""

    seen: list = []
    active = peak = 0
    fail_first = hang = wait_for_company = False
    lock = threading.Lock()
    release = threading.Event()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.seen.append((self.headers.get("Authorization"), body))
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
            fail, cls.fail_first = cls.fail_first, False
        try:
            time.sleep(0.05)  # a grader's own work: calls overlap when they run at once ...
            deadline = time.monotonic() + 2.0
            while cls.wait_for_company and cls.peak < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # ... on a loaded machine too: a caller that sends at once is seen to
            if cls.hang:
                cls.release.wait(60)
            if fail:
                self.send_response(503)
                self.end_headers()
                return
            out = json.dumps({"score": float(body["response"] == body["label"]), "seen_i": body["metadata"]["i"]})
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out.encode())
        except BrokenPipeError:
            pass  # the client gave up on a hung call: what the test wants
        finally:
            with cls.lock:
                cls.active -= 1

    def log_message(self, *args):
        pass


@pytest.fixture
def grader():
    Grader.seen, Grader.peak, Grader.fail_first, Grader.hang, Grader.wait_for_company = [], 0, False, False, False
    Grader.release = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Grader)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    Grader.release.set()
    server.shutdown()


def scorer(url, *sets):
    return task_reward(load_config(None, ["model.tiny={}", f"data.reward={url}", *sets]).data)


def test_a_remote_grader_scores_with_its_key_and_calls_at_once(grader, tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    Grader.wait_for_company = True
    scores, parts = scorer(grader, f"data.reward_key_file={key}", "data.reward_concurrency=4")(SAMPLES)
    assert scores == [float(i % 2) for i in range(8)] and parts["seen_i"] == list(range(8))
    assert {auth for auth, _ in Grader.seen} == {"Bearer s3cret"}
    body = Grader.seen[0][1]
    assert set(body) == {"prompt", "messages", "response", "response_ids", "label", "row", "metadata", "finish_reason"}
    assert 1 < Grader.peak <= 4  # concurrent, within the limit


def test_a_remote_grader_is_retried_and_bounded(grader):
    Grader.fail_first = True  # one 503, then it answers: retried, the run goes on
    assert scorer(grader, "data.reward_concurrency=1")(SAMPLES[:2])[0] == [0.0, 1.0]
    Grader.hang = True
    calls = len(Grader.seen)
    with pytest.raises(RlhpcError, match=r"the reward http://127.0.0.1:\d+/score raised"):
        scorer(grader, "data.reward_timeout_s=0.5", "data.reward_concurrency=1")(SAMPLES[:1])
    # given up at its time limit while the grader still held the call, and not retried
    assert len(Grader.seen) == calls + 1 and not Grader.release.is_set()
    with Grader.lock:
        assert Grader.active == 1  # the held call: the scorer did not wait for its answer
    assert scorer(grader, "data.reward_timeout_s=0.3", "data.reward_errors=zero")(SAMPLES[:2]) == (
        [0.0, 0.0],
        {"errors": [1.0, 1.0]},
    )


def test_remote_settings_are_checked_at_submit(tmp_path):
    with pytest.raises(ConfigError, match="reward_key_file .* does not exist"):
        load_config(
            None, ["model.tiny={}", "data.reward=http://grader:8000/score", f"data.reward_key_file={tmp_path}/no"]
        )
    with pytest.raises(ConfigError, match="reward_timeout_s"):
        load_config(None, ["model.tiny={}", "data.reward_timeout_s=0"])
