"""The engine core's overlapped loop (a step dispatched before the previous one's tokens reach
the host, stops seen one step late) against the plain loop, on the real engine over a tiny
random model, in its default and its deterministic mode: the same tokens, logprobs and finish
reasons; max_tokens, stop tokens and the context limit honoured exactly; the places of sequences
that ended reused; a cancel mid-stream; a multi-process group's loop replayed in one process."""
import threading

import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import load_model
from serving.engine_core import EngineCore
from serving.paged_runner import PagedRunner
from serving.sampling import SamplingParams
from testkit import finish_all, running_core

_model = []


def model():
    if not _model:
        _model.append(load_model("random:tiny", tp=1, dtype="float32", allreduce=AllReduceConfig.from_label("f32")))
    return _model[0]


def prompt(n, seed):
    rng = np.random.default_rng(seed)
    return [2] + rng.integers(4, 512, n - 1).tolist()


class Counting:
    """The engine, counting the steps dispatched fed from a step still in flight."""

    def __init__(self, engine):
        self._engine, self.fed = engine, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def dispatch_step(self, inputs, prev=None):
        self.fed += inputs.feed is not None
        return self._engine.dispatch_step(inputs, prev)


def run(engine, requests, overlap):
    """requests: (prompt, SamplingParams). Returns [(finish_reason, [(id, logprob)], num_generated)]."""
    with running_core(engine, overlap=overlap) as core:
        outs = finish_all(core, requests)
    return [(o.finish, [(t.id, t.logprob) for t in o.tokens], o.events[-1].num_generated)
            for o in outs]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, **kw)


def same(a, b, bitwise):
    """Same finish reasons, tokens and counts; logprobs bit for bit in deterministic mode. (The
    default mode is not batch invariant: a sequence that ended runs one more, discarded, step in
    the overlapped loop, so a step may run a larger program, whose float sums differ in the last
    bits.)"""
    if bitwise:
        assert a == b
        return
    assert [(r, [t for t, _ in got], n) for r, got, n in a] == [(r, [t for t, _ in got], n) for r, got, n in b]
    for (_, x, _), (_, y, _) in zip(a, b):
        np.testing.assert_allclose([lp for _, lp in x], [lp for _, lp in y], rtol=0, atol=1e-4)


# The engines of test_paged_runner.py and test_batch_invariance.py (4 sequences, 96 tokens,
# pages of 4, pieces of 8): the session's compilation cache serves their programs to all three.
def engine_maker(deterministic):
    return lambda: PagedRunner(model(), max_num_seqs=4, max_seq_len=MAX_SEQ_LEN,
                               page_size=4, long_prefill_token_threshold=8, deterministic=deterministic)


MAX_SEQ_LEN = 96


@pytest.mark.parametrize("deterministic", [True, False])
def test_overlapped_loop_gives_the_plain_loops_outputs(deterministic):
    make = engine_maker(deterministic)
    lengths = (1, 2, 3, 9, 17, 5, 12, 30)
    # More requests than sequence slots, different lengths: sequences end at different steps
    # and their places are reused while others run; two sampled (seeded) requests among the greedy ones.
    requests = [(prompt(5 + 3 * i, i), greedy(n, ignore_eos=True)) for i, n in enumerate(lengths)]
    requests += [(prompt(7, 50 + i), SamplingParams(max_tokens=11, temperature=1.0, top_k=40, seed=i,
                                                     logprobs=0, ignore_eos=True)) for i in range(2)]
    requests.append((prompt(72, 99), greedy(24, ignore_eos=True)))  # fills the context (96) exactly
    plain = run(make(), requests, overlap=False)
    engine = Counting(make())
    overlapped = run(engine, requests, overlap=True)
    assert engine.fed > 10  # the overlapped path ran
    same(overlapped, plain, deterministic)
    for (reason, got, n), (_, params) in zip(plain, requests):
        assert reason == "length" and n == len(got) == params.max_tokens

    # Stop tokens: each request stops at a token it generates mid-stream, seen one step late by
    # the overlapped loop, which must still end it right there (the stop token not reported).
    stops = []
    for (_, got, _), (p, _) in zip(plain[:8], requests[:8]):
        ids = [t for t, _ in got]
        if len(ids) >= 3:
            stops.append((p, greedy(MAX_SEQ_LEN - len(p), ignore_eos=True, stop_token_ids=(ids[2],)),
                          ids.index(ids[2])))
    assert stops
    plain_stop = run(make(), [(p, sp) for p, sp, _ in stops], overlap=False)
    overlapped_stop = run(Counting(make()), [(p, sp) for p, sp, _ in stops], overlap=True)
    same(overlapped_stop, plain_stop, deterministic)
    for (reason, got, n), (_, _, k) in zip(plain_stop, stops):
        assert reason == "stop" and len(got) == k and n == k + 1


