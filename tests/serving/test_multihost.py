"""Multi-host serving: `gemma3-serve` as 2 processes on JAX's distributed runtime (gloo over
127.0.0.1), tp=2 with one device in each process, float32.

The engine in deterministic mode (a tiny random model, int8 weights and KV cache) must return
exactly the tokens of the single-process tp=2 model with the int8 AllReduce (computed here, in
the test process), and process 0 must exit with a clear error soon after process 1 is killed.
In its default mode, on a tiny random model with a tiny vision tower, it must answer text and
image requests exactly as a single-process server does, then end cleanly on SIGTERM.

The wire format, settings and watchdog are checked without starting any process, and a
group's image work with its two processes played in this one.
"""
import dataclasses
import json
import os
import re
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
from serving import group_steps
from serving import wire
import jax_platform
from serving.runner import RunnerInfo
from serving.paged_steps import StepInputs, image_features_bucket, step_inputs
from serving.paged_scheduler import PagedScheduler
from serving.sampling import IDLE, LogitsExtras, SamplingMetadata
from serving import group_images as gi
from serving.sequence import SeqImage, Sequence
from testkit import Collector, free_port, stop_processes, wait_group_ready

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

def _sampling(n: int, rng) -> SamplingMetadata:
    return SamplingMetadata(rng.random(n, dtype=np.float32), rng.integers(0, 50, n, dtype=np.int32),
                            rng.random(n, dtype=np.float32), rng.integers(0, 2**32, n, dtype=np.uint32))


PAGED_INFO = RunnerInfo(model_name="t", max_num_seqs=4, max_seq_len=64, vocab_size=1000, eos_ids=(1,),
                        long_prefill_token_threshold=16, page_size=4, num_global_pages=65, num_local_pages=40,
                        max_num_batched_tokens=20, sliding_window=8, prefix_caching=True)


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


def test_steps_without_inputs_round_trip_and_a_malformed_one_is_refused():
    cap = group_steps.step_capacity(PAGED_INFO)
    for kind in (group_steps.IDLE, group_steps.RESET, group_steps.SHUTDOWN):
        assert group_steps.decode_step(group_steps.encode_step(kind, None, cap)) == (kind, None)
    with pytest.raises(ValueError, match="carries no inputs"):
        group_steps.encode_step(group_steps.RESET, PAGED_INFO, cap)
    with pytest.raises(ValueError, match="carries StepInputs"):
        group_steps.encode_step(group_steps.RAGGED, None, cap)
    bad = group_steps.encode_step(group_steps.RESET, None, cap)
    bad[1] += 1
    with pytest.raises(ValueError, match="malformed step"):
        group_steps.decode_step(bad)


