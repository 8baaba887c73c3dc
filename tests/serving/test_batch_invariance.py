"""Batch invariance, chunked prefill and the prefix cache on the real engine over tiny random models
(window 8, so that prompts overflow the local layers' ring buffers).

- Chunked prefill (model programs): a prompt prefilled in chunks, shorter or longer than the
  window, leaves the cache and the last logits that one prefill of the whole prompt leaves.
- Deterministic mode: a greedy request alone and among concurrent different requests gives the
  same tokens and bit-identical logprobs, at tp=1 and tp=2 with the exact and the token-local
  AllReduces, float32 and bfloat16.
- Prefix cache: a hit gives what a miss gives, the metrics count it, a small cache evicts.
- Prompts longer than the largest compiled prefill bucket are served.
- The policy interleaves a long prompt's chunks with the running sequences' decode steps.
"""

import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import load_model
from serving import group_steps
from serving.runner import ChunkInputs, RunnerInfo, SlotRunner
from serving.engine_core import EngineCore
from serving.metrics import Metrics
from serving.sampling import SamplingParams, SlotSampling
from serving.scheduler import Scheduler, Sequence, block_hashes
from testkit import finish_all, running_core

TINY = "random:tiny"  # 3 layers (the middle one global), window 8, 2 KV heads, vocabulary 512
_models: dict = {}


def model(tp=1, dtype="float32", allreduce="f32"):
    key = (tp, dtype, allreduce)
    if key not in _models:
        _models[key] = load_model(TINY, tp=tp, dtype=dtype, allreduce=AllReduceConfig.from_label(allreduce))
    return _models[key]


def prompt(n, seed):
    rng = np.random.default_rng(seed)
    return [2] + rng.integers(4, 512, n - 1).tolist()


def generate(engine, prompts, max_tokens=6, core=None):
    """Greedy tokens and their logprobs for each prompt, all submitted at once (through `core`
    when given, else a core of its own)."""
    with running_core(engine, core) as c:
        outs = finish_all(c, [(p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True, logprobs=0)) for p in prompts])
    for o in outs:
        assert o.finish == "length", o.error
    return [[(t.id, t.logprob) for t in o.tokens] for o in outs]


# ---- chunked prefill == one prefill ----

@pytest.mark.parametrize("tp,chunk", [(1, 4), (2, 16)])
def test_chunked_prefill_equals_one_prefill(tp, chunk):
    m = model(tp)
    n = 45  # > window 8; chunks of 4 wrap the ring, chunks of 16 overflow it
    ids = prompt(n, 0)
    cache = m.init_cache(2, 64)
    tokens = np.zeros((1, 64), np.int32)
    tokens[0, :n] = ids
    ref, cache = m.prefill(cache, tokens, np.array([n]), np.array([0]))
    for start in range(0, n, chunk):
        length = min(chunk, n - start)
        t = np.zeros((1, chunk), np.int32)
        t[0, :length] = ids[start:start + length]
        logits, kv = m.prefill_chunk(cache, t, start, length, 1)
        cache = m.write_chunk(cache, kv, start, length, 1)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-5)
    for layer in cache.layers:
        k, v = np.asarray(layer.k), np.asarray(layer.v)
        held = min(n, k.shape[-1])  # global rows: positions 0..n-1; ring rows: all W entries
        np.testing.assert_allclose(k[1, ..., :held], k[0, ..., :held], atol=2e-5)
        np.testing.assert_allclose(v[1, :, :held], v[0, :, :held], atol=2e-5)
    # Decoding on from both rows gives the same next logits.
    logits, cache = m.decode_step(cache, np.array([7, 7]), np.array([n, n]))
    logits = np.asarray(logits)
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-5)


def test_chunk_padding_near_the_end_of_the_cache():
    """A last chunk padded past the global rows' end keeps the positions before it."""
    m = model()
    n = 30  # cache of 32 positions; the chunk at 16 is padded to 16 tokens: fits, at 24 it would not
    ids = prompt(n, 1)
    cache = m.init_cache(2, 32)
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :n] = ids
    ref, cache = m.prefill(cache, tokens, np.array([n]), np.array([0]))
    for start, length in ((0, 8), (8, 8), (16, 8), (24, 6)):
        t = np.zeros((1, 16), np.int32)
        t[0, :length] = ids[start:start + length]
        logits, kv = m.prefill_chunk(cache, t, start, length, 1)
        cache = m.write_chunk(cache, kv, start, length, 1)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-5)
    g = np.asarray(cache.layers[1].k)  # the global layer
    np.testing.assert_allclose(g[1, ..., :n], g[0, ..., :n], atol=2e-5)


