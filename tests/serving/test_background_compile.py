"""The background compiler (`serving/background_compile.py`): once a server serves, the paged
engine's step shapes the warm-up did not compile are compiled on a low-priority thread, so that
no later step waits for a compile; a step that needs a program being compiled waits for that
compile; a shutdown waits for the program in progress and the process exits cleanly.

The suite turns it off for every other server (tests/conftest.py, tests/testkit.py): here it
runs on a tiny model with few buckets (one page bucket, a budget of 32 tokens).
"""
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

import jax_platform
from equarx import AllReduceConfig
from models.gemma3 import load_model
from serving.background_compile import BackgroundCompiler
from serving.paged_runner import PagedRunner
from testkit import free_port, stop_processes, wait_group_ready
from tests.serving.test_batch_invariance import TINY, generate, prompt

ROOT = Path(__file__).resolve().parents[2]


def small_engine():
    m = load_model(TINY, dtype="float32", allreduce=AllReduceConfig("f32"))  # nothing kept yet
    return m, PagedRunner(m, max_num_seqs=4, max_seq_len=64, page_size=16, long_prefill_token_threshold=16,
                          max_num_batched_tokens=32)


def _first_use_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "compiled on first use" in r.getMessage()]


def test_after_the_background_compile_no_step_compiles(caplog):
    caplog.set_level(logging.INFO, logger="models.gemma3.programs")
    m, engine = small_engine()
    engine.compile_warmup(progress=lambda msg: None)
    engine.warmup(progress=lambda msg: None)
    later = engine.later_programs()
    assert later and not set(later) & m.programs.kept()
    background = BackgroundCompiler(later, m.programs.compile).start()
    assert background.wait(300) and background.compiled == len(later)
    # Work the warm-up did not run (two short prompts in one step of 16 tokens), and more:
    # prompts beside streams, lone prompts of every length up to the budget and past it.
    generate(engine, [prompt(3, 1), prompt(12, 2)], max_tokens=4)
    generate(engine, [prompt(n, seed) for seed, n in enumerate((3, 40, 9, 25))], max_tokens=12)
    generate(engine, [prompt(33, 5)], max_tokens=3)
    for n in (17, 30, 50):
        generate(engine, [prompt(n, n)], max_tokens=2)
    run = {m.ragged_key(b, engine.pages) for b in engine.programs_run}
    assert run & set(later) and run <= m.programs.kept(), run - m.programs.kept()
    assert _first_use_lines(caplog) == []


def test_a_step_that_compiles_on_first_use_says_so_once_per_shape(caplog):
    """Without the warm-up's compile or the background's, each step shape's first run compiles
    its program while every running sequence waits: one log line per shape."""
    caplog.set_level(logging.INFO, logger="models.gemma3.programs")
    _, engine = small_engine()
    generate(engine, [prompt(3, 1)], max_tokens=3)
    generate(engine, [prompt(3, 2)], max_tokens=3)  # the same shapes again: compiled already
    lines = _first_use_lines(caplog)
    assert len(lines) == len(engine.programs_run) >= 2, lines
    assert all(line.startswith("ragged step T=") for line in lines), lines


def test_a_program_a_step_compiled_on_first_use_is_not_compiled_again():
    """The background's list is made at the start; a shape a step met first since then was
    compiled by that step: the background passes over it (compiling it again would cost a
    compile, and a step that needs it would wait for that compile under the step's limit)."""
    m, engine = small_engine()
    generate(engine, [prompt(3, 1)], max_tokens=3)
    ran = [m.ragged_key(b, engine.pages) for b in engine.programs_run]
    lowered = []
    lower = m.programs.lower
    m.programs.lower = lambda key: lowered.append(key) or lower(key)
    background = BackgroundCompiler(ran, m.programs.compile).start()
    assert background.wait(300) and background.compiled == len(ran) >= 2
    assert lowered == []


def test_a_step_waits_for_the_compile_in_progress_instead_of_compiling_again():
    m, engine = small_engine()
    key = engine.later_programs()[0]
    started, compiles = threading.Event(), []
    lower = m.programs.lower

    def slow_lower(k):  # the background's compile of `key` is under way when the step asks
        compiles.append(k)
        started.set()
        threading.Event().wait(1.0)
        return lower(k)

    m.programs.lower = slow_lower
    background = BackgroundCompiler([key], m.programs.compile).start()
    assert started.wait(60)
    runnable = m.programs.runnable(key)  # waits for the background's executable
    assert background.wait(60) and compiles == [key]
    assert runnable is not m.programs.program_of(key) and key in m.programs.kept()


def test_it_compiles_only_while_the_engine_is_idle():
    idle, done = threading.Event(), []
    background = BackgroundCompiler(["a", "b"], done.append, idle=idle.is_set).start()
    assert not background.wait(0.3) and done == []  # requests running: it waits
    idle.set()
    assert background.wait(10) and done == ["a", "b"]


def test_a_server_compiles_in_the_background_answers_meanwhile_and_exits_cleanly(tmp_path):
    port = free_port()
    env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu",
                                              GEMMA3_BACKGROUND_COMPILE="1"), malloc_tunables=False)
    env["EQUARX_NATIVE_CPU"] = "0"  # tp=1 runs no AllReduce
    log_path = tmp_path / "server.log"
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "serving.cli", "--model", TINY, "--dtype", "float32",
           "--max-seq-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
           "--compile-cache-dir", "", "--port", str(port), "--log-level", "info"]
    procs = [(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_group_ready(url, procs, 240)
        r = httpx.post(url + "/generate", json={"prompt_ids": prompt(20, 1), "max_tokens": 4},
                       timeout=120)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 4, r.text
        # SIGTERM while programs are still being compiled (a dozen, in a few seconds): the
        # process ends after the one in progress, with exit code 0.
        procs[0][0].send_signal(signal.SIGTERM)
        assert procs[0][0].wait(150) == 0, log_path.read_text()[-3000:]
        text = log_path.read_text()
        assert "background compile:" in text and "step programs in" in text, text[-3000:]
    finally:
        stop_processes(procs)


def test_the_later_shapes_hold_a_short_piece_beside_a_few_decodes():
    """With 8 sequence rows, 4 decodes and a prompt's 4-token last piece fill the smallest
    token bucket (8) at the 8-row bucket: a shape of its own, which a server meets mid-traffic."""
    from serving.paged_steps import buckets_for, later_buckets
    from serving.runner import RunnerInfo

    info = RunnerInfo(model_name="t", max_num_seqs=8, max_seq_len=256, vocab_size=512, eos_ids=(1,),
                      long_prefill_token_threshold=16, page_size=16, num_global_pages=129, num_local_pages=20,
                      max_num_batched_tokens=64, sliding_window=8)
    step = buckets_for(info, tokens=8, seqs=5, longest_piece=4, pages=1, logits=True)
    assert (step.tokens, step.seqs, step.queries) == (8, 8, 16)
    assert step in later_buckets(info)
