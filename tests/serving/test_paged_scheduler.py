"""The paged engine's bookkeeping and policy on plain data: page pools, block tables, the prefix
cache on pages, the token-budget scheduler and its preemption (no model)."""
import dataclasses
import random

import pytest

from serving.runner import RunnerInfo
from serving.kv_pages import SCRATCH, KVPages, PagePool, block_hashes
from serving.paged_scheduler import PagedScheduler
from serving.sampling import InvalidParameter, SamplingParams
from serving.sequence import Sequence


def info(**kw) -> RunnerInfo:
    base = dict(model_name="t", max_num_seqs=4, max_seq_len=256, vocab_size=1000, eos_ids=(1,),
                long_prefill_token_threshold=16, page_size=8, num_global_pages=65, num_local_pages=33,
                max_num_batched_tokens=20, sliding_window=12, prefix_caching=True)
    base.update(kw)
    return RunnerInfo(**base)


def seq(i, n, max_tokens=8, base=100):
    return Sequence(id=i, prompt=[base + (j % 50) for j in range(n)],
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.0), seed=0)


# ---- pools and tables ----

def test_a_pool_never_hands_out_the_scratch_page_and_recycles_least_recent_cached_first():
    pool = PagePool(4)
    pages = [pool.take() for _ in range(3)]
    assert SCRATCH not in pages and pool.num_free == 0
    with pytest.raises(MemoryError):
        pool.take()
    pool.name(pages[0], b"a")
    pool.name(pages[1], b"b")
    pool.release(pages[1])
    pool.release(pages[0])  # cached, a used last
    pool.release(pages[2])  # unnamed: plain free
    assert pool.num_free == 3 and pool.lookup(b"a") == pages[0]
    assert pool.take() == pages[2]  # fresh pages go first
    assert pool.take() == pages[1] and pool.lookup(b"b") is None  # then the LRU cached one
    pool.hold(pages[0])  # a prefix hit brings a cached page back
    assert pool.refs[pages[0]] == 1 and pool.num_free == 0


