"""The engine core with its scheduler and output processor (continuous batching, stops,
cancellation, back-pressure, failures) driven through the deterministic fake engine (the real
paged runner over a fake model that checks every step it receives). The policy alone, on plain
data, is tested in test_paged_scheduler.py, the output processor in test_output_processor.py."""
import threading
import time

import pytest

from serving.fake_runner import ByteTokenizer, fake_paged_runner
from serving.sampling import InvalidParameter, SamplingParams
from serving.engine_core import EngineCore, ShuttingDown
from serving.sequence import QueueFull
from testkit import Collector, finish_all, running_core

TOK = ByteTokenizer()


def prompt(text):
    return [TOK.bos_id] + TOK.encode(text)


def expected(text, n):
    """The fake model repeats the prompt."""
    b = text.encode()
    return bytes(b[i % len(b)] for i in range(n)).decode("utf-8", errors="replace")


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def fake(max_num_seqs=4, step_delay=0.0):
    return fake_paged_runner(max_num_seqs=max_num_seqs, max_seq_len=64, step_delay=step_delay)


@pytest.fixture
def engine():
    return fake()


def steps(engine):
    """(sequence rows, tokens) of every step the fake model ran."""
    return engine.model.steps


def run(engine, requests, **kw):
    with running_core(engine, **kw) as s:
        return finish_all(s, [(prompt(text), params) for text, params in requests], timeout=10.0)


def test_continuous_batching_more_requests_than_slots(engine):
    engine.model.step_delay = 0.002
    reqs = [(f"p{i}-" + "xy" * i, greedy(5 + 3 * i)) for i in range(10)]
    cols = run(engine, reqs)
    for (text, params), c in zip(reqs, cols):
        assert c.text == expected(text, params.max_tokens)
        assert c.finish == "length" and c.events[-1].num_generated == params.max_tokens
    assert max(rows for rows, _ in steps(engine)) == 4  # every sequence slot busy at once
    # Waiting requests enter as soon as a sequence ends, in a step beside the others' decodes.
    assert any(rows > 1 and tokens > rows for rows, tokens in steps(engine)[4:])


def test_a_lone_sequence_runs_alone(engine):
    cols = run(engine, [("alone", greedy(6))])
    assert cols[0].text == expected("alone", 6)
    assert {rows for rows, _ in steps(engine)} == {1}


def test_stop_token_eos_and_stop_strings(engine):
    with running_core(engine) as s:
        eos = Collector()
        s.submit([([TOK.bos_id] + TOK.encode("hello") + [TOK.eos_id], greedy(20), eos)])
        stop_id = Collector()
        s.submit([(prompt("abcdef"), greedy(20, stop_token_ids=(TOK.encode("d")[0],)), stop_id)])
        stop_str = Collector()
        s.submit([(prompt("abcdef"), greedy(20, stop=("ef", "zz")), stop_str)])
        ignore = Collector()
        s.submit([([TOK.bos_id] + TOK.encode("hi") + [TOK.eos_id], greedy(5, ignore_eos=True), ignore)])
        for c in (eos, stop_id, stop_str, ignore):
            c.wait()
    assert (eos.text, eos.finish, eos.events[-1].num_generated) == ("hello", "stop", 6)
    assert (stop_id.text, stop_id.finish) == ("abc", "stop")
    assert (stop_str.text, stop_str.finish) == ("abcd", "stop")
    assert (ignore.text, ignore.finish) == ("hihi", "length")  # EOS generated but not ending it


def test_context_limit_is_checked_up_front(engine):
    s = EngineCore(engine)
    with pytest.raises(InvalidParameter, match="maximum context length is 64") as e:
        s.submit([(list(range(300, 364)), greedy(1), Collector())])
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParameter, match="60 in the prompt, 10 in the completion") as e:
        s.submit([(list(range(300, 360)), greedy(10), Collector())])
    assert e.value.param == "max_tokens"


def test_cancel_frees_the_sequence_at_once(engine):
    engine.model.step_delay = 0.02
    with running_core(engine) as s:
        long = Collector()
        ids = s.submit([(prompt("long"), greedy(55), long)])
        while len(long.events) < 3:
            time.sleep(0.005)
        s.cancel(ids)
        long.wait(2.0)
        assert long.finish == "abort" and len(long.events) < 20  # of 55
        assert s.num_running == 0
        after = Collector()
        s.submit([(prompt("next"), greedy(3), after)])
        assert after.wait().text == "nex"


def test_queue_full_and_shutdown():
    one_slot = fake(max_num_seqs=1, step_delay=0.01)
    s = EngineCore(one_slot, max_waiting=2).start()
    try:
        cols = [Collector() for _ in range(3)]
        s.submit([(prompt("a"), greedy(30), cols[0])])
        while s.num_running == 0:
            time.sleep(0.005)
        s.submit([(prompt("b"), greedy(2), cols[1]), (prompt("c"), greedy(2), cols[2])])
        with pytest.raises(QueueFull):
            s.submit([(prompt("d"), greedy(2), Collector())])
        s.stop_accepting()
        with pytest.raises(ShuttingDown):
            s.submit([(prompt("e"), greedy(2), Collector())])
    finally:
        s.shutdown(drain_timeout=10.0)  # the accepted requests are finished, not dropped
    assert [c.finish for c in cols] == ["length"] * 3


