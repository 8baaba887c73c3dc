"""The step watchdog (`serving/watchdog.py`): a step that never returns must not hang the server.

Real `gemma3-serve` processes (the tiny random model, so they start in seconds) whose engine
call number GEMMA3_TEST_STALL_STEP blocks forever, driven by real HTTP clients: the requests in
flight get a 500 (streamed: an error event) with an OpenAI error body within --step-timeout,
/health and new requests get 503, and SIGTERM ends the process within --shutdown-timeout + 5 s,
also while the stuck step has not yet reached its limit. Then the watchdog, the limits and the
engine core's side without a model.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import jax_platform
from serving.config import from_sources
from serving.engine_core import EngineCore, EngineStuck
from serving.fake_runner import fake_paged_runner
from models.shapes import StepShape
from serving.sampling import SamplingParams
from serving.watchdog import EXIT_STUCK, StepLimits, Watchdog, describe, step_key
from testkit import free_port

ROOT = Path(__file__).resolve().parents[2]
STEP_TIMEOUT = 3.0
SHUTDOWN_TIMEOUT = 2.0
# Two streams of up to 480 tokens, each engine call a step of both: the 250th call comes long
# after both requests arrived and long before either ends.
STALL_STEP = 250
# Both servers' context: one model and one set of programs, which the second reads from the
# cache the first filled.
MAX_SEQ_LEN = 512
STARTUP_TIMEOUT = 240


class Server:
    def __init__(self, name: str, log_dir: Path, cache_dir: Path, stall_step: int, step_timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu"), malloc_tunables=False)
        env["GEMMA3_TEST_STALL_STEP"] = str(stall_step)
        env["EQUARX_NATIVE_CPU"] = "0"  # tp=1 runs no AllReduce: no need to build its CPU kernels
        cmd = [sys.executable, "-m", "serving.cli", "--model", f"random:tiny?max_len={MAX_SEQ_LEN}",
               "--dtype", "float32", "--max-seq-len", str(MAX_SEQ_LEN), "--max-num-seqs", "2",
               "--port", str(self.port),
               "--compile-cache-dir", str(cache_dir), "--step-timeout", str(step_timeout),
               "--compile-timeout", str(max(step_timeout, 60)), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def terminate(self) -> tuple[float, int]:
        """SIGTERM; -> (seconds until the process ended, its exit status)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(SHUTDOWN_TIMEOUT + 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"SIGTERM did not end the server:\n{self.text()[-3000:]}")
        return time.monotonic() - t0, self.proc.returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("watchdog-logs")
    cache = tmp_path_factory.mktemp("watchdog-cache")
    deadline = time.monotonic() + STARTUP_TIMEOUT
    s = {}

    def start(name: str, stall_step: int, step_timeout: float) -> None:
        server = s[name] = Server(name, logs, cache, stall_step, step_timeout)
        while not server.ready():
            if time.monotonic() > deadline:
                pytest.fail(f"{name} not ready:\n" + server.text()[-2000:])
            time.sleep(0.2)

    try:
        start("stuck", STALL_STEP, STEP_TIMEOUT)
        # "late": its stuck step's limit is far off when SIGTERM comes. It starts once "stuck" is
        # ready, so that it reads every program from the cache "stuck" filled.
        start("late", 3, 120.0)
        yield s
    finally:
        for x in s.values():
            x.stop()


def _is_openai_error(body: dict) -> bool:
    e = body.get("error")
    return isinstance(e, dict) and {"message", "type", "param", "code"} <= set(e) and e["message"]


# logprobs: every token is an event, whatever its text.
BODY = {"prompt": "watch the steps", "max_tokens": 480, "ignore_eos": True, "temperature": 0, "logprobs": 0}


