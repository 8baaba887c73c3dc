"""The engine's fake (`serving.fake_runner.fake_paged_runner`: the real PagedRunner, scheduler,
pages and sampler over `FakePagedModel`): it repeats the prompt, as the tests above it expect,
through prompt pieces, page-table growth, a sliding window that outgrows its first pages,
preemption and prefix-cache hits, and a wrong block table raises instead of passing."""

import pytest

from serving.engine_core import EngineCore
from serving.fake_runner import ByteTokenizer, fake_paged_runner
from serving.metrics import Metrics
from serving.paged_steps import step_inputs
from serving.paged_scheduler import PagedScheduler
from serving.sampling import IDLE, SamplingParams
from serving.sequence import Sequence
from testkit import finish_all, running_core

TOK = ByteTokenizer()
# Prompts whose text after BOS has no border (no prefix that is also a suffix): the fake then
# repeats the prompt. 3 to 44 tokens: one piece, several pieces, past the window of 8.
PROMPTS = [[TOK.bos_id] + TOK.encode(t) for t in
           ("Hi!", "The quick brown fox jumps over the lazy dog", "paged attention", "0123456789")]


def answers(engine, prompts, max_tokens=12, core=None):
    """Greedy token ids of every prompt, all submitted at once (through `core` when given, else
    a core of its own); and the core's preemptions."""
    with running_core(engine, core) as c:
        outs = finish_all(c, [(p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True)) for p in prompts], timeout=60)
        preemptions = getattr(c.scheduler, "num_preemptions", 0)
    for o in outs:
        assert o.error is None, o.error
    return [[t.id for t in o.tokens] for o in outs], preemptions


def repeated(p, n):
    """The prompt's tokens after BOS, repeated: the n tokens after it."""
    return [p[1 + (pos - 1) % (len(p) - 1)] for pos in range(len(p), len(p) + n)]


def test_the_fake_repeats_the_prompt_through_pieces_preemption_and_prefix_hits():
    want = [repeated(p, 12) for p in PROMPTS]
    got, _ = answers(fake_paged_runner(max_num_seqs=4, max_seq_len=64), PROMPTS)
    assert got == want
    # Room for 64 tokens of global cache: four sequences growing to 15-56 tokens cannot all fit.
    squeezed, preemptions = answers(fake_paged_runner(max_num_seqs=4, max_seq_len=64, kv_cache_tokens=64),
                                    PROMPTS)
    assert preemptions > 0 and squeezed == want
    engine, metrics = fake_paged_runner(max_num_seqs=4, max_seq_len=64), Metrics("fake", "bf16")
    core = EngineCore(engine, metrics=metrics).start()
    try:
        first, _ = answers(engine, PROMPTS[1:2], core=core)
        again, _ = answers(engine, PROMPTS[1:2], core=core)  # its full pages are cache hits
    finally:
        core.shutdown()
    assert first == again == want[1:2]
    assert metrics.prefix_hits._value.get() == 40  # 44 tokens: 10 pages of 4 before the last


def test_a_wrong_block_table_raises():
    engine = fake_paged_runner(max_num_seqs=2, max_seq_len=64, max_num_batched_tokens=10)
    sched = PagedScheduler(engine.info)
    sched.add([Sequence(id=0, prompt=PROMPTS[1], params=IDLE, seed=0)])
    plan = sched.schedule()
    engine.run_step(step_inputs(plan, sched.kv, engine.info))  # the prompt's first piece: 8 tokens
    plan = sched.schedule()
    inputs = step_inputs(plan, sched.kv, engine.info)
    inputs.batch["global_table"][0, 0] += 1  # the sequence's first page is another one
    with pytest.raises(AssertionError, match="not where its block table says"):
        engine.run_step(inputs)