def test_paged_steps_round_trip_and_fit_their_capacity():
    """Real steps of the paged scheduler (prompt pieces of 4 sequences, then their decodes)
    travel whole; the largest a step of text can be (`StepInputs.wire_examples`) sizes the
    broadcast. The logits processing stays behind (process 0 alone samples); images travel as
    their keys and spans, without their pixels."""
    cap = group_steps.step_capacity(PAGED_INFO)
    sched = PagedScheduler(PAGED_INFO)
    sched.add([Sequence(id=i, prompt=list(range(2, 2 + n)), params=IDLE, seed=i)
               for i, n in enumerate((30, 3, 5, 9))])
    shapes = set()
    for _ in range(6):
        plan = sched.schedule()
        inputs = step_inputs(plan, sched.kv, PAGED_INFO)
        extras = LogitsExtras.neutral(inputs.buckets.seqs, k=2)
        kind, got = group_steps.decode_step(group_steps.encode_step(group_steps.RAGGED, inputs._replace(
            sampling=inputs.sampling._replace(extras=extras)), cap))
        assert kind == group_steps.RAGGED and got.sampling.extras is None
        _same(got, inputs)
        shapes.add(inputs.buckets)
        for p in plan.pieces:
            if p.sample:
                p.seq.generated.append(5)
    assert {b.queries for b in shapes} == {1, 16}  # prompt pieces and decode-only steps
    # A step longer than one broadcast goes on in more of the same size (its header says how many).
    words = group_steps.encode_step(group_steps.RAGGED, inputs, 64)
    assert group_steps.broadcasts(words[:64]) == len(words) // 64 > 1
    _same(group_steps.decode_step(words)[1], inputs)
    examples = StepInputs.wire_examples(PAGED_INFO)
    assert cap == 2 + max(len(wire.encode(e)) for e in examples)
    assert all(max(getattr(e.buckets, f) for e in examples) >= max(getattr(b, f) for b in shapes)
               for f in ("tokens", "seqs", "queries", "global_pages", "local_pages"))
    images = (SeqImage(((3, 19), (25, 41)), np.ones((2, 8, 8, 3), np.float32), "a" * 64),
              SeqImage(((50, 66),), np.ones((1, 8, 8, 3), np.float32), "b\u00e9"))
    indexed = inputs._replace(image_index=np.arange(inputs.buckets.tokens, dtype=np.int32) - 1,
                              images=images, buckets=dataclasses.replace(
                                  inputs.buckets, features=image_features_bucket(images)))
    got = group_steps.decode_step(group_steps.encode_step(group_steps.RAGGED, indexed, cap))[1]
    assert [(im.spans, im.key, im.pixels) for im in got.images] == [
        (im.spans, im.key, None) for im in images]
    _same(got._replace(images=()), indexed._replace(images=()))
    # (The step's shape, which the watchdog's key names, has its padded feature rows: a new
    # count compiles.)
    assert got.buckets.features == 64
    assert dict(dist._key(group_steps.RAGGED, got)[1])["shape"].endswith("F=64")


