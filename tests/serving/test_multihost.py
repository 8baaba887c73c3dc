"""Multi-host serving: `gemma3-serve` as 2 processes on JAX's distributed runtime (gloo over
127.0.0.1), tp=2 with one device in each process, the real Gemma 3 270M in float32.

A real HTTP request to process 0 must return exactly the tokens of the single-process tp=2 model
with the same AllReduce (computed here, in the test process, on 2 of its virtual devices), for the
bf16 and the int8 AllReduce. Then the group must end cleanly on SIGTERM (bf16), and process 0 must
exit with a clear error soon after process 1 is killed (int8).

The wire format, settings and watchdog are checked without starting any process.
"""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx
import jsonschema
import numpy as np
import pytest

from serving import distributed as dist
from serving import wire
import jax_platform
from serving.runner import ChunkInputs, DecodeInputs, RunnerInfo, PrefillInputs, SlotMove
from serving.paged_runner import StepInputs, step_inputs
from serving.paged_scheduler import PagedScheduler
from serving.sampling import IDLE, LogitsExtras, SlotSampling
from serving.scheduler import Sequence
from testkit import free_port, stop_processes, wait_group_ready

ROOT = Path(__file__).resolve().parents[2]
MAX_SEQ_LEN = 32
NEW_TOKENS = 6
STARTUP_TIMEOUT = 600
HEARTBEAT_TIMEOUT = 10  # the coordination service declares a silent process dead after this
STEP_TIMEOUT = 120  # the group's step watchdog
# Process 0 notices a lost peer through the coordination service's heartbeats, or at the latest
# through its step watchdog (a broadcast the dead peer never joins); a loaded machine may delay
# either, so the deadline is the later of them with as much again to spare, not a typical time.
PEER_LOSS_DEADLINE = 2 * (STEP_TIMEOUT + HEARTBEAT_TIMEOUT)
# A clean stop: the HTTP server's drain, the shutdown step, jax's exit wait for the others (30 s).
SHUTDOWN_DEADLINE = 120


# ---- the step wire format, settings and watchdog ----

def _sampling(n: int, rng) -> SlotSampling:
    return SlotSampling(rng.random(n, dtype=np.float32), rng.integers(0, 50, n, dtype=np.int32),
                        rng.random(n, dtype=np.float32), rng.integers(0, 2**32, n, dtype=np.uint32))


SLOT_INFO = RunnerInfo(model_name="t", num_slots=4, max_seq_len=64, prefill_buckets=(16, 32, 64),
                       prefill_batch_sizes=(1, 2), vocab_size=1000, eos_ids=(1,),
                       batched_prefill_max_bucket=32, chunk_size=16, chunk_buckets=(16,))
PAGED_INFO = dataclasses.replace(SLOT_INFO, page_size=4, num_global_pages=65, num_local_pages=40,
                                 max_num_batched_tokens=20, sliding_window=8, prefix_blocks=1)


def _same(a, b) -> None:
    """Equal inputs: arrays bit for bit with their dtypes, records field by field."""
    if isinstance(a, tuple) and hasattr(a, "_fields") or dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        names = a._fields if hasattr(a, "_fields") else [f.name for f in dataclasses.fields(a)]
        for name in names:
            _same(getattr(a, name), getattr(b, name))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)  # bit-exact floats and seeds
    else:
        assert a == b