# ---- deterministic (batch-invariant) mode ----

# (tp, dtype, AllReduce): tp=1, and tp=2 with the exact psums and both token-local modes.
CONFIGS = [(1, "bfloat16", "f32"), (2, "float32", "f32"), (2, "bfloat16", "bf16"),
           (2, "bfloat16", "bf16_ring"), (2, "float32", "int8"), (2, "bfloat16", "int8")]


@pytest.mark.parametrize("tp,dtype,allreduce", CONFIGS)
def test_a_request_alone_equals_it_among_others(tp, dtype, allreduce):
    engine = SlotRunner(model(tp, dtype, allreduce), num_slots=4, max_seq_len=96, chunk_size=16,
                         deterministic=True)
    target = prompt(37, 7)
    others = [prompt(n, 10 + i) for i, n in enumerate((5, 60, 23, 14, 41))]
    alone = generate(engine, [target])[0]
    mixed = generate(engine, others[:2] + [target] + others[2:])
    assert mixed[2] == alone  # tokens and bit-identical logprobs


def test_deterministic_engine_compiles_one_decode_program():
    engine = SlotRunner(model(), num_slots=4, max_seq_len=96, chunk_size=16, deterministic=True)
    info = engine.info
    assert info.decode_row_counts == (4,) and info.prefill_batch_sizes == (1,)
    assert info.chunk_buckets == (16,) and info.warm_buckets == ()
    assert all(info.chunked(n) for n in (1, 16, 95))


# ---- prefix cache ----

def test_prefix_cache_hit_equals_a_miss_and_is_counted():
    m = model()
    shared = prompt(50, 3)
    a, b = shared + prompt(9, 4)[1:], shared[:48] + prompt(20, 5)[1:]  # b shares 3 blocks of 16
    fresh = SlotRunner(m, num_slots=2, max_seq_len=96, chunk_size=16, deterministic=True)
    miss_b = generate(fresh, [b])[0]
    engine = SlotRunner(m, num_slots=2, max_seq_len=96, chunk_size=16, deterministic=True,
                         prefix_blocks=16)
    metrics = Metrics("tiny", "f32")
    core = EngineCore(engine, metrics=metrics).start()
    first_a = generate(engine, [a], core=core)[0]
    assert metrics.prefix_hits._value.get() == 0
    assert generate(engine, [b], core=core)[0] == miss_b
    assert metrics.prefix_hits._value.get() == 48
    assert generate(engine, [a], core=core)[0] == first_a
    core.shutdown()
    assert metrics.prefix_hits._value.get() == 48 + 48  # (58 - 1) // 16 = 3 blocks
    assert metrics.prefix_queries._value.get() == len(a) * 2 + len(b)
    text = metrics.render().decode()
    assert "gemma3:prefix_cache_hits_total" in text and "gemma3:prefix_cache_queries_total" in text


def test_prefix_cache_evicts_least_recently_used_blocks():
    m = model()
    engine = SlotRunner(m, num_slots=2, max_seq_len=96, chunk_size=16, deterministic=True,
                         prefix_blocks=2)
    metrics = Metrics("tiny", "f32")
    core = EngineCore(engine, metrics=metrics).start()
    a, b = prompt(40, 21), prompt(40, 22)  # two full blocks each
    first_a = generate(engine, [a], core=core)[0]
    generate(engine, [b], core=core)  # evicts a's blocks
    assert generate(engine, [a], core=core)[0] == first_a  # a miss again, same output
    assert metrics.prefix_hits._value.get() == 0
    assert generate(engine, [a], core=core)[0] == first_a  # now a hit
    assert metrics.prefix_hits._value.get() == 32
    core.shutdown()
    assert len(engine._blocks) <= 2
    assert metrics.prefix_blocks._value.get() == 2 and metrics.prefix_capacity._value.get() == 2


def test_prefix_cache_policy_on_plain_data():
    info = RunnerInfo(model_name="plain", num_slots=2, max_seq_len=64, prefill_buckets=(8, 16, 32, 64),
                      prefill_batch_sizes=(1,), vocab_size=600, eos_ids=(1,), chunk_size=8,
                      chunk_buckets=(8,), deterministic=True, prefix_blocks=3)
    s = Scheduler(info)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    p = list(range(10, 34))  # 24 tokens: 3 blocks, the last one recomputed on a hit
    a = Sequence(1, p, params, seed=0)
    s.add([a])
    steps = [s.schedule().chunk for _ in range(3)]
    assert [(c.start, c.length, c.save_block >= 0, c.final) for c in steps] == [
        (0, 8, True, False), (8, 8, True, False), (16, 8, True, True)]
    s.finish(a)
    b = Sequence(2, p, params, seed=0)
    s.add([b])
    c = s.schedule().chunk
    assert (c.start, c.length, len(c.restore), c.lookup, c.save_block) == (16, 8, 2, (24, 16), -1)
    assert block_hashes(p, 8) != block_hashes(p[:-1] + [0], 8)
    assert block_hashes(p, 8)[:2] == block_hashes(p[:16] + [0] * 8, 8)[:2]