def test_image_work_travels_and_both_sides_agree_on_the_features_held():
    """The image steps' inputs round trip (a span's layout with its first listing only);
    features travel as their bytes, float32 and bfloat16 alike; process 0's copy of what the
    others hold and theirs stay alike through the same adds and steps, a step's own images
    never dropped."""
    from serving.image_spans import SpanLayout

    cap = group_steps.step_capacity(PAGED_INFO)
    layout = SpanLayout(np.arange(32, dtype=np.int32).reshape(2, 16), np.arange(8, dtype=np.int32)[None],
                        np.ones((1, 5), np.int32), np.array([2], np.int32))
    image = SeqImage(((4, 20),), None, "k\u00e9y")
    work = gi.SpanWork((gi.SpanTask(7, image, 0, 4, 20, layout), gi.SpanTask(8, image, 0, 4, 20, None)),
                       False)
    for kind, inputs in ((group_steps.ENCODE, gi.EncodeWork(3, True)), (group_steps.SPANS, work),
                         (group_steps.FEATURES, gi.Features("k", "bfloat16", (3, 5)))):
        words = group_steps.encode_step(kind, inputs, cap)
        got_kind, got = group_steps.decode_step(words)
        assert got_kind == kind and wire.encode(got).tolist() == wire.encode(inputs).tolist()
    assert dist._key(group_steps.SPANS, work) == ("spans", (("bounded", False), ("spans", 2)))
    import ml_dtypes

    for dtype in (np.float32, ml_dtypes.bfloat16):
        rows = np.random.default_rng(0).standard_normal((3, 5)).astype(dtype)
        header = gi.Features("k", rows.dtype.name, rows.shape)
        words = gi.to_words(rows)
        assert words.dtype == np.int32 and len(words) == header.words == -(-rows.nbytes // 4)
        padded = np.concatenate([words, np.zeros(7, np.int32)])  # the last piece's zeros
        np.testing.assert_array_equal(gi.from_words(padded, header).view(np.uint8), rows.view(np.uint8))
    leader, other = gi.SharedFeatures(capacity=3), gi.SharedFeatures(capacity=3)
    steps = [("add", "a"), ("add", "b"), ("name", "ab"), ("add", "c"), ("add", "d"), ("name", "dc"),
             ("add", "e"), ("name", "be"), ("name", "e")]
    for op, keys in steps:
        for side in (leader, other):
            side.add(keys, keys.upper()) if op == "add" else side.name(list(keys))
    assert list(leader.items) == list(other.items) == ["c", "b", "e"]
    big = gi.SharedFeatures(capacity=1)
    for k in "xyz":
        big.add(k)
    big.name("xyz")  # more images than it keeps, in one step: none of them dropped
    assert list(big.items) == ["x", "y", "z"]
    with pytest.raises(KeyError, match="never sent"):
        other.get("a")


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


# ---- a group's image work, its two processes played in this one ----

IMAGE_MODEL = "random:tiny?vision=tiny"


def png(seed: int, size=(40, 30)) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def test_a_groups_image_work_replays_on_another_process():
    """Process 0 (`LeaderRunner` over a paged engine, its broadcasts recorded) serves a text
    stream with an image request beside it (the encoder and the image's span staged between
    the stream's steps), then the same image again (features cached) beside two images; a
    `Follower` over a second engine replays the broadcasts. Its pages end bit for bit as
    process 0's, though it encoded nothing: each distinct image's features reached it once,
    and it ran every span stage process 0 ran."""
    import jax

    from equarx import AllReduceConfig
    from jax_platform import ProcessGroup
    from models.gemma3 import load_model
    from serving import media
    from serving.engine_core import EngineCore
    from serving.paged_runner import PagedRunner
    from serving.sampling import SamplingParams

    model = load_model(IMAGE_MODEL, tp=2, dtype="float32", allreduce=AllReduceConfig(method="int8"))
    tokens, per_image = model.vision.tokens, model.vision.config.tokens_per_image

    def make():
        engine = PagedRunner(model, max_num_seqs=4, max_seq_len=128, page_size=4, long_prefill_token_threshold=8)
        engine.encoder_budget_flops = 2e5  # the encoder in several steps, a span in stages
        return engine

    def request(seeds, n=6):
        ids, images = [2, 40 + len(seeds)], []
        for seed in seeds:
            prepared = media.prepare_image(png(seed), size=model.vision.config.image_size)
            ids.append(tokens.start)
            images.append(SeqImage(((len(ids), len(ids) + per_image),), prepared.pixels,
                                   prepared.content_hash))
            ids += [tokens.soft] * per_image + [tokens.end, 9]
        return ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), tuple(images)

    sent = []
    leader = dist.LeaderRunner(make(), ProcessGroup(step_timeout_s=120),
                               broadcast=lambda words: sent.append(words.copy()) or words)
    core = EngineCore(leader, overlap=True).start()
    try:
        # Both in one submit: the image is beside the stream by the engine's steps, whenever
        # this thread runs (a span is staged only while other sequences run).
        stream, beside = Collector(), Collector()
        ids, params, images = request([1])
        core.submit([([2] + list(range(10, 30)), SamplingParams(max_tokens=40, temperature=0.0,
                                                                ignore_eos=True), stream),
                     (ids, params, beside, images)])
        for c in (beside.wait(120), stream.wait(120)):
            assert c.error is None and c.finish == "length"
        for ids, params, images in (request([1]), request([1, 2])):
            done = Collector()
            core.submit([(ids, params, done, images)])
            assert done.wait(120).error is None
    finally:
        core.shutdown()
        leader.close()
    assert leader.images_encoded == 2 and leader.runner.spans.stages_run > 0
    replayed = iter(sent)

    def receive(n):
        words = next(replayed)
        assert len(words) == n
        return words

    follower, kinds = dist.Follower(make(), receive), []
    while kinds[-1:] != [group_steps.SHUTDOWN]:
        kind, inputs = follower.next_step(leader.capacity)
        follower.run(kind, inputs)
        kinds.append(kind)
    assert kinds.count(group_steps.FEATURES) == 2 and group_steps.ENCODE in kinds
    assert follower.runner.images_encoded == 0
    assert follower.runner.spans.stages_run == leader.runner.spans.stages_run
    for mine, theirs in zip(jax.tree.leaves(leader.runner.pages), jax.tree.leaves(follower.runner.pages)):
        np.testing.assert_array_equal(mine, theirs)


