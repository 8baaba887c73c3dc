"""eval.bench_serving's three modes: `serving`'s measurement code against a server with a known
pace (the paged engine over the fake model, which sleeps a fixed time per step), so its TTFT /
TPOT / throughput arithmetic is checked; `soak` through a real `gemma3-serve` process (64
concurrent streams each equal to the request alone; a soak of whole, cancelled, dropped and bad
requests leaves every slot free, the resident memory flat and the answers as before); and
`structured` against the real app over a tiny random model."""
import asyncio
import statistics
import time
import types

import pytest

from eval import bench_serving
from eval.bench_serving import run_level, summarize
from serving.config import ServerConfig
from serving.fake_runner import fake_paged_runner
from testkit import ServerThread, free_port

# The fake engine's pace: each step sleeps this long. The asserts below take their upper bounds
# from the steps the engine really made (and when), so a slow, shared machine stretches both sides.
STEP = 0.05


def timed_engine(**kw):
    """The paged engine over the fake model, recording (kind, rows) of every step ("decode":
    every row computes one token; "piece": a prompt piece runs, perhaps beside decodes) and when
    it ended: the fake model computes at dispatch, so a step has ended when `dispatch_step`
    returns."""
    engine = fake_paged_runner(**kw)
    engine.steps, engine.ends = [], []
    dispatch = engine.dispatch_step

    def dispatch_step(inputs, prev=None):
        out = dispatch(inputs, prev)
        engine.ends.append(time.perf_counter())
        engine.steps.append(("decode" if inputs.buckets.queries == 1 else "piece", inputs.rows))
        return out

    engine.dispatch_step = dispatch_step  # run_step goes through it too
    return engine


@pytest.fixture(scope="module")
def paced_server():
    # Without overlap a request's steps are exactly its own (the overlapped loop runs an ended
    # sequence one step more), so the counts below are exact.
    config = ServerConfig(model="fake", served_model_name="fake", max_num_seqs=4, max_seq_len=256,
                          compile_cache_dir="", admission_wait_ms=0, overlap=False)
    engine = timed_engine(max_num_seqs=4, max_seq_len=256, step_delay=STEP)
    s = ServerThread(config, engine)
    yield s
    s.stop()


def _level(server, concurrency: int, requests: int, tokens: int):
    """A run_level and the engine's (kind, rows) steps and decode-step gaps during it."""
    first = len(server.runner.steps)
    out = asyncio.run(run_level(server.url, "fake", concurrency, requests, tokens))
    steps = server.runner.steps[first:]
    ends = server.runner.ends[first:]
    gaps = [b - a for (kind, _), a, b in zip(steps[1:], ends, ends[1:]) if kind == "decode"]
    return out, steps, statistics.median(gaps)


def test_output_lengths_follow_the_range_ratio():
    from eval.bench_serving import output_len

    lens = [output_len(i, 64, 0.5) for i in range(200)]
    assert min(lens) >= 32 and max(lens) <= 96 and len(set(lens)) > 20
    assert lens == [output_len(i, 64, 0.5) for i in range(200)]  # the same draws every time
    assert {output_len(i, 64, 0.0) for i in range(50)} == {64}


def test_summarize():
    s = summarize([1.0, 2.0, 3.0, 10.0])
    assert (s["mean"], s["median"], s["max"], s["n"]) == (4.0, 2.5, 10.0, 4) and 9.0 < s["p99"] <= 10.0
    assert summarize([])["n"] == 0