def test_global_pages_grow_and_local_pages_follow_the_window():
    kv = KVPages(page_size=4, num_global_pages=40, num_local_pages=20, window=10)
    for pos in range(0, 100):
        kv.allocate(7, pos, pos + 1)
        sp = kv.seqs[7]
        assert len(sp.global_pages) == pos // 4 + 1
        first, last = kv.local_span(pos, pos + 1)
        # exactly the pages of positions pos-9..pos are held, and no more
        assert sp.local_first == first and sp.local_first + len(sp.local_pages) - 1 == last
        assert len(sp.local_pages) <= -(-(10 - 1 + 1) // 4) + 1
        g, loc = kv.slot(7, pos)
        assert g // 4 == sp.global_pages[pos // 4] and g % 4 == pos % 4
        assert loc // 4 == sp.local_pages[pos // 4 - sp.local_first]
    assert kv.local_pool.num_free == 19 - len(kv.seqs[7].local_pages)
    kv.free(7)
    assert kv.global_pool.num_free == 39 and kv.local_pool.num_free == 19


def test_a_prefix_is_shared_by_reference_and_needs_its_window_pages_in_both_pools():
    kv = KVPages(page_size=4, num_global_pages=40, num_local_pages=40, window=6)
    tokens = list(range(1, 30))
    hashes = block_hashes(tokens, 4)
    for start in range(0, 28, 4):  # as the scheduler does: named as soon as planned
        kv.allocate(1, start, start + 4)
        kv.name_full_pages(1, hashes, start + 4)
    assert kv.lookup_prefix(hashes, 7) == 7
    kv.attach_prefix(2, hashes, 7)
    a, b = kv.seqs[1], kv.seqs[2]
    assert b.global_pages == a.global_pages  # the same physical pages, no copy
    assert b.local_pages == a.local_pages[-len(b.local_pages):]
    assert all(kv.global_pool.refs[p] == 2 for p in a.global_pages)
    kv.free(1)
    kv.free(2)
    assert kv.lookup_prefix(hashes, 7) == 7  # cached after the holders left
    # The window pages of the end went back and were reused: a shorter prefix may still hit.
    while kv.local_pool._fresh:
        kv.local_pool.take()
    kv.local_pool.take()  # evicts the least recently used local page (page 0 of the prompt)
    assert kv.lookup_prefix(hashes, 7) == 7
    for _ in range(5):
        kv.local_pool.take()
    assert kv.lookup_prefix(hashes, 7) < 7


# ---- the policy ----

def run(sched, steps=500, finish_at=None):
    """Drives the scheduler like the engine core: each sampled token appended; a sequence ends
    at max_tokens. Checks every step's invariants; returns the plans."""
    plans = []
    done = []
    for _ in range(steps):
        if not sched.num_running and not sched.num_waiting:
            break
        alone = sched.num_running + sched.num_waiting == 1
        plan = sched.schedule()
        plans.append(plan)
        assert plan.num_tokens <= sched.info.max_num_batched_tokens
        assert len(plan.pieces) <= sched.info.max_num_seqs
        held = [p for sp in sched.kv.seqs.values() for p in sp.global_pages]
        writers = [p for p in plan.pieces]
        for p in writers:  # a page being written is held by its writer alone
            for pos in range(p.start, p.end):
                g, _ = sched.kv.slot(p.seq.id, pos)
                assert sched.kv.global_pool.refs[g // sched.kv.page_size] == 1
            # Only a lone sequence's piece may exceed the chunk (it takes the budget).
            assert p.end - p.start <= sched.info.long_prefill_token_threshold or (
                alone and not sched.info.deterministic)
        assert len(held) <= sched.info.num_global_pages - 1
        for p in plan.pieces:
            if p.sample:
                p.seq.generated.append(7)
                if len(p.seq.generated) >= p.seq.params.max_tokens:
                    sched.finish(p.seq)
                    done.append(p.seq)
    return plans, done


def test_decodes_go_first_then_prompt_pieces_within_the_budget():
    sched = PagedScheduler(info())
    sched.add([seq(1, 40), seq(2, 5)])
    plan = sched.schedule()  # a chunk, then what is left of the budget of 20
    assert [(p.seq.id, p.start, p.end) for p in plan.pieces] == [(1, 0, 16), (2, 0, 4)]
    plan = sched.schedule()  # one-token pieces first
    assert [(p.seq.id, p.start, p.end, p.sample) for p in plan.pieces] == [
        (2, 4, 5, True), (1, 16, 32, False)]
    plan.pieces[0].seq.generated.append(9)
    plan = sched.schedule()  # the decode goes first
    assert [(p.seq.id, p.start, p.end, p.sample) for p in plan.pieces] == [
        (2, 5, 6, True), (1, 32, 40, True)]


def test_every_sequence_finishes_with_each_position_computed_in_order():
    random.seed(0)
    sched = PagedScheduler(info(max_num_seqs=3))
    seqs = [seq(i, random.randint(1, 60), max_tokens=random.randint(1, 20), base=100 * (i + 1))
            for i in range(12)]
    sched.add(seqs)
    plans, done = run(sched)
    assert sorted(s.id for s in done) == list(range(12))
    for s in seqs:
        covered = [pos for plan in plans for p in plan.pieces if p.seq is s for pos in range(p.start, p.end)]
        assert covered == list(range(len(covered))) or covered[:s.length - 1] == list(range(s.length - 1))
    assert sched.kv.global_pool.num_free == sched.info.num_global_pages - 1


def test_when_pages_run_out_the_newest_sequence_is_preempted_and_recomputes():
    # 9 usable global pages of 8 tokens: two sequences growing to 40 tokens each cannot both fit.
    sched = PagedScheduler(info(num_global_pages=10, max_num_seqs=2, prefix_caching=False))
    a, b = seq(1, 20, max_tokens=20), seq(2, 20, max_tokens=20, base=300)
    sched.add([a, b])
    plans, done = run(sched)
    assert {s.id for s in done} == {1, 2}
    preempted = [s.id for plan in plans for s in plan.preempted]
    assert preempted and set(preempted) == {2}  # the newest gives way
    # b recomputed its text (prompt + the tokens it had) from position 0, and lost none of them
    restarts = [p for plan in plans for p in plan.pieces if p.seq is b and p.start == 0]
    assert len(restarts) == 1 + len(preempted) and len(b.generated) == 20


def _preempted_with_its_token_in_flight():
    """Two sequences outgrowing the pages, stepped as the engine core's overlapped loop does (a
    step is planned before the last one's tokens are back), up to the step that preempts the
    newest while the step in flight samples its next token."""
    sched = PagedScheduler(info(num_global_pages=10, max_num_seqs=2, prefix_caching=False))
    a, b = seq(1, 20, max_tokens=40), seq(2, 20, max_tokens=40, base=300)
    sched.add([a, b])
    in_flight = None
    while True:
        plan = sched.schedule()
        if plan.preempted:
            assert list(plan.preempted) == [b] and any(p.seq is b and p.sample for p in in_flight.pieces)
            return sched, a, b, in_flight
        if in_flight is not None:
            for p in in_flight.pieces:
                if p.sample:
                    p.seq.generated.append(7)
        in_flight = plan


def test_a_sequence_ended_by_the_token_in_flight_as_it_was_preempted_leaves_the_queue():
    sched, a, b, in_flight = _preempted_with_its_token_in_flight()
    b.generated.append(7)  # the token arrives and ends b (EOS, a stop, max_tokens)
    assert not sched.finish(b)
    assert b not in sched.waiting
    c = seq(3, 4, base=500)
    sched.add([c])
    sched.finish(a)
    assert [p.seq for p in sched.schedule().pieces] == [c]


def test_a_sequence_preempted_during_a_failed_step_recomputes_the_token_it_lost():
    sched, a, b, in_flight = _preempted_with_its_token_in_flight()
    assert sched.abort_running() == [a]  # the step failed: its tokens never arrive
    plan = sched.schedule()
    assert [(p.seq, p.start) for p in plan.pieces] == [(b, 0)]


def test_admission_waits_for_pages_and_max_num_seqs():
    sched = PagedScheduler(info(num_global_pages=6, max_num_seqs=8, prefix_caching=False, max_num_batched_tokens=64))
    sched.add([seq(i, 16) for i in range(5)])
    plan = sched.schedule()
    # 5 usable pages of 8 tokens: two 16-token prompts (2 pages each), the third waits
    assert [p.seq.id for p in plan.pieces] == [0, 1] and sched.num_waiting == 3


def repeat_after_it_ran(sched, prompt_logprobs=False):
    """Runs a 37-token prompt (seq 1) to its end, so that its first 4 pages stay in the prefix
    cache, then adds the same prompt again (seq 2): the plan of the step that schedules it."""
    sched.add([seq(1, 37)])
    run(sched)
    again = seq(2, 37)
    again.want_prompt_logprobs = prompt_logprobs
    sched.add([again])
    return again, sched.schedule()


def test_a_prefix_hit_skips_the_cached_pages_and_counts_them():
    sched = PagedScheduler(info())
    again, plan = repeat_after_it_ran(sched)
    assert plan.pieces[0].start == 32 and plan.lookups == ((37, 32),)
    hashes = block_hashes(again.prompt, 8)
    assert sched.kv.seqs[2].global_pages[:4] == [sched.kv.global_pool.lookup(h) for h in hashes[:4]]
    assert all(sched.kv.global_pool.refs[p] == 1 for p in sched.kv.seqs[2].global_pages[:4])


def test_deterministic_pieces_are_whole_chunks_whatever_else_runs():
    sched = PagedScheduler(info(deterministic=True, max_num_batched_tokens=20))
    sched.add([seq(1, 3, max_tokens=30), seq(2, 50)])
    plans, _ = run(sched)
    for plan in plans:
        for p in plan.pieces:
            if p.seq.id == 2 and p.end <= 50:
                assert p.start % 16 == 0 and (p.end - p.start == 16 or p.end == 50)


def test_deterministic_steps_hold_one_prompt_piece_beside_their_decodes():
    """Its one-row program (paged_steps.deterministic_parts): prompts that arrive together
    take turns, a step of decodes and a last one-token piece beside a prompt's chunk."""
    sched = PagedScheduler(info(deterministic=True, max_num_batched_tokens=40))
    sched.add([seq(1, 17, max_tokens=4), seq(2, 20, base=300), seq(3, 5, base=500)])
    plans, _ = run(sched)
    assert all(sum(p.end - p.start > 1 for p in plan.pieces) <= 1 for plan in plans)
    assert [(p.seq.id, p.start, p.end) for p in plans[0].pieces] == [(1, 0, 16)]
    assert [(p.seq.id, p.start, p.end) for p in plans[1].pieces] == [(1, 16, 17), (2, 0, 16)]
    assert any(len(plan.pieces) > 2 for plan in plans)  # decodes beside a piece


def test_a_lone_prompt_takes_the_whole_budget_and_shares_it_when_others_arrive():
    sched = PagedScheduler(info(max_num_batched_tokens=40))
    sched.add([seq(1, 100)])
    first = sched.schedule()
    assert [(p.start, p.end) for p in first.pieces] == [(0, 40)]
    sched.add([seq(2, 5)])  # now it is not alone: chunks, and the newcomer gets the rest
    second = sched.schedule()
    assert [(p.seq.id, p.start, p.end) for p in second.pieces] == [(1, 40, 56), (2, 0, 5)]
    det = PagedScheduler(info(max_num_batched_tokens=40, deterministic=True))
    det.add([seq(1, 100)])
    assert [(p.start, p.end) for p in det.schedule().pieces] == [(0, 16)]


def test_prompt_logprobs_skip_the_prefix_cache_and_are_refused_with_images():
    sched = PagedScheduler(info())
    _, plan = repeat_after_it_ran(sched, prompt_logprobs=True)  # it must compute every prompt token
    assert plan.pieces[0].start == 0 and not plan.lookups
    s = seq(3, 5)
    s.want_prompt_logprobs = True
    s.images = (object(),)
    with pytest.raises(InvalidParameter):
        sched.add([s])


def test_step_buckets_follow_the_rows_and_pieces():
    from serving.paged_steps import buckets_for

    big = info(max_num_seqs=32, max_num_batched_tokens=256, max_seq_len=2048)
    assert buckets_for(big, 1, 1, 1, 3, True).seqs == 1  # a lone decode: one row
    assert [buckets_for(big, n, n, 1, 3, True).seqs for n in (2, 8, 9, 17, 32)] == [8, 8, 16, 32, 32]
    # A step reads the pages its rows hold whatever the table's width (the XLA form): one
    # table, the widest, however long the rows' contexts; the TPU kernel's follow them.
    decode = buckets_for(big, 9, 9, 1, 3, True)
    assert (decode.tokens, decode.queries, decode.global_pages) == (16, 1, 256)
    assert buckets_for(big, 9, 9, 1, 200, True) == decode
    piece = buckets_for(big, 40, 2, 16, 3, True)
    assert (piece.queries, piece.global_pages) == (16, 256)
    tpu = dataclasses.replace(big, attention="pallas")
    assert [buckets_for(tpu, 9, 9, 1, n, True).global_pages for n in (3, 9, 200)] == [8, 16, 256]
    assert buckets_for(tpu, 40, 2, 16, 3, True).global_pages == 8
    lone = buckets_for(big, 200, 1, 200, 40, True)  # a lone prompt's whole-budget piece
    assert (lone.tokens, lone.seqs, lone.queries, lone.global_pages) == (256, 1, 256, 256)
    det = buckets_for(info(max_num_seqs=32, max_num_batched_tokens=48, max_seq_len=2048,
                           deterministic=True), 1, 1, 1, 3, True)
    assert (det.tokens, det.seqs, det.queries, det.global_pages) == (64, 32, 16, 256)