def test_a_stuck_step_fails_its_requests_turns_unhealthy_and_sigterm_ends_the_server(servers):
    s = servers["stuck"]
    t0 = time.monotonic()
    got: dict = {}

    def streamed():
        times, lines = [], []
        with httpx.stream("POST", s.url + "/v1/completions", json={**BODY, "stream": True}, timeout=60) as r:
            got["stream_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    times.append(time.monotonic())
                    lines.append(line[6:])
        got["stream"] = (times, lines)

    def plain():
        r = httpx.post(s.url + "/v1/completions", json=BODY, timeout=60)
        got["plain"] = (time.monotonic(), r.status_code, r.json())

    def health():  # the first 503
        while "health" not in got and time.monotonic() - t0 < 30:
            r = httpx.get(s.url + "/health", timeout=5)
            if r.status_code != 200:
                got["health"] = (time.monotonic(), r.status_code, r.json())
            time.sleep(0.05)

    threads = [threading.Thread(target=f) for f in (streamed, plain, health)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    times, lines = got["stream"]
    # The stream: tokens, then the error event and [DONE].
    assert got["stream_status"] == 200 and lines[-1] == "[DONE]"
    error = json.loads(lines[-2])
    assert _is_openai_error(error) and error["error"]["type"] == "server_error", error
    assert "stuck" in error["error"]["message"] and "ragged step" in error["error"]["message"]
    assert len(lines) > 3  # it streamed tokens before the stall
    stalled = times[-3]  # the last token event: the stall began within a step after it
    # The plain request: 500 with an OpenAI error body.
    at, status, body = got["plain"]
    assert status == 500 and _is_openai_error(body) and "stuck" in body["error"]["message"], body
    # /health: 503 with the error.
    h_at, h_status, h_body = got["health"]
    assert h_status == 503 and h_body["status"] == "stuck" and "stuck" in h_body["error"]
    to_error, to_500, to_503 = times[-2] - stalled, at - stalled, h_at - stalled
    print(f"\nstall -> error event {to_error:.2f}s, -> 500 {to_500:.2f}s, -> /health 503 {to_503:.2f}s "
          f"(--step-timeout {STEP_TIMEOUT:g})")
    for seconds in (to_error, to_500, to_503):
        assert STEP_TIMEOUT - 1.5 < seconds < STEP_TIMEOUT + 2.5
    # New requests: 503 with an OpenAI error body.
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(s.url + path, json=body, timeout=10)
        assert r.status_code == 503 and _is_openai_error(r.json()), r.text
        assert "stuck" in r.json()["error"]["message"]
    assert httpx.get(s.url + "/health", timeout=5).status_code == 503
    text = s.text()
    # Two streams decoding: a step of two one-token rows.
    assert "ERROR serving.engine_core: the engine is stuck: a ragged step (shape T=8 S=2 Q=1" in text
    seconds, status = s.terminate()
    print(f"SIGTERM -> exit {seconds:.2f}s (status {status})")
    assert status == EXIT_STUCK and seconds < SHUTDOWN_TIMEOUT + 5, s.text()[-3000:]


def test_sigterm_ends_the_server_while_a_step_is_stuck_short_of_its_limit(servers):
    s = servers["late"]

    def streamed():
        try:
            body = {**BODY, "max_tokens": 200, "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass  # cut off by the shutdown

    client = threading.Thread(target=streamed, daemon=True)
    client.start()
    deadline = time.monotonic() + 30
    while "blocks forever" not in s.text().split("ready in", 1)[-1]:
        assert time.monotonic() < deadline, s.text()[-3000:]
        time.sleep(0.05)
    seconds, status = s.terminate()
    print(f"\nSIGTERM with a step stuck short of its limit -> exit {seconds:.2f}s (status {status})")
    assert status == EXIT_STUCK and seconds < SHUTDOWN_TIMEOUT + 5, s.text()[-3000:]
    assert "did not stop within" in s.text() and "ragged step" in s.text()
    client.join(10)


# ---- without a model ----

def test_watchdog_fires_once_per_arming_and_disarm_says_who_won():
    calls = []
    dog = Watchdog(lambda what, limit: calls.append((what, limit)), timeout_s=0.2)
    dog.arm("quick")
    time.sleep(0.05)
    assert dog.disarm() and not dog.fired
    time.sleep(0.3)
    assert calls == []
    dog.arm("slow step")
    deadline = time.monotonic() + 3
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert calls == [("slow step", 0.2)] and dog.fired
    assert not dog.disarm()  # the watchdog came first: its action owns what follows
    dog.arm("again", 10.0)
    assert not dog.fired and dog.current()[0] == "again"
    # A shorter limit armed over a longer one fires on time.
    t0 = time.monotonic()
    dog.arm("short", 0.1)
    while len(calls) < 2 and time.monotonic() - t0 < 3:
        time.sleep(0.01)
    assert calls[1] == ("short", 0.1) and time.monotonic() - t0 < 1.0
    dog.close()


def test_step_limits_and_keys():
    limits = StepLimits(step_s=2.0, compile_s=50.0)
    k = step_key("ragged", FakeStep(StepShape(8, 8, 1, 16, 2)), feed=True)
    assert k == ("ragged", (("shape", "T=8 S=8 Q=1 Pg=16 Pl=2"), ("feed", True)))
    assert describe(k) == "ragged step (shape T=8 S=8 Q=1 Pg=16 Pl=2, feed True)"
    with_images = step_key("ragged", FakeStep(StepShape(8, 8, 1, 16, 2, features=256)))
    assert describe(with_images) == "ragged step (shape T=8 S=8 Q=1 Pg=16 Pl=2 F=256)"
    assert limits.limit(k) == 50.0
    limits.done(k)
    assert limits.limit(k) == 2.0
    assert limits.limit(step_key("ragged", FakeStep(StepShape(8, 8, 1, 32, 2)), feed=True)) == 50.0
    assert StepLimits(30.0, 10.0).limit("new") == 30.0  # a first run never gets less than a step
    assert describe(step_key("reset")) == "reset step"


class FakeStep:
    def __init__(self, buckets):
        self.buckets = buckets


def test_step_timeout_settings():
    assert (from_sources({}, env={}).step_timeout, from_sources({}, env={}).compile_timeout) == (30.0, 600.0)
    c = from_sources({"compile_timeout": 90.0}, env={"GEMMA3_STEP_TIMEOUT": "4"})
    assert (c.step_timeout, c.compile_timeout) == (4.0, 90.0)
    with pytest.raises(ValueError, match="step_timeout"):
        from_sources({"step_timeout": 0.0}, env={})
    g = jax_platform.group_from({"step_timeout": 4.0, "compile_timeout": 90.0}, {})
    assert (g.step_timeout_s, g.compile_timeout_s, g.heartbeat_s) == (4.0, 90.0, 1.0)


def _slow(slow: set[int], seconds: float, max_num_seqs: int):
    """The fake engine whose steps number `slow` (1-based; the plain loop's `run_step`) take
    `seconds`."""
    engine = fake_paged_runner(max_num_seqs=max_num_seqs, max_seq_len=64)
    run, calls = engine.run_step, []

    def slow_step(inputs):
        calls.append(1)
        if len(calls) in slow:
            time.sleep(seconds)
        return run(inputs)

    engine.run_step = slow_step
    return engine


def _submit(core, n: int, log: list, max_tokens: int = 40):
    def sink(event):
        log.append(event)
    prompt = [2] + [300 + ord(c) for c in "abcdef"]
    return core.submit([(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), sink) for _ in range(n)])


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_engine_core_fails_running_and_waiting_sequences_on_a_stuck_step():
    events, told = [], []
    # A limit well above a fake step's milliseconds even on a loaded machine: only the stalled
    # call may trip it (at 0.3 s a slow step under a full suite's load once did, and the
    # engine thread then ended instead of staying stuck).
    core = EngineCore(fake_paged_runner(max_num_seqs=1, max_seq_len=64), step_timeout=1.0, compile_timeout=1.0,
                      stall_step=4, on_stuck=lambda m: told.append((m, len(events)))).start()
    t0 = time.monotonic()
    _submit(core, 2, events)  # one sequence at a time: one runs, one waits
    assert _wait(lambda: sum(e.finish_reason == "error" for e in events) == 2)
    assert time.monotonic() - t0 < 4.0
    ends = [e for e in events if e.finish_reason]
    assert len(ends) == 2 and all("stuck" in e.error for e in ends)
    assert len(told) == 1 and told[0][1] == len(events) - 2  # unhealthy before the errors went out
    assert core.stuck and "did not finish within 1s" in core.stuck
    with pytest.raises(EngineStuck):
        _submit(core, 1, [])
    t0 = time.monotonic()
    assert core.shutdown(join_timeout=None) is False  # the thread is stuck: no wait for it
    assert time.monotonic() - t0 < 0.5


def test_a_stuck_step_that_returns_late_does_not_resume_serving():
    events = []
    # The third step: the second decode, a shape run before.
    core = EngineCore(_slow({3}, 1.0, max_num_seqs=2), step_timeout=0.3, compile_timeout=5.0,
                      overlap=False).start()
    _submit(core, 1, events)
    assert _wait(lambda: any(e.finish_reason for e in events))
    assert _wait(lambda: not core._thread.is_alive(), 3.0)  # it returned, saw it lost, left
    assert [e.finish_reason for e in events if e.finish_reason] == ["error"]
    assert events[-1].finish_reason == "error"  # nothing after the failure
    assert core.stuck and core.shutdown() is True


def test_a_first_run_of_a_shape_gets_the_compile_limit():
    events = []
    # The first step (a new shape) takes 0.5 s: over the step limit, within the compile limit.
    core = EngineCore(_slow({1}, 0.5, max_num_seqs=2), step_timeout=0.2, compile_timeout=3.0,
                      overlap=False).start()
    _submit(core, 1, events, max_tokens=5)
    assert _wait(lambda: any(e.finish_reason for e in events))
    assert events[-1].finish_reason == "length" and core.stuck is None
    assert core.shutdown() is True