# ---- long prompts and interleaving ----

def test_prompt_longer_than_the_largest_bucket():
    m = model()
    engine = SlotRunner(m, num_slots=2, max_seq_len=128, chunk_size=16, deterministic=False)
    assert max(engine.info.warm_buckets) == 16
    ids = prompt(100, 9)
    cache = m.init_cache(1, 128)
    tokens = np.zeros((1, 128), np.int32)
    tokens[0, :100] = ids
    logits, _ = m.prefill(cache, tokens, np.array([100]), np.array([0]))
    (out,) = generate(engine, [ids], max_tokens=2)
    assert out[0][0] == int(np.argmax(np.asarray(logits)[0]))


def test_chunks_interleave_with_decode_steps():
    info = RunnerInfo(model_name="plain", num_slots=4, max_seq_len=256, prefill_buckets=(8, 16, 256),
                      prefill_batch_sizes=(1,), vocab_size=600, eos_ids=(1,), chunk_size=16,
                      chunk_buckets=(8, 16))
    s = Scheduler(info)
    params = SamplingParams(max_tokens=50, temperature=0.0)
    running = [Sequence(i, [2, 300 + i], params, seed=0) for i in range(1, 3)]
    s.add(running)
    plan = s.schedule()
    for q in plan.prefills[0].seqs:
        q.generated.append(300)
    long = Sequence(9, [2] + [400] * 99, params, seed=0)
    s.add([long])
    kinds = []
    for _ in range(7):
        plan = s.schedule()
        kinds.append((plan.chunk.start if plan.chunk else None, [q.id for q in plan.decode if q]))
        for q in plan.decode:
            if q is not None:
                q.generated.append(300)
        if plan.chunk and plan.chunk.final:
            plan.chunk.seq.generated.append(300)
        # The prefilling row decodes nothing and writes only where its next chunk will.
        if plan.decode and plan.chunk and not plan.chunk.final:
            assert plan.decode[long.slot] is None
            assert plan.idle_positions[long.slot] == plan.chunk.start + 16
    assert kinds == [(0, [1, 2]), (16, [1, 2]), (32, [1, 2]), (48, [1, 2]), (64, [1, 2]),
                     (80, [1, 2]), (96, [1, 2])]
    plan = s.schedule()
    assert plan.chunk is None and [q.id for q in plan.decode if q] == [1, 2, 9]


def test_chunk_step_round_trip_for_other_processes():
    rng = np.random.default_rng(0)
    s = SlotSampling(np.float32([0.7]), np.int32([5]), np.float32([0.9]), np.uint32([123]))
    step = ChunkInputs(rng.integers(0, 512, 16, dtype=np.int32), 32, 11, 3, s, True, (4, 0), 7)
    cap = group_steps.step_capacity(RunnerInfo(model_name="plain", num_slots=4, max_seq_len=64, prefill_buckets=(16, 32),
                                        prefill_batch_sizes=(1,), vocab_size=600, eos_ids=(1,), chunk_size=16,
                                        chunk_buckets=(16,)))
    kind, got = group_steps.decode_step(group_steps.encode_step(group_steps.CHUNK, step, cap))
    assert kind == group_steps.CHUNK and np.array_equal(got.tokens, step.tokens)
    assert got[1:4] == step[1:4] and got[5:] == step[5:]
    assert all(np.array_equal(x, y) for x, y in zip(got.sampling, step.sampling))


def test_short_prompts_batch_and_long_ones_chunk_in_the_default_mode():
    info = RunnerInfo(model_name="plain", num_slots=4, max_seq_len=256, prefill_buckets=(16, 32, 64, 256),
                      prefill_batch_sizes=(1, 2, 4), vocab_size=600, eos_ids=(1,), chunk_size=16,
                      chunk_buckets=(16,), batched_prefill_max_bucket=64)
    s = Scheduler(info)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    short1, long, short2 = (Sequence(i, [2] + [300] * (n - 1), params, seed=0)
                            for i, n in ((1, 10), (2, 40), (3, 12)))
    s.add([short1, long, short2])
    plan = s.schedule()
    assert [g.seqs for g in plan.prefills] == [(short1,), (short2,)]  # the long one took no part
    assert long.chunked and long.slot == 1 and not short1.chunked
