"""The paged engine end to end on tiny random models (window 8, so prompts overflow the
sliding window): the engine core drives `PagedRunner` through `PagedScheduler`, and every answer
is checked against the model's own (`test_batch_invariance.reference`: an independent path, a
prefill and decode steps over a dense cache, scored by a forward pass without one) and against
itself alone.
"""
import threading

import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import load_model
from serving.engine_core import EngineCore
from serving.metrics import Metrics
from serving.sampling import SamplingParams
from tests.serving.test_batch_invariance import (TINY, generate, log_softmax, model, paged,
                                                 prompt, reference)

PROMPTS = [prompt(n, seed) for seed, n in enumerate((1, 7, 23, 45, 9, 30))]


def tokens_of(results):
    return [[t for t, _ in r] for r in results]


def close(a, b, tol):
    for ra, rb in zip(a, b):
        assert [t for t, _ in ra] == [t for t, _ in rb]
        np.testing.assert_allclose([lp for _, lp in ra], [lp for _, lp in rb], rtol=0, atol=tol)


@pytest.mark.parametrize("tp", [1, 2])
def test_paged_engine_gives_the_models_own_tokens(tp):
    m = model(tp)
    got = generate(paged(m), PROMPTS, max_tokens=6)
    close(got, reference(m, PROMPTS, 6), 1e-4)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_request_alone_and_among_others_agree(deterministic):
    """Deterministic mode runs every decode row in one program and every prompt piece in one
    shape: bit for bit. Otherwise the buckets follow the work, and XLA:CPU's softmax may round
    the last bit differently."""
    m = model(1)
    engine = paged(m, deterministic=deterministic)
    together = generate(engine, PROMPTS, max_tokens=8)
    alone = [generate(engine, [p], max_tokens=8)[0] for p in PROMPTS]
    assert tokens_of(together) == tokens_of(alone)
    close(together, alone, 0.0 if deterministic else 1e-5)
    if deterministic:
        # Two programs: the decode rows' (every slot's row, one query each) and the prompt
        # piece's (one row of a chunk of queries), both over a table of the whole context,
        # read as far as each row's own; they give the default mode's answers.
        run = {(b.seqs, b.queries, b.global_pages) for b in engine.programs_run}
        assert run == {(4, 1, 32), (1, 8, 32)}
        close(together, generate(paged(m), PROMPTS, max_tokens=8), 1e-5)
        # The decode rows read the pages they hold, not the table's width: the same bits
        # under the model's longest --max-seq-len (a decode table of 64 pages, not 32).
        longer = paged(m, deterministic=True, max_seq_len=m.config.max_seq_len)
        close(generate(longer, PROMPTS, max_tokens=8), together, 0.0)


def test_pages_running_out_preempt_and_lose_nothing():
    m = model(1)
    # Room for 96 tokens of global cache: four sequences growing to ~70 tokens cannot all fit.
    engine = paged(m, kv_cache_tokens=96)
    core = EngineCore(engine).start()
    try:
        long = [prompt(40, 10 + i) for i in range(4)]
        together = generate(engine, long, max_tokens=30, core=core)
        preemptions = core.scheduler.num_preemptions
    finally:
        core.shutdown()
    assert preemptions > 0
    alone = [generate(engine, [p], max_tokens=30)[0] for p in long]
    close(together, alone, 1e-5)


def test_a_prefix_hit_gives_what_a_miss_gives_and_is_counted():
    m = model(1)
    engine = paged(m)
    metrics = Metrics("tiny", "f32")
    core = EngineCore(engine, metrics=metrics).start()
    try:
        p = prompt(45, 3)
        first = generate(engine, [p], core=core)
        second = generate(engine, [p], core=core)
        other = generate(engine, [p[:30] + prompt(10, 4)], core=core)
    finally:
        core.shutdown()
    # The hit computes one token where the miss computed the prompt in one piece: other matmul
    # shapes, so float noise (up to 2e-6 over a few prompts), within the default mode's 1e-5.
    close(second, first, 1e-5)
    # the whole prompt but its last token (11 pages of 4), then the 7 full pages of the shared 30
    assert metrics.prefix_hits._value.get() == 44 + 28
    fresh = generate(paged(m, prefix_caching=False), [p[:30] + prompt(10, 4)])
    close(other, fresh, 1e-5)


def test_a_lone_request_runs_one_row_programs():
    m = model(1)
    engine = paged(m, max_num_seqs=8)
    generate(engine, [prompt(20, 1)], max_tokens=5)
    assert engine.programs_run and all(b.seqs == 1 for b in engine.programs_run)
    # Decodes run the smallest token bucket; the lone prompt went in one piece.
    assert {b.tokens for b in engine.programs_run if b.queries == 1} == {8}
    assert [b.queries for b in engine.programs_run].count(32) == 1