def test_levels_measure_the_engine_pace(paced_server):
    # A first request pays one-off costs (connections, lazy imports), as in the benchmark, which
    # also sends one before it measures.
    asyncio.run(run_level(paced_server.url, "fake", 1, 1, 2))
    lone, steps, engine_gap = _level(paced_server, 1, 2, 10)
    assert lone["requests"] == 2 and lone["output_tokens"] == 20
    assert lone["itl_s"]["n"] == 2 * 9
    # One step of the prompt before the first token (a lone prompt runs whole: the step's
    # budget holds it), then one decode step per token, one row each.
    assert [k for k, _ in steps].count("piece") == 2 and {r for _, r in steps} == {1}
    assert [k for k, _ in steps].count("decode") == 2 * 9
    # The client's TTFT covers at least the prefill's sleep and its TPOT the decode steps' pace:
    # what the engine spent between two decode steps, as the server saw it.
    assert lone["ttft_s"]["median"] >= STEP
    assert 0.8 * STEP < lone["tpot_s"]["median"] < 1.5 * engine_gap
    four, steps, engine_gap = _level(paced_server, 4, 2, 10)
    # Four streams share each step: a step carries several rows at once (the streams' decodes
    # beside the others' prompt pieces), which is where the throughput comes from (4x when
    # nothing else runs), at the engine's pace.
    rows = [r for _, r in steps]
    assert four["output_tokens"] == 80 and max(rows) == 4
    assert sum(rows) / len(rows) > 2
    assert four["tpot_s"]["median"] < 1.5 * engine_gap
    assert four["output_tokens_per_s"] == pytest.approx(80 / four["wall_s"])


def test_64_streams_and_a_soak_leave_nothing_behind(tmp_path):
    report = bench_serving.main([
        "--only", "soak", "--model", "random:tiny", "--dtype", "float32", "--max-seq-len", "256",
        "--seconds", "12", "--port", str(free_port()), "--compile-cache-dir", "",
        "--server-log", str(tmp_path / "server.log")])["soak"]
    assert report["load"]["streams"] == 64 and report["load"]["wrong"] == []
    counts = report["soak"]["requests"]
    assert all(counts[k] > 0 for k in ("whole", "cancelled", "dropped", "bad")), counts
    assert report["soak"]["wrong"] == [] and report["soak"]["bad_request_5xx"] == []
    assert report["after"]["num_requests_running"] == 0
    assert report["after"]["num_requests_waiting"] == 0
    assert report["after"]["kv_cache_usage_perc"] == 0
    # Every reference ran its whole length (ignore_eos), so the comparisons compared something.
    assert [len(r[1]) for r in report["references"]] == bench_serving.MAX_TOKENS
    assert report["checks"] == {k: True for k in report["checks"]}, report["checks"]


def test_structured_outputs_that_finish_validate():
    """A random model's JSON may run out of tokens (finish "length"); every one that finished
    by itself validates against its schema, and required tool calls are valid calls."""
    from models.gemma3 import load_model
    from serving import PagedRunner

    runner = PagedRunner(load_model("random:tiny", dtype="float32", max_seq_len=4096),
                         max_num_seqs=4, max_seq_len=4096)
    server = ServerThread(ServerConfig(model="random:tiny", served_model_name="tiny", max_num_seqs=4,
                                       max_seq_len=4096, compile_cache_dir=""), runner)
    try:
        out = bench_serving.structured(server.url, types.SimpleNamespace(
            max_tokens=64, requests=4, tool_requests=2))
    finally:
        server.stop()
    assert out["requests"] == 4 and out["streamed"] == 2 and out["tool_requests"] == 2
    assert {r["finish_reason"] for r in out["results"]} <= {"stop", "length"}
    assert any(r["finish_reason"] == "stop" for r in out["results"])
    assert all(r["ok"] for r in out["results"] if r["finish_reason"] == "stop"), out
    assert out["tool_calls_valid"] == 2, out


def test_serving_mode_reports_every_level(paced_server, capsys):
    out = bench_serving.serving(paced_server.url, types.SimpleNamespace(
        warmup_requests=1, concurrency="1,2", requests_per_stream=1, max_tokens=4, range_ratio=0.0))
    assert [lv["concurrency"] for lv in out["levels"]] == [1, 2]
    assert [lv["output_tokens"] for lv in out["levels"]] == [4, 8]
    assert out["server"]["id"] == "fake" and "| 2 | 2 |" in capsys.readouterr().out