def test_slot_steps_round_trip_within_the_capacity_from_the_engine_info():
    rng = np.random.default_rng(0)
    pre = PrefillInputs(rng.integers(0, 262144, (2, 32), dtype=np.int32), np.array([5, 32], np.int32),
                        np.array([1, 0], np.int32), _sampling(2, rng), True)
    dec = DecodeInputs(rng.integers(0, 262144, 4, dtype=np.int32), np.array([3, 0, 31, 7], np.int32),
                       _sampling(4, rng))
    chunk = ChunkInputs(rng.integers(0, 1000, 16, dtype=np.int32), 32, 9, 2, _sampling(1, rng), True,
                        (4, 7), -1)
    cap = dist.step_capacity(SLOT_INFO)
    # The largest step is a prefill of 2 x 32 tokens (batches of 2 stop at bucket 32): the
    # header, the tokens, lengths, slots and 4 sampling fields (each with its rank and shape
    # first), the flag.
    assert cap == 2 + (3 + 64) + 2 * (2 + 2) + 4 * (2 + 2) + 1 == 2 + len(wire.encode(pre))
    for kind, inputs in ((dist.PREFILL, pre), (dist.DECODE, dec), (dist.CHUNK, chunk),
                         (dist.MOVE, SlotMove(3, 1))):
        buf = dist.encode_step(kind, inputs, cap)
        assert buf.shape == (cap,) and buf.dtype == np.int32
        got_kind, got = dist.decode_step(buf)
        assert got_kind == kind
        _same(got, inputs)
    for kind in (dist.IDLE, dist.RESET, dist.SHUTDOWN):
        assert dist.decode_step(dist.encode_step(kind, None, cap)) == (kind, None)
    with pytest.raises(ValueError, match="exceeds the broadcast capacity"):
        dist.encode_step(dist.PREFILL, pre, cap - 1)
    with pytest.raises(ValueError, match="carries PrefillInputs"):
        dist.encode_step(dist.PREFILL, dec, cap)
    bad = dist.encode_step(dist.DECODE, dec, cap)
    bad[1] -= 1
    with pytest.raises(ValueError, match="malformed step"):
        dist.decode_step(bad)


def test_paged_steps_round_trip_and_fit_their_capacity():
    """Real steps of the paged scheduler (prompt pieces of 4 sequences, then their decodes)
    travel whole; the largest a step can be (`StepInputs.wire_examples`) sizes the broadcast.
    The logits processing stays behind (process 0 alone samples); images cannot travel."""
    cap = dist.step_capacity(PAGED_INFO)
    sched = PagedScheduler(PAGED_INFO)
    sched.add([Sequence(id=i, prompt=list(range(2, 2 + n)), params=IDLE, seed=i)
               for i, n in enumerate((30, 3, 5, 9))])
    shapes = set()
    for _ in range(6):
        plan = sched.schedule()
        inputs = step_inputs(plan, sched.kv, PAGED_INFO)
        extras = LogitsExtras.neutral(inputs.buckets.seqs, k=2)
        kind, got = dist.decode_step(dist.encode_step(dist.RAGGED, inputs._replace(
            sampling=inputs.sampling._replace(extras=extras)), cap))
        assert kind == dist.RAGGED and got.sampling.extras is None
        _same(got, inputs)
        shapes.add(inputs.buckets)
        for p in plan.pieces:
            if p.sample:
                p.seq.generated.append(5)
    assert {b.queries for b in shapes} == {1, 16}  # prompt pieces and decode-only steps
    examples = StepInputs.wire_examples(PAGED_INFO)
    assert cap == 2 + max(len(wire.encode(e)) for e in examples)
    assert all(max(getattr(e.buckets, f) for e in examples) >= max(getattr(b, f) for b in shapes)
               for f in ("tokens", "seqs", "queries", "global_pages", "local_pages"))
    indexed = inputs._replace(image_index=np.arange(inputs.buckets.tokens, dtype=np.int32) - 1)
    _same(dist.decode_step(dist.encode_step(dist.RAGGED, indexed, cap))[1], indexed)
    with pytest.raises(ValueError, match="step with images cannot be sent"):
        dist.encode_step(dist.RAGGED, inputs._replace(images=(object(),)), cap)


def test_a_step_type_must_say_how_every_field_travels():
    class Partial(NamedTuple):
        tokens: np.ndarray
        new_field: int
        WIRE = dict(tokens=wire.Array(np.int32))

    with pytest.raises(TypeError, match="must list its fields"):
        wire.encode(Partial(np.zeros(2, np.int32), 1))