# ---- two real processes ----


def _server_command(port: int, cache_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "serving.cli", "--port", str(port), "--tp", "2", "--dtype", "float32",
            "--max-num-seqs", "2", "--compile-cache-dir", str(cache_dir), "--step-timeout", str(STEP_TIMEOUT),
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


# The deterministic group's test: a tiny random model (the group's mechanics do not depend on the
# weights, and three processes compile its programs in seconds, the real 270M's in a minute).
TEXT_MODEL = "random:tiny"


# The deterministic group runs int8 weights and an int8 KV cache: every process quantizes its
# own shards and pages, and must still agree bit for bit (the paged group below runs bf16 ones).
STORAGE = {"quantization": "int8", "kv_cache_dtype": "int8"}


def _reference_model(allreduce: str):
    """The single-process tp=2 model the group must agree with."""
    from equarx import AllReduceConfig
    from models.gemma3 import load_model

    return load_model(TEXT_MODEL, tp=2, allreduce=AllReduceConfig(method=allreduce), dtype="float32",
                      max_seq_len=MAX_SEQ_LEN, **STORAGE)


def _reference(model, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens from forward passes over the whole text so far (one prompt per call)."""
    from tests.serving.test_batch_invariance import reference

    return [[tok for tok, _ in reference(model, [ids], NEW_TOKENS)[0]] for ids in prompts]


@pytest.mark.slow
def test_two_processes_match_one_process_then_notice_a_lost_peer(tmp_path_factory):
    """The engine in deterministic mode (its decode rows and prompt pieces in programs of
    their own on every process), int8 weights and KV cache (`STORAGE`) and the default int8
    AllReduce across two processes gives the model's
    own tokens, a request's logprobs bit for bit alone and beside another; killing process 1
    ends process 0 with EXIT_PEER_LOST. (A graceful SIGTERM shutdown of a group:
    test_group_formation.py and the default mode's group test below.)"""
    allreduce = "int8"
    log_dir = tmp_path_factory.mktemp(f"multihost-{allreduce}")
    cache_dir = tmp_path_factory.getbasetemp() / "multihost-compile-cache"
    model = _reference_model(allreduce)
    url, procs = _start_group(allreduce, log_dir, cache_dir, "--model", TEXT_MODEL, "--served-model-name",
                              "tiny", "--deterministic", *(f"--{k.replace('_', '-')}={v}"
                                                           for k, v in STORAGE.items()))
    try:
        tok = model.tokenizer
        # (The tiny model's greedy text: the first prompt's changes token, the second's does not.)
        prompts = [[tok.bos_id] + tok.encode(p) for p in ("def fibonacci(n):", "The capital of France is")]
        want = _reference(model, prompts)  # while the servers start
        del model
        wait_group_ready(url, procs, STARTUP_TIMEOUT)
        health = httpx.get(url + "/health", timeout=5).json()
        assert (health["weights"]["quantization"], health["kv_cache"]["dtype"]) == ("int8", "int8")

        def ask(ids):
            r = httpx.post(url + "/generate", json={"prompt_ids": ids, "max_tokens": NEW_TOKENS, "ignore_eos": True},
                           timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["token_ids"]

        # Two requests at once: both sequences in every step, which every process must follow.
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ask, prompts))
        assert got == want

        # Both prompts in one request, the first stopped early by a stop token: the second
        # then decodes on alone.
        stop = next(t for t in want[0][1:] if t not in want[1] and t not in want[0][:1])
        cut = want[0].index(stop) + 1

        def complete(prompt, **kw):
            r = httpx.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, **kw}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"]

        pair = complete(prompts, stop_token_ids=[stop])
        alone = complete(prompts[1])[0]
        assert pair[0]["finish_reason"] == "stop" and len(pair[0]["logprobs"]["tokens"]) == cut - 1
        assert pair[1]["logprobs"] == alone["logprobs"]  # batch invariant: bit for bit
        health = httpx.get(url + "/health", timeout=5).json()
        assert health["status"] == "ready" and health["tp"] == 2 and health["deterministic"]
        assert health["allreduce"]["method"] == allreduce

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


# The paged engine's default mode (steps shaped by the work, overlapped), with a step budget of
# one chunk: a lone prompt then goes in chunks too, so the three servers compile fewer step
# shapes. A tiny random model with a tiny tower: the checks are of what travels and runs
# where, which a model of any size shows, and three processes compile its programs in a
# fraction of the 270M's time. A KV cache larger than the test's requests: no cached page is
# evicted, so the two servers' prefix caches stay alike whatever a stream's progress.
PAGED_ARGS = ("--model", IMAGE_MODEL, "--served-model-name", "tiny-vl",
              "--max-num-batched-tokens", "16", "--kv-cache-tokens", "2048")
PAGED_MAX_SEQ_LEN = 128  # an image prompt beside a stream, a chat prompt and its JSON answer
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


def _asker(group_url: str, single_url: str):
    def both(path, body):
        """The same request to the group and to the single process, at the same time."""
        def post(url):
            r = httpx.post(url + path, json={"model": "tiny-vl", **body}, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["choices"]

        with ThreadPoolExecutor(2) as pool:
            group, single = pool.map(post, (group_url, single_url))
        assert group == single
        return group

    return both


def _image_chat(text: str, *seeds: int) -> dict:
    import base64

    parts = [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(png(seed)).decode()}} for seed in seeds]
    return dict(messages=[{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
                max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)


def _beside_a_stream(url: str, body: dict) -> tuple[list, str]:
    """A text stream and, once its first token came, an image request, whose encoder work and
    span then run between the stream's steps: (the image request's choices, the stream's text).
    The stream outlasts the image request, so that every step of the image request has the
    stream's decode beside it in both servers, however far the stream had got."""
    text, image = "", None
    with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
            "model": "tiny-vl", "prompt": "Once upon a time", "max_tokens": 96, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
            if image is None:
                got = httpx.post(url + "/v1/chat/completions", json={"model": "tiny-vl", **body},
                                 timeout=300)
                assert got.status_code == 200, got.text
                image = got.json()["choices"]
    return image, text


def _images_answer_as_one_process(group_url: str, single_url: str, both) -> None:
    """Images through the group: one, two (one of them cached), the same one twice (cached),
    and a new one beside a running stream; each answer equals the single process's."""
    for url in (group_url, single_url):
        card = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]
        assert card["input_modalities"] == ["text", "image"]
    one = both("/v1/chat/completions", _image_chat("What is in this picture?", 1))
    two = both("/v1/chat/completions", _image_chat("What is in this picture?", 2, 1))
    twice = both("/v1/chat/completions", _image_chat("What is in this picture?", 1, 1))
    assert one[0]["logprobs"]["content"] and len({json.dumps(c) for c in (one, two, twice)}) == 3
    # Its text starts apart from every other chat prompt's (no page of it can be a prefix hit).
    with ThreadPoolExecutor(2) as pool:
        (group, group_stream), (single, single_stream) = pool.map(
            lambda url: _beside_a_stream(url, _image_chat("Describe the picture.", 3)),
            (group_url, single_url))
    assert group == single and group_stream == single_stream


@pytest.mark.slow
def test_paged_engine_in_a_group_gives_one_process_answers(tmp_path_factory):
    """The engine as a 2-process group (tp=2 across them) in its default mode: the page
    allocator and scheduler run on process 0, process 1 replays its ragged steps, both in the
    overlapped loop (process 1 feeds steps from its own sampled tokens on the device). Every
    answer (greedy, sampled under a json_schema, with logit_bias, with penalties, with images)
    equals a single-process paged server's at tp=2 bit for bit, logprobs included. Process 0
    alone encodes: process 1 receives each distinct image's features once and runs the image
    spans' stages with it.

    Why equal although this mode is not batch invariant: the two servers get the same requests
    one at a time (each request's sequences arrive together), and the scheduler is a function
    of what arrived, so both plan the same steps at the same shapes; the same programs over the
    same two shards then round the same way, whether the shards sit in one process or two (the
    int8 AllReduce sums in a fixed order, and every process samples the same gathered logits).
    The one request sent beside a stream is planned alike too: the stream decodes in every step
    of it in both servers."""
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
        assert health["engine"] == "paged" and health["tp"] == 2 and not health["deterministic"]
        both = _asker(group_url, single_url)
        ask = dict(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
        capital, counting = "The capital of France is", "one two one two one two one two"
        # Two prompts in one request: both sequences in every step, each its own pages.
        plain = both("/v1/completions", dict(prompt=[capital, "def fibonacci(n):"], **ask))
        # The greedy first token, then banned; asked of both servers, so that both have served
        # the same requests (their schedules, prefix caches included, stay alike).
        first = [httpx.post(url + "/generate", json={"prompt": capital, "max_tokens": 1}, timeout=300)
                 for url in (group_url, single_url)]
        assert [r.status_code for r in first] == [200, 200], first[0].text
        banned = first[0].json()["token_ids"][0]
        assert first[1].json()["token_ids"][0] == banned
        biased = both("/v1/completions", dict(prompt=capital, logit_bias={str(banned): -100}, **ask))
        assert biased[0]["logprobs"]["tokens"][0] != plain[0]["logprobs"]["tokens"][0]
        penalties = dict(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.5)
        penalised = both("/v1/completions", dict(prompt=counting, **penalties, **ask))
        assert penalised[0]["text"] != both("/v1/completions", dict(prompt=counting, **ask))[0]["text"]
        structured = both("/v1/chat/completions", dict(
            messages=[{"role": "user", "content": "Is the sky blue? Answer as JSON."}], max_tokens=64,
            temperature=0.7, seed=11,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}))
        jsonschema.validate(json.loads(structured[0]["message"]["content"]), ANSWER)
        _images_answer_as_one_process(group_url, single_url, both)
        # SIGTERM to process 0 ends the group cleanly: its shutdown step ends process 1's loop.
        procs[0][0].send_signal(signal.SIGTERM)
        assert [p.wait(SHUTDOWN_DEADLINE) for p, _ in procs[:2]] == [0, 0]
        log1 = Path(procs[1][1].name).read_text()
        fed = re.search(r"(\d+) ragged, (\d+) of them fed", log1)
        assert fed and int(fed[2]) > 0, "process 1 never ran a step fed from the one before"
        images = re.search(r"features of (\d+) images? received, (\d+) image span stages run, "
                           r"(\d+) images? encoded", log1)
        assert images and images.groups() == ("3", images[2], "0") and int(images[2]) > 0, log1[-2000:]
    finally:
        stop_processes(procs)


@pytest.mark.slow
def test_bench_prefill_as_two_processes(tmp_path):
    """eval.bench_prefill joined into a group by the same flags: both processes run the lone
    prompt's steps through their paged runners, the tp=2 programs spread over them; process 0
    writes the report."""
    coord = free_port()
    env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu"), malloc_tunables=False)
    procs = []
    for pid in range(2):
        cmd = [sys.executable, "-m", "eval.bench_prefill", "--model", "random:tiny", "--tp", "2",
               "--lengths", "40", "--max-num-batched-tokens", "32", "--allreduce", "int8-full",
               "--iters", "1", "--no-tpu-prediction",
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
    assert row["pieces"] == [32, 8] and row["steps"] == 2 and row["wire_bytes"] > 0
