"""The engine core with its scheduler and output processor (continuous batching, stops,
cancellation, back-pressure, failures) driven through the deterministic fake engine, which checks
every step it receives. The policy alone, on plain data, is tested in test_scheduler_policy.py."""
import threading
import time

import pytest

from serving.fake_runner import ByteTokenizer, FakeRunner
from serving.sampling import InvalidParameter, SamplingParams
from serving.engine_core import EngineCore, ShuttingDown
from serving.scheduler import QueueFull

TOK = ByteTokenizer()


class Collector:
    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if event.finish_reason is not None:
            self.done.set()

    def wait(self, timeout=10.0):
        assert self.done.wait(timeout), "sequence did not finish"
        return self

    @property
    def text(self):
        return "".join(e.text for e in self.events)

    @property
    def finish(self):
        return self.events[-1].finish_reason


def prompt(text):
    return [TOK.bos_id] + TOK.encode(text)


def expected(text, n):
    """The fake model repeats the prompt."""
    b = text.encode()
    return bytes(b[i % len(b)] for i in range(n)).decode("utf-8", errors="replace")


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@pytest.fixture
def engine():
    return FakeRunner(num_slots=4, max_seq_len=64, prefill_batch_sizes=(1, 4))


def run(engine, requests, **kw):
    s = EngineCore(engine, **kw).start()
    try:
        cols = []
        for text, params in requests:
            c = Collector()
            s.submit([(prompt(text), params, c)])
            cols.append(c)
        for c in cols:
            c.wait()
        return cols
    finally:
        s.shutdown()


def test_continuous_batching_more_requests_than_slots(engine):
    engine.step_delay = 0.002
    reqs = [(f"p{i}-" + "xy" * i, greedy(5 + 3 * i)) for i in range(10)]
    cols = run(engine, reqs)
    for (text, params), c in zip(reqs, cols):
        assert c.text == expected(text, params.max_tokens)
        assert c.finish == "length" and c.events[-1].num_generated == params.max_tokens
    decodes = [n for kind, n in engine.steps if kind == "decode"]
    assert max(decodes) == 4  # all slots busy at once
    # Waiting requests enter as soon as a slot frees, while others are still decoding.
    kinds = [k for k, _ in engine.steps]
    first_decode = kinds.index("decode")
    later_prefills = [i for i, k in enumerate(kinds) if k == "prefill" and i > first_decode]
    assert later_prefills and any(engine.steps[i + 1][0] == "decode" and engine.steps[i + 1][1] > 1
                                  for i in later_prefills)


def test_decode_runs_only_up_to_the_last_busy_slot(engine):
    """A lone sequence decodes one row, not all four slots; a sequence that sits in a higher
    slot after a lower one finished still decodes, with the free slot below it padded."""
    cols = run(engine, [("alone", greedy(6))])
    assert cols[0].text == expected("alone", 6)
    assert set(engine.decode_rows) == {1}
    engine.decode_rows.clear()
    engine.step_delay = 0.002
    reqs = [("short", greedy(3)), ("longer one", greedy(30))]
    cols = run(engine, reqs)  # both prefilled together: slots 0 and 1; slot 0 frees first
    for (text, params), c in zip(reqs, cols):
        assert c.text == expected(text, params.max_tokens)
    assert max(engine.decode_rows) == 2 and engine.decode_rows[-1] == 2
    assert [n for k, n in engine.steps if k == "decode"][-1] == 1  # one busy row of the two


def test_busy_slots_are_packed_so_decode_runs_fewer_rows():
    """With decode programs for 1, 2 and 4 rows, a sequence left alone in a high slot moves to
    slot 0 (its cache rows with it) and decodes as one row; its text is unaffected."""
    engine = FakeRunner(num_slots=4, max_seq_len=64, prefill_batch_sizes=(1, 4), decode_batch_sizes=(1, 2))
    engine.step_delay = 0.002
    reqs = [("aa", greedy(2)), ("bbb", greedy(3)), ("cccc", greedy(4)), ("the long one", greedy(40))]
    s = EngineCore(engine).start()
    try:
        cols = [Collector() for _ in reqs]
        s.submit([(prompt(t), p, c) for (t, p), c in zip(reqs, cols)])  # one prefill, slots 0-3
        for c in cols:
            c.wait()
    finally:
        s.shutdown()
    for (text, params), c in zip(reqs, cols):
        assert c.text == expected(text, params.max_tokens)
    assert (3, 0) in engine.moves
    assert engine.decode_rows[0] == 4 and engine.decode_rows[-1] == 1