def test_after_the_warm_up_lone_requests_compile_nothing():
    """A server's first requests are lone and short (a chat message, a completion), and a
    stream's context grows past the page buckets: the warm-up runs each token bucket's
    prompt piece up to 64 tokens and compiles the lone and full-batch decodes (one table
    width for every step, read as far as the rows' contexts reach), so none of them waits for
    a compile (a first request waited ~6 s for two, a stream crossing 128 tokens stalled 2.5 s,
    on the 270M, when steps had page buckets). A longer prompt may still compile its own
    piece."""
    m = load_model(TINY, dtype="float32", allreduce=AllReduceConfig("f32"))  # nothing kept yet
    engine = paged(m, page_size=16, long_prefill_token_threshold=16, max_seq_len=256)
    engine.compile_warmup(progress=lambda msg: None)
    engine.warmup(progress=lambda msg: None)
    # Lone prompts in every token bucket up to 64, then one decoding past 128 tokens (8 pages
    # of 16); a full batch, its prompts as long as the warm-up's (their pieces are the
    # warm-up's), decoding past 128 tokens too.
    for seed, (n, new) in enumerate(((3, 4), (8, 4), (12, 4), (30, 4), (64, 4), (20, 150))):
        generate(engine, [prompt(n, seed)], max_tokens=new)
    generate(engine, [prompt(17, seed) for seed in range(4)], max_tokens=130)
    run = {m.ragged_key(b, engine.pages) for b in engine.programs_run}
    # Every step's table is the widest (16 pages), however short its rows' contexts.
    assert {b.global_pages for b in engine.programs_run} == {16}
    assert run <= m.programs.kept(), run - m.programs.kept()


def test_the_warm_up_stays_inside_the_context_and_ends_its_sequences():
    """A full batch of prompts nearly as long as the context (deterministic mode's 64-token
    pieces in a 64-token context, pages for exactly 8 contexts): each warm-up sequence ends
    with its second token, as a request of max_tokens=2 would, so none decodes past the
    context nor holds the pages the waiting ones need (they had run to position 125, and the
    warm-up to its 64-step cap)."""
    m = model(1)
    engine = paged(m, deterministic=True, max_num_seqs=8, max_seq_len=64, page_size=16,
                   long_prefill_token_threshold=0)  # the mode's 64
    seen = []
    run_step = engine.run_step

    def spy(inputs):
        seen.append((inputs.rows, int(inputs.batch["positions"].max())))
        return run_step(inputs)

    engine.run_step = spy
    engine.warmup(progress=lambda msg: None)
    assert max(p for _, p in seen) == 63  # the last position of the context
    # the lone prompt and its decode, then the 8 prompts a piece a step beside the decode of
    # the one before, then the last one's decode
    assert len(seen) == 2 + 8 + 1, seen
    assert max(rows for rows, _ in seen) == 2


def model_prompt_logprobs(m, prompts, top=3):
    """What `prompt_logprobs` should give, from one forward pass of the model over each prompt."""
    lps = log_softmax(m.score(prompts))
    return [[(p[t + 1], float(lps[i, t, p[t + 1]]), np.argsort(-lps[i, t], kind="stable")[:top].tolist())
             for t in range(len(p) - 1)] for i, p in enumerate(prompts)]


def prompt_logprobs(engine, prompts, others=()):
    """Each prompt's own logprobs (echo with logprobs=3), submitted beside `others` (plain
    greedy streams): [(token, logprob, top ids)] per prompt position 1..n-1."""
    core = EngineCore(engine).start()
    try:
        got, done = [], []
        for p in list(prompts) + list(others):
            ev, out = threading.Event(), []

            def sink(e, out=out, ev=ev):
                if e.prompt_logprobs:
                    out.extend((t.id, t.logprob, [i for i, _ in t.top]) for t in e.prompt_logprobs)
                if e.finish_reason is not None:
                    ev.set()

            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=3)
            core.submit([(p, params, sink)], prompt_logprobs=p in prompts)
            got.append(out)
            done.append(ev)
        assert all(ev.wait(120) for ev in done)
    finally:
        core.shutdown()
    return got[:len(prompts)]


def test_prompt_logprobs_match_the_models_alone_and_among_others():
    """Echo with logprobs: computed piece by piece (prompts longer than a chunk and the
    window), and never from prefix-cache pages."""
    m = model(1)
    asked = [PROMPTS[3], PROMPTS[5]]
    want = model_prompt_logprobs(m, asked)
    engine, det = paged(m), paged(m, deterministic=True)
    generate(engine, [PROMPTS[3]])  # its pages are now in the prefix cache
    # Deterministic mode too, where decode rows and the prompt piece run in programs apart
    # and the every-token outputs come back in the step's token order.
    for got in (prompt_logprobs(engine, asked), prompt_logprobs(engine, asked, PROMPTS[:3]),
                prompt_logprobs(det, asked, PROMPTS[:3])):
        for g, w, p in zip(got, want, asked):
            assert len(g) == len(p) - 1 and [t for t, _, _ in g] == list(p[1:])
            np.testing.assert_allclose([lp for _, lp, _ in g], [lp for _, lp, _ in w], atol=1e-4)
            assert [top for _, _, top in g] == [top for _, _, top in w]
