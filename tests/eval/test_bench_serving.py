"""The serving benchmark's measurement code against a server with a known pace (the fake engine
sleeps a fixed time per step), so its TTFT / TPOT / throughput arithmetic is checked."""
import asyncio

import pytest

from eval.bench_serving import run_level, summarize
from serving.config import ServerConfig
from serving.fake_engine import FakeEngine
from testkit import ServerThread

# Long enough that scheduling noise on a busy 2-core machine stays small beside it.
STEP = 0.05


@pytest.fixture(scope="module")
def paced_server():
    config = ServerConfig(model="fake", served_model_name="fake", max_batch=4, max_seq_len=256,
                          compile_cache_dir="", admission_wait_ms=0)
    s = ServerThread(config, FakeEngine(num_slots=4, max_seq_len=256, step_delay=STEP, prefill_batch_sizes=(1, 4)))
    yield s
    s.stop()


def test_output_lengths_follow_the_range_ratio():
    from eval.bench_serving import output_len

    lens = [output_len(i, 64, 0.5) for i in range(200)]
    assert min(lens) >= 32 and max(lens) <= 96 and len(set(lens)) > 20
    assert lens == [output_len(i, 64, 0.5) for i in range(200)]  # the same draws every time
    assert {output_len(i, 64, 0.0) for i in range(50)} == {64}


def test_summarize():
    s = summarize([1.0, 2.0, 3.0, 10.0])
    assert (s["mean"], s["median"], s["n"]) == (4.0, 2.5, 4) and 9.0 < s["p99"] <= 10.0
    assert summarize([])["n"] == 0


def test_levels_measure_the_engine_pace(paced_server):
    # A first request pays one-off costs (connections, lazy imports), as in the benchmark, which
    # also sends one before it measures.
    asyncio.run(run_level(paced_server.url, "fake", 1, 1, 2))
    lone = asyncio.run(run_level(paced_server.url, "fake", 1, 2, 10))
    assert lone["requests"] == 2 and lone["output_tokens"] == 20
    # One prefill step before the first token, then one decode step per token.
    assert STEP <= lone["ttft_s"]["median"] < 4 * STEP
    assert 0.8 * STEP < lone["tpot_s"]["median"] < 2 * STEP
    assert lone["itl_s"]["n"] == 2 * 9
    four = asyncio.run(run_level(paced_server.url, "fake", 4, 2, 10))
    # Four streams share each step: several times the throughput (4x when nothing else runs) at
    # about the same TPOT.
    assert four["output_tokens_per_s"] > 2 * lone["output_tokens_per_s"]
    assert four["tpot_s"]["median"] < 2 * STEP