def test_short_prompts_are_prefilled_together(engine):
    texts = ["abc", "a longer one", "the longest: 20 chars"]  # buckets 8, 16 and 32
    s = EngineCore(engine).start()
    try:
        cols = [Collector() for _ in texts]
        s.submit([(prompt(t), greedy(4), c) for t, c in zip(texts, cols)])
        for c in cols:
            c.wait()
    finally:
        s.shutdown()
    # One call for the 3 prompts: padded to the batch size 4 and to the longest prompt's bucket.
    assert engine.steps[0] == ("prefill", 4) and engine.prefill_buckets_used[0] == 32
    assert [c.text for c in cols] == [expected(t, 4) for t in texts]


def test_long_prompts_are_prefilled_one_at_a_time(engine):
    # Buckets above batched_prefill_max_bucket (32 in the fake) have batch size 1 only.
    texts = [f"{i}" + "long prompt " * 3 for i in range(3)]
    s = EngineCore(engine).start()
    try:
        cols = [Collector() for _ in texts]
        s.submit([(prompt(t), greedy(2), c) for t, c in zip(texts, cols)])  # queued together
        for c in cols:
            c.wait()
    finally:
        s.shutdown()
    assert engine.steps[:3] == [("prefill", 1)] * 3
    assert [c.text for c in cols] == [t[:2] for t in texts]


def test_stop_token_eos_and_stop_strings(engine):
    s = EngineCore(engine).start()
    try:
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
    finally:
        s.shutdown()
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


def test_cancel_frees_the_slot_at_once(engine):
    engine.step_delay = 0.02
    s = EngineCore(engine).start()
    try:
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
    finally:
        s.shutdown()


def test_queue_full_and_shutdown(engine):
    engine.step_delay = 0.01
    one_slot = FakeRunner(num_slots=1, max_seq_len=64, step_delay=0.01)
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
    engine.step_delay = 0.01
    s = EngineCore(engine).start()
    c = Collector()
    s.submit([(prompt("z"), greedy(60), c)])
    while not c.events:
        time.sleep(0.005)
    s.shutdown(drain_timeout=0.0)
    assert c.wait().finish == "abort"


class FailingEngine(FakeRunner):
    def __init__(self):
        super().__init__(num_slots=2, max_seq_len=64)
        self.fail_next_decode = True
        self.resets = 0

    def run_decode(self, inputs):
        if self.fail_next_decode:
            self.fail_next_decode = False
            raise RuntimeError("device lost")
        return super().run_decode(inputs)

    def reset(self):
        self.resets += 1


def test_engine_failure_fails_running_sequences_and_keeps_serving():
    engine = FailingEngine()
    s = EngineCore(engine).start()
    try:
        bad = Collector()
        s.submit([(prompt("q"), greedy(5), bad)])
        assert bad.wait().finish == "error" and "device lost" in bad.events[-1].error
        assert engine.resets == 1
        good = Collector()
        s.submit([(prompt("ok"), greedy(3), good)])
        assert good.wait().text == "oko"
    finally:
        s.shutdown()


def test_same_seed_same_text_regardless_of_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1234)
    alone = run(engine, [("x", params)])[0].text
    crowd = run(FakeRunner(num_slots=4, max_seq_len=64),
                [("y", SamplingParams(max_tokens=9, temperature=1.0)), ("x", params), ("zz", greedy(4))])
    assert crowd[1].text == alone and len(alone) == 12
    other = run(FakeRunner(num_slots=4, max_seq_len=64), [("x", SamplingParams(max_tokens=12, temperature=0.8, seed=99))])
    assert other[0].text != alone


def test_logprobs_are_reported_when_asked(engine):
    with_lp, without = run(engine, [("ab", greedy(3, logprobs=2)), ("ab", greedy(3))])
    toks = [t for e in with_lp.events for t in e.tokens]
    assert len(toks) == 3 and all(t.logprob is not None and len(t.top) == 2 for t in toks)
    assert all(t.logprob is None for e in without.events for t in e.tokens)


@pytest.mark.parametrize("admission_wait,next_step", [(1.0, "prefill"), (0.0, "decode")])
def test_a_freed_slot_waits_briefly_for_the_next_request(admission_wait, next_step):
    # A client sends its next request shortly after its previous one finished, while another
    # stream keeps decoding. With an admission wait the newcomer is prefilled before the next decode
    # step; without one the step starts at once and the newcomer waits for it.
    engine = FakeRunner(num_slots=2, max_seq_len=64, step_delay=0.01)
    s = EngineCore(engine, admission_wait=admission_wait).start()
    try:
        other, second = Collector(), Collector()
        at_finish = []

        def first(event):
            if event.finish_reason is not None:
                at_finish.append(len(engine.steps))
                threading.Timer(0.1, lambda: s.submit([(prompt("next"), greedy(2), second)])).start()

        s.submit([(prompt("other"), greedy(50), other), (prompt("first"), greedy(3), first)])
        second.wait()
        other.wait()
    finally:
        s.shutdown()
    assert engine.steps[at_finish[0]][0] == next_step