def make_small():
    return engine_maker(True)()


def test_cancel_while_a_step_is_in_flight():
    engine = Counting(make_small())
    core = EngineCore(engine, overlap=True).start()
    try:
        events, ended = [], threading.Event()

        def sink(e):
            events.append(e)
            if e.finish_reason is not None:
                ended.set()

        [sid] = core.submit([(prompt(6, 1), greedy(80, ignore_eos=True), sink)])
        while sum(len(e.tokens) for e in events) < 5:
            ended.wait(0.01)
        core.cancel([sid])
        assert ended.wait(30)
        assert events[-1].finish_reason == "abort"
        assert sum(e.finish_reason is not None for e in events) == 1
        # Its place is free again and the next request gets the plain loop's output.
        got, done = [], threading.Event()
        core.submit([(prompt(9, 2), greedy(7, ignore_eos=True),
                      lambda e: (got.extend((t.id, t.logprob) for t in e.tokens),
                                 e.finish_reason and done.set()))])
        assert done.wait(60)
    finally:
        core.shutdown()
    plain = run(make_small(), [(prompt(9, 2), greedy(7, ignore_eos=True))], overlap=False)
    assert plain[0][1] == got
    assert engine.fed > 0


def test_a_groups_processes_replay_the_overlapped_loop():
    """A multi-process group's overlapped loop with its two processes played in this one:
    process 0's engine (`LeaderRunner` over a paged engine) runs the core's overlapped loop and
    gives the plain loop's outputs, logits processing among the requests (a step with such a
    row waits for the one in flight instead of being fed); every step it broadcast, replayed
    on a second engine by a `Follower`, which resolves the fed rows against its own sampled
    tokens, leaves that engine's pages bit for bit as process 0's."""
    import jax

    from jax_platform import ProcessGroup
    from serving.distributed import Follower, LeaderRunner
    from serving.group_steps import decode_step

    make = engine_maker(False)
    requests = [(prompt(5 + 3 * i, i), greedy(n, ignore_eos=True)) for i, n in enumerate((3, 9, 17, 5))]
    requests += [(prompt(7, 50), SamplingParams(max_tokens=11, temperature=1.0, top_k=40, seed=1,
                                                logprobs=0, ignore_eos=True)),
                 (prompt(9, 60), greedy(6, ignore_eos=True, logit_bias=((7, -100.0),),
                                        repetition_penalty=1.3))]
    sent = []
    leader = LeaderRunner(make(), ProcessGroup(step_timeout_s=120),
                          broadcast=lambda words: sent.append(words.copy()) or words)
    try:
        overlapped = run(leader, requests, overlap=True)
    finally:
        leader.close()
    same(overlapped, run(make(), requests, overlap=False), bitwise=False)
    follower = Follower(make())
    for words in sent:
        follower.run(*decode_step(words))
    assert follower.fed > 5
    for mine, theirs in zip(jax.tree.leaves(leader.runner.pages), jax.tree.leaves(follower.runner.pages)):
        np.testing.assert_array_equal(mine, theirs)


def test_a_group_whose_step_in_flight_never_ends_stops():
    """The wait for a step process 0 dispatched runs under the group's watchdog: a peer lost
    mid-step (its collective never completes) ends the process with the lost-peer status."""
    from jax_platform import ProcessGroup
    from serving import distributed as dist

    release = threading.Event()

    class Wedged:
        """A dispatched step whose outputs never come (until the test lets it go)."""
        tokens = None

        def result(self):
            release.wait()

    engine = make_small()
    engine.dispatch_step = lambda inputs, prev=None: Wedged()
    exits, ended = [], threading.Event()
    leader = dist.LeaderRunner(engine, ProcessGroup(step_timeout_s=0.5, compile_timeout_s=0.5, heartbeat_s=0.2),
                               broadcast=lambda words: words,
                               exit=lambda status: (exits.append(status), ended.set()))
    core = EngineCore(leader, overlap=True).start()
    try:
        core.submit([(prompt(6, 1), greedy(4, ignore_eos=True), lambda e: None)])
        assert ended.wait(60)
        assert exits[0] == dist.EXIT_PEER_LOST
    finally:
        release.set()
        core.shutdown(join_timeout=30)
        leader.close()