def test_shutdown_without_drain_aborts_in_flight(engine):
    engine.model.step_delay = 0.01
    s = EngineCore(engine).start()
    c = Collector()
    s.submit([(prompt("z"), greedy(60), c)])
    while not c.events:
        time.sleep(0.005)
    s.shutdown(drain_timeout=0.0)
    assert c.wait().finish == "abort"


def failing_engine():
    """The fake engine whose first step fails (a device lost), counting its resets."""
    engine = fake(max_num_seqs=2)
    dispatch, reset = engine.dispatch_step, engine.reset
    engine.fail_next, engine.resets = True, 0

    def failing_dispatch(*args):
        if engine.fail_next:
            engine.fail_next = False
            raise RuntimeError("device lost")
        return dispatch(*args)

    def counted_reset():
        engine.resets += 1
        reset()

    engine.dispatch_step, engine.reset = failing_dispatch, counted_reset
    return engine


def test_engine_failure_fails_running_sequences_and_keeps_serving():
    engine = failing_engine()
    with running_core(engine) as s:
        bad = Collector()
        s.submit([(prompt("q"), greedy(5), bad)])
        assert bad.wait().finish == "error" and "device lost" in bad.events[-1].error
        assert engine.resets == 1
        good = Collector()
        s.submit([(prompt("ok"), greedy(3), good)])
        assert good.wait().text == "oko"


def test_same_seed_same_text_regardless_of_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1234)
    alone = run(engine, [("x", params)])[0].text
    crowd = run(fake(),
                [("y", SamplingParams(max_tokens=9, temperature=1.0)), ("x", params), ("zz", greedy(4))])
    assert crowd[1].text == alone and len(alone) == 12
    other = run(fake(), [("x", SamplingParams(max_tokens=12, temperature=0.8, seed=99))])
    assert other[0].text != alone


def test_logprobs_are_reported_when_asked(engine):
    with_lp, without = run(engine, [("ab", greedy(3, logprobs=2)), ("ab", greedy(3))])
    toks = [t for e in with_lp.events for t in e.tokens]
    assert len(toks) == 3 and all(t.logprob is not None and len(t.top) == 2 for t in toks)
    assert all(t.logprob is None for e in without.events for t in e.tokens)


@pytest.mark.parametrize("admission_wait,newcomer_next", [(1.0, True), (0.0, False)])
def test_an_ended_sequence_waits_briefly_for_the_next_request(admission_wait, newcomer_next):
    # A client sends its next request shortly after its previous one finished, while another
    # stream keeps decoding. With an admission wait the newcomer's prompt joins the next step;
    # without one the step starts at once (the other stream's decode alone) and the newcomer
    # waits for it.
    engine = fake(max_num_seqs=2, step_delay=0.01)
    with running_core(engine, admission_wait=admission_wait) as s:
        other, second = Collector(), Collector()
        at_finish = []

        def first(event):
            if event.finish_reason is not None:
                at_finish.append(len(steps(engine)))
                threading.Timer(0.1, lambda: s.submit([(prompt("next"), greedy(2), second)])).start()

        s.submit([(prompt("other"), greedy(50), other), (prompt("first"), greedy(3), first)])
        second.wait()
        other.wait()
    # The step after the one dispatched while the finish was processed (the overlapped loop).
    rows, tokens = steps(engine)[at_finish[0]]
    assert (tokens > rows) == newcomer_next


def test_a_sequence_preempted_as_its_last_token_is_sampled_leaves_the_engine():
    """Pages for two of the sequences' contexts only: the overlapped loop plans the next step
    before the last one's tokens are back, so it can preempt a sequence whose last token that
    step is sampling. The token ends it (its stream gets its last event); it must then leave the
    waiting queue too, not run on unwatched and hold the queue's head for ever. After a failed
    step, a sequence preempted while that step sampled its token recomputes it."""
    engine = fake_paged_runner(max_num_seqs=2, max_seq_len=16, kv_cache_tokens=16, long_prefill_token_threshold=4,
                               page_size=4)
    with running_core(engine) as s:
        a, b = Collector(), Collector()
        s.submit([(prompt("bcd"), greedy(12), b)])
        s.submit([(prompt("efg"), greedy(5), a)])
        assert (a.wait().text, b.wait().text) == (expected("efg", 5), expected("bcd", 12))
        assert s.scheduler.num_preemptions > 0
        c = Collector()
        s.submit([(prompt("hij"), greedy(3), c)])
        assert c.wait().text == expected("hij", 3)
        assert s.num_waiting == 0 and s.num_running == 0
