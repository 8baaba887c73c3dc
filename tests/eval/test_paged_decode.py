"""eval.paged_decode (the decode steps the benchmarks time, without the scheduler) over the real
PagedRunner and the fake model, which reads every row's context back through its block tables
and raises on a misplaced page: the batch's pages, positions and fed tokens are the engine's."""
from eval.paged_decode import DecodeBatch, decode_batch
from serving import SamplingParams, Sequence
from serving.fake_runner import ByteTokenizer, fake_paged_runner

TOK = ByteTokenizer()
# Texts with no border (no prefix that is also a suffix): the fake model's greedy tokens repeat
# each one after its prompt. 3 to 15 tokens: within a page, across pages, past the window of 8.
TEXTS = ("Hi!", "paged attention", "0123456789")
STEPS = 12


def rows():
    return [Sequence(id=i, prompt=[TOK.bos_id] + TOK.encode(t),
                     params=SamplingParams(max_tokens=STEPS + 1, temperature=0.0), seed=0)
            for i, t in enumerate(TEXTS)]


def expected() -> list[list[int]]:
    return [TOK.encode(t * (STEPS + 1))[:STEPS + 1] for t in TEXTS]


def test_steps_one_by_one_continue_every_row():
    engine = fake_paged_runner(max_num_seqs=4, max_seq_len=64)
    batch = DecodeBatch(engine.info, rows())
    first = batch.inputs()  # the prompts, whole
    assert first.rows == 3 and first.buckets.queries > 1
    batch.accept(engine.run_step(first).tokens)
    for _ in range(STEPS):
        step = batch.inputs()
        assert step.buckets.queries == 1 and step.feed is None
        batch.accept(engine.run_step(step).tokens)
    assert [s.generated for s in batch.seqs] == expected()


def test_overlapped_steps_feed_each_row_from_the_step_in_flight():
    engine = fake_paged_runner(max_num_seqs=4, max_seq_len=64)
    batch = DecodeBatch(engine.info, rows())
    prev = None
    for _ in range(STEPS + 1):
        inputs = batch.inputs(fed=prev is not None)
        # Every row's token is the step in flight's sample: none of them is on the host yet.
        assert prev is None or list(inputs.feed[:3]) == [0, 1, 2]
        pending = engine.dispatch_step(inputs, prev)
        if prev is not None:
            batch.accept(prev.result().tokens)
        prev = pending
    batch.accept(prev.result().tokens)
    assert [s.generated for s in batch.seqs] == expected()


def test_a_decode_batch_starts_at_its_context():
    engine = fake_paged_runner(max_num_seqs=4, max_seq_len=64)
    batch = decode_batch(engine.info, 3, 20, TOK.bos_id)
    step = batch.inputs()
    assert step.rows == 3 and step.buckets.queries == 1 and list(step.batch["positions"][:3]) == [19] * 3
    assert list(step.batch["tokens"][:3]) == [TOK.bos_id] * 3
    fed = batch.inputs(fed=True)
    assert list(fed.batch["positions"][:3]) == [20] * 3 and list(fed.feed[:3]) == [0, 1, 2]
    # Each row holds the global pages of its whole context (pages of 4), and no more.
    assert all(len(batch.kv.seqs[i].global_pages) == 21 // 4 + 1 for i in range(3))