def test_process_group_from_flags_and_env():
    env = {"GEMMA3_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "4", "GEMMA3_PROCESS_ID": "3"}
    s = jax_platform.group_from({}, env)
    assert (s.coordinator_address, s.num_processes, s.process_id, s.enabled) == ("10.0.0.2:1234", 4, 3, True)
    s = jax_platform.group_from({"process_id": 1, "step_timeout": 20.0}, env)
    assert s.process_id == 1 and s.step_timeout_s == 20.0 and s.heartbeat_s == 2.0
    assert s.local_device_count(16) == 4
    assert not jax_platform.group_from({}, {}).enabled
    assert jax_platform.group_from({"distributed": "auto"}, {}).enabled
    assert jax_platform.group_from({}, {"TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1"}).auto
    assert not jax_platform.group_from({}, {"TPU_WORKER_HOSTNAMES": "t1v-0"}).enabled
    assert not jax_platform.group_from({"distributed": "off"}, {"TPU_WORKER_HOSTNAMES": "a,b"}).enabled
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        s.local_device_count(6)
    with pytest.raises(ValueError, match="process_id must be in"):
        jax_platform.group_from({"process_id": 4}, env)
    with pytest.raises(ValueError, match="need --coordinator-address"):
        jax_platform.group_from({"num_processes": 2, "process_id": 1}, {})
    with pytest.raises(ValueError, match="num_processes: cannot use"):
        jax_platform.group_from({}, {**env, "JAX_NUM_PROCESSES": "two"})


def test_watchdog_fires_only_when_armed_too_long():
    """Behaviour, not timing: a wait disarmed in time never fires, however long one waits after
    it; a wait left armed fires once. (`disarm` says which came first, so a machine that stalls
    past the limit between arm and disarm is told apart from a watchdog that fired wrongly.)"""
    exits, fired = [], threading.Event()

    def exit(code):
        exits.append(code)
        fired.set()

    limit = 0.5
    dog = dist.Watchdog(limit, "testing", exit=exit)
    dog.arm()
    in_time = dog.disarm()
    if in_time:
        assert not fired.wait(3 * limit), "a disarmed wait fired"
        assert exits == []
    else:  # the machine stalled past the limit: then it must have fired, once
        assert fired.wait(60) and exits == [dist.EXIT_PEER_LOST]
        exits.clear()
        fired.clear()
    dog.arm()
    assert fired.wait(60), "an armed wait did not fire"
    assert exits == [dist.EXIT_PEER_LOST]
    dog.close()


# ---- two real processes ----



def _server_command(port: int, cache_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "serving.cli", "--port", str(port), "--tp", "2", "--dtype", "float32",
            "--max-batch", "2", "--compile-cache-dir", str(cache_dir), "--step-timeout", str(STEP_TIMEOUT),
            *args]


def _start_group(allreduce: str, log_dir: Path, cache_dir: Path, *args: str, name: str = "",
                 max_seq_len: int = MAX_SEQ_LEN):
    """Two `gemma3-serve` processes forming one group (tp=2, a device each): (url, procs)."""
    port, coord = free_port(), free_port()
    # One device per process: the test session's 8 virtual devices are not the servers' business.
    env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu"), malloc_tunables=False)
    procs = []
    for pid in range(2):
        cmd = _server_command(port, cache_dir, "--allreduce", allreduce, "--max-seq-len", str(max_seq_len),
                              "--coordinator-address", f"127.0.0.1:{coord}",
                              "--num-processes", "2", "--process-id", str(pid),
                              "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), *args)
        log = open(log_dir / f"{name or allreduce}-p{pid}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return f"http://127.0.0.1:{port}", procs


def _reference(allreduce: str, prompts: list[list[int]]) -> list[list[int]]:
    from equarx import AllReduceConfig
    from models.gemma3 import load_model

    model = load_model("gemma3-270m", tp=2, allreduce=AllReduceConfig(method=allreduce), dtype="float32",
                       max_seq_len=MAX_SEQ_LEN)
    # One prompt per call: the same compiled programs for both.
    return [[int(t) for t in model.generate([ids], NEW_TOKENS)[0]] for ids in prompts]


@pytest.mark.slow
def test_two_processes_match_one_process_then_notice_a_lost_peer(tmp_path_factory):
    """The slot engine (deterministic: chunk steps on every process) with the default int8
    across two processes gives one process's tokens; killing process 1 ends process 0 with
    EXIT_PEER_LOST. (A graceful SIGTERM shutdown of a group: test_group_formation.py.)"""
    allreduce = "int8"
    log_dir = tmp_path_factory.mktemp(f"multihost-{allreduce}")
    cache_dir = tmp_path_factory.getbasetemp() / "multihost-compile-cache"
    # Slot engine steps (chunks, slot moves) are what this group test covers; the paged
    # engine's group is the next test.
    url, procs = _start_group(allreduce, log_dir, cache_dir, "--engine", "slots", "--prefill-batch", "1")
    try:
        from models.gemma3.gguf import default_gguf_path
        from models.gemma3.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(default_gguf_path())
        prompts = [[tok.bos_id] + tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
        want = _reference(allreduce, prompts)  # while the servers start
        wait_group_ready(url, procs, STARTUP_TIMEOUT)

        def ask(ids):
            r = httpx.post(url + "/generate", json={"prompt_ids": ids, "max_tokens": NEW_TOKENS, "ignore_eos": True},
                           timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["token_ids"]

        # Two requests at once: both decode slots in use, in steps every process must follow.
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ask, prompts))
        assert got == want

        # Both prompts in one request (slots 0 and 1), the first stopped early by a stop token:
        # the second then decodes on in its slot beside an idle row.
        stop = next(t for t in want[0][1:] if t not in want[1] and t not in want[0][:1])
        cut = want[0].index(stop) + 1

        def complete(prompt, **kw):
            r = httpx.post(url + "/v1/completions", json={
                "model": "gemma3-270m", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, **kw}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"]

        pair = complete(prompts, stop_token_ids=[stop])
        alone = complete(prompts[1])[0]
        assert pair[0]["finish_reason"] == "stop" and len(pair[0]["logprobs"]["tokens"]) == cut - 1
        # Same tokens; logprobs to float32 noise (a 2-row and a 1-row program round differently).
        assert pair[1]["text"] == alone["text"]
        assert pair[1]["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
        np.testing.assert_allclose(pair[1]["logprobs"]["token_logprobs"], alone["logprobs"]["token_logprobs"],
                                   atol=1e-4)
        metrics = httpx.get(url + "/metrics", timeout=5).text
        moves = [line for line in metrics.splitlines() if line.startswith("gemma3:slot_moves_total")]
        assert moves and float(moves[0].split()[-1]) == 0, moves  # deterministic: slots never move
        health = httpx.get(url + "/health", timeout=5).json()
        assert health["status"] == "ready" and health["tp"] == 2 and health["allreduce"]["method"] == allreduce

        p0, p1 = procs[0][0], procs[1][0]
        p1.kill()
        t0 = time.monotonic()
        try:
            code = p0.wait(PEER_LOSS_DEADLINE)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 still running {PEER_LOSS_DEADLINE}s after process 1 died")
        log0 = Path(procs[0][1].name).read_text()
        assert code == dist.EXIT_PEER_LOST, log0[-2000:]
        assert "FATAL: multi-host serving failed in process 0 of 2" in log0
        print(f"process 0 exited {time.monotonic() - t0:.1f}s after process 1 was killed")
    finally:
        stop_processes(procs)


PAGED_ARGS = ("--engine", "paged", "--deterministic")
PAGED_MAX_SEQ_LEN = 64  # a chat prompt and its JSON answer
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


@pytest.mark.slow
def test_paged_engine_in_a_group_gives_one_process_answers(tmp_path_factory):
    """`--engine paged` as a 2-process group (tp=2 across them): the page allocator and
    scheduler run on process 0, process 1 replays its ragged steps. Every answer (greedy,
    sampled under a json_schema, with logit_bias, with penalties) equals a single-process
    paged server's at tp=2 (deterministic mode: one step shape, so batching cannot change a
    bit); an image request gets a 400 saying why."""
    log_dir = tmp_path_factory.mktemp("multihost-paged")
    cache_dir = tmp_path_factory.getbasetemp() / "multihost-compile-cache"
    group_url, procs = _start_group("int8", log_dir, cache_dir, *PAGED_ARGS, name="paged",
                                    max_seq_len=PAGED_MAX_SEQ_LEN)
    port = free_port()
    env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu"), malloc_tunables=False)
    log = open(log_dir / "paged-single.log", "w")
    cmd = _server_command(port, cache_dir, "--allreduce", "int8", "--max-seq-len", str(PAGED_MAX_SEQ_LEN),
                          *PAGED_ARGS)
    procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    single_url = f"http://127.0.0.1:{port}"
    try:
        wait_group_ready(group_url, procs, STARTUP_TIMEOUT)
        wait_group_ready(single_url, procs, STARTUP_TIMEOUT)
        health = httpx.get(group_url + "/health", timeout=5).json()
        assert health["engine"] == "paged" and health["tp"] == 2 and health["deterministic"]

        def both(path, body):
            """The same request to the group and to the single process, at the same time."""
            def post(url):
                r = httpx.post(url + path, json={"model": "gemma3-270m", **body}, timeout=300)
                assert r.status_code == 200, r.text
                return r.json()["choices"]

            with ThreadPoolExecutor(2) as pool:
                group, single = pool.map(post, (group_url, single_url))
            assert group == single
            return group

        ask = dict(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
        capital, counting = "The capital of France is", "one two one two one two one two"
        # Two prompts in one request: both sequences in every step, each its own pages.
        plain = both("/v1/completions", dict(prompt=[capital, "def fibonacci(n):"], **ask))
        r = httpx.post(group_url + "/generate", json={"prompt": capital, "max_tokens": 1}, timeout=300)
        assert r.status_code == 200, r.text
        banned = r.json()["token_ids"][0]  # the greedy first token, then banned
        biased = both("/v1/completions", dict(prompt=capital, logit_bias={str(banned): -100}, **ask))
        assert biased[0]["logprobs"]["tokens"][0] != plain[0]["logprobs"]["tokens"][0]
        penalties = dict(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.5)
        penalised = both("/v1/completions", dict(prompt=counting, **penalties, **ask))
        assert penalised[0]["text"] != both("/v1/completions", dict(prompt=counting, **ask))[0]["text"]
        structured = both("/v1/chat/completions", dict(
            messages=[{"role": "user", "content": "Is the sky blue? Answer as JSON."}], max_tokens=24,
            temperature=0.7, seed=11,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}))
        jsonschema.validate(json.loads(structured[0]["message"]["content"]), ANSWER)
        pixel = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
                 "z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
        image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": pixel}}]
        r = httpx.post(group_url + "/v1/chat/completions", timeout=30, json={
            "model": "gemma3-270m", "max_tokens": 2, "messages": [{"role": "user", "content": image}]})
        assert r.status_code == 400 and "multi-process group" in r.json()["error"]["message"], r.text
        # SIGTERM to process 0 ends the group cleanly: its shutdown step ends process 1's loop.
        procs[0][0].send_signal(signal.SIGTERM)
        assert [p.wait(SHUTDOWN_DEADLINE) for p, _ in procs[:2]] == [0, 0]
    finally:
        stop_processes(procs)


@pytest.mark.slow
def test_bench_prefill_as_two_processes(tmp_path):
    """eval.bench_prefill joined into a group by the same flags: both processes measure the tp=2
    program spread over them; process 0 writes the report."""
    coord = free_port()
    env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu"), malloc_tunables=False)
    procs = []
    for pid in range(2):
        cmd = [sys.executable, "-m", "eval.bench_prefill", "--model", "random:tiny", "--tp", "2",
               "--lengths", "16", "--allreduce", "int8-full", "--iters", "1", "--no-tpu-prediction",
               "--out", str(tmp_path / f"report{pid}.json"), "--coordinator-address", f"127.0.0.1:{coord}",
               "--num-processes", "2", "--process-id", str(pid)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    import json

    report = json.loads((tmp_path / "report0.json").read_text())
    assert not (tmp_path / "report1.json").exists()
    assert report["mode"].startswith("2 processes (jax.distributed, 2 devices)")
    [row] = report["rows"]
    assert row["method"] == "int8-full" and row["tp"] == 2 and row["median_ms"] > 0
