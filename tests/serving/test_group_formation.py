"""Forming a 2-process group (`gemma3-serve`, random:tiny, tp=2 over two processes) when the
processes load at very different times, and failing clearly when the group cannot form.

gloo's first rendezvous gives up after a fixed 30 s, so two processes whose loading ends more than
30 s apart used to fail at their first collective (and took minutes to say so). The processes now
wait for each other at coordination-service barriers once loaded and once compiled
(--load-timeout), and a group that cannot form ends within its deadline with a clear error.

Process 1's loading is slowed down here by wrapping `serving.runtime.load_configured_model`
(a 32 s gap keeps the test short; GROUP_GAP_S=120 runs the 120 s case, see docs/engine.md).
That group starts with the module, so that the groups that cannot form run their course while
its process 1 is still loading.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import jax_platform
from testkit import free_port, stop_processes, wait_group_ready

ROOT = Path(__file__).resolve().parents[2]
GAP_S = float(os.environ.get("GROUP_GAP_S", "32"))  # > gloo's 30 s first-rendezvous deadline

# Runs gemma3-serve with the model's loading delayed by $LOAD_DELAY seconds.
SLOW_SERVE = """
import os, sys, time
from serving import runtime
load = runtime.load_configured_model
def slow(*a, **k):
    model = load(*a, **k)
    time.sleep(float(os.environ["LOAD_DELAY"]))
    return model
runtime.load_configured_model = slow
from serving.cli import serve_main
serve_main(sys.argv[1:])
"""


def _start(pid: int, port: int, coord: int, delay: float, log_dir: Path, *flags: str):
    env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu", LOAD_DELAY=str(delay)),
                                         malloc_tunables=False)
    cmd = [sys.executable, "-c", SLOW_SERVE, "--model", "random:tiny", "--port", str(port), "--tp", "2",
           "--dtype", "float32", "--max-seq-len", "32", "--max-num-seqs", "2", "--compile-cache-dir", "",
           "--coordinator-address", f"127.0.0.1:{coord}", "--num-processes", "2", "--process-id", str(pid),
           "--heartbeat-timeout", "10", *flags]
    log = open(log_dir / f"p{pid}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log


@pytest.fixture(scope="module")
def late_group(tmp_path_factory):
    """A group whose process 1 loads GAP_S seconds after process 0: (url, procs)."""
    log_dir = tmp_path_factory.mktemp("late-group")
    port, coord = free_port(), free_port()
    timeout = str(int(GAP_S) + 90)
    procs = [_start(0, port, coord, 0, log_dir, "--load-timeout", timeout),
             _start(1, port, coord, GAP_S, log_dir, "--load-timeout", timeout)]
    try:
        yield f"http://127.0.0.1:{port}", procs
    finally:
        stop_processes(procs)


def test_a_group_that_cannot_form_says_so_in_bounded_time(tmp_path, late_group):
    # Runs while `late_group` (started first, for the next test) waits for its process 1.
    # A process that never starts: process 0 gives up at its own --join-timeout (the log names
    # that deadline), not at gloo's or jax's; wait()'s limit only keeps a hang from stalling the
    # suite, it does not measure the deadline.
    procs = [_start(0, free_port(), free_port(), 0, tmp_path, "--join-timeout", "4")]
    try:
        assert procs[0][0].wait(120) == jax_platform.EXIT_GROUP_NOT_FORMED
        log0 = Path(procs[0][1].name).read_text()
        assert "FATAL: the process group did not form" in log0, log0[-2000:]
        assert "within 4s (--join-timeout)" in log0, log0[-2000:]
    finally:
        stop_processes(procs)
    # A process that loads for longer than --load-timeout allows: process 0 ends at that
    # deadline (long before process 1's 60 s delay is over), saying which deadline.
    port, coord = free_port(), free_port()
    procs = [_start(0, port, coord, 0, tmp_path, "--load-timeout", "4"),
             _start(1, port, coord, 60, tmp_path, "--load-timeout", "4")]
    try:
        assert procs[0][0].wait(120) == jax_platform.EXIT_GROUP_NOT_FORMED
        log0 = Path(procs[0][1].name).read_text()
        assert "not every process was loaded within 4s (--load-timeout)" in log0, log0[-2000:]
    finally:
        stop_processes(procs)


def test_group_forms_when_one_process_loads_much_later(late_group):
    url, procs = late_group
    wait_group_ready(url, procs, GAP_S + 120)
    r = httpx.post(url + "/generate", json={"prompt_ids": [2, 40, 41, 42], "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 3, r.text
    log0 = Path(procs[0][1].name).read_text()
    assert "every process loaded (waited" in log0
    waited = float(log0.split("every process loaded (waited ")[1].split("s)")[0])
    assert waited > GAP_S - 5  # longer than gloo's own rendezvous deadline (30 s)
    print(f"process 0 waited {waited:.1f}s for process 1 to load; the group formed")
    procs[0][0].send_signal(signal.SIGTERM)
    assert procs[0][0].wait(60) == 0
    assert procs[1][0].wait(60) == 0
