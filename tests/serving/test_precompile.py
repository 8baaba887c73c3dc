"""Nothing compiles after ready: with `--precompile all` (the default) every program a step can
run is compiled before the server says it is ready, so requests at 1-16 streams with prompts up
to the context's length compile nothing while serving. Counted from JAX's own compile events
(`eval.compile_events`), on the engine core a server runs."""
import threading

import numpy as np

from equarx import AllReduceConfig
from eval.compile_events import record_compiles
from models.gemma3 import load_model
from serving import EngineCore, PagedRunner, SamplingParams

TINY = "random:tiny"  # 3 layers, window 8, vocabulary 512


class Request:
    """One request's events, until its last."""

    def __init__(self, core, ids, params):
        self.tokens, self.error, self.done = [], None, threading.Event()
        core.submit([(ids, params, self)])

    def __call__(self, event):
        self.tokens += [t.id for t in event.tokens]
        if event.finish_reason is not None:
            self.error = event.error
            self.done.set()


def test_requests_at_any_stream_count_and_prompt_length_compile_nothing_after_ready():
    m = load_model(TINY, dtype="float32", allreduce=AllReduceConfig("f32"))
    # 16 slots and a step budget of 16 (their decodes fill it): every row bucket (1-16) and
    # token bucket (8, 16) beside the others, 14 step shapes; more slots or a larger budget add
    # rungs of the same ladders, and their compiles.
    runner = PagedRunner(m, max_num_seqs=16, max_seq_len=128, page_size=16,
                         max_num_batched_tokens=16)
    runner.compile_warmup(lambda msg: None, everything=True)
    runner.warmup(lambda msg: None)
    compiles, hits = [], []
    record_compiles(compiles, hits)
    core = EngineCore(runner).start()
    rng = np.random.default_rng(0)
    try:
        for streams in (1, 8, 16, 3):
            lengths = rng.integers(1, 120, streams)
            lengths[0] = 120  # the context's length, with the tokens below
            # Greedy and sampled rows, some reporting alternatives (each its own sampler).
            params = [SamplingParams(max_tokens=6 if i == 0 else 8, ignore_eos=True,
                                     temperature=float(i % 3 == 1), seed=i,
                                     logprobs=2 if i % 4 == 3 else None)
                      for i in range(streams)]
            reqs = [Request(core, [2] + rng.integers(4, 512, n - 1).tolist(), p)
                    for n, p in zip(lengths, params)]
            for r, p in zip(reqs, params):
                assert r.done.wait(600) and r.error is None
                assert len(r.tokens) == p.max_tokens
    finally:
        core.shutdown()
    assert compiles == [] and hits == [], (len(compiles), len(hits))
