"""Gemma 3 model on tiny random configs: tensor-parallel equivalence, KV cache semantics
(prefill + decode == full forward, local ring buffers, slot independence), generation, errors."""
import numpy as np
import pytest

import jax
from equarx import AllReduceConfig
from models.gemma3 import Program, ProgramKey, load_model, prefill_buckets
from models.gemma3.kv_cache import KVCache

F32 = AllReduceConfig(method="f32")
# "tiny": 3 layers (local, global, local: a global layer every 2nd), window 8, 2 KV heads
# (sharded at tp=2, replicated at tp=4), vocabulary 512.
TINY = "random:tiny"


@pytest.fixture(scope="module")
def tiny():
    """The same random tiny model (float32, exact AllReduce) at tp = 1, 2, 4."""
    return {tp: load_model(TINY, tp=tp, dtype="float32", allreduce=F32) for tp in (1, 2, 4)}


def _random_seqs(lengths, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [[2] + rng.integers(4, vocab, n - 1).tolist() for n in lengths]


def test_weights_do_not_depend_on_tp(tiny):
    for tp in (2, 4):
        for a, b in zip(jax.tree.leaves(tiny[1].weights), jax.tree.leaves(tiny[tp].weights)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_weights_are_sharded_over_tp(tiny):
    m = tiny[4]
    embed_shards = m.weights.embed.addressable_shards
    assert len(embed_shards) == 4 and embed_shards[0].data.shape == (512 // 4, 64)
    layer = m.weights.layers[2]
    assert layer.q.addressable_shards[0].data.shape == (64, 1, 16)  # [D, N, H]: heads split
    assert layer.gating.addressable_shards[0].data.shape == (64, 2, 128 // 4)  # FFN split
    assert layer.linear.addressable_shards[0].data.shape == (128 // 4, 64)
    # 2 KV heads on 4 devices: the projection is replicated, the cache is still split.
    assert layer.kv.addressable_shards[0].data.shape == layer.kv.shape
    cache = m.init_cache(num_slots=3, max_seq_len=32)
    assert [c.v.shape[2] for c in cache.layers] == [8, 32, 8]  # local rings of W = 8
    glob = cache.layers[1]
    assert glob.k.shape == (3, 4, 16, 32) and glob.v.shape == (3, 4, 32, 16)
    assert glob.k.addressable_shards[0].data.shape == (3, 1, 16, 32)


def test_tp_1_2_4_give_the_same_logits(tiny):
    seqs = _random_seqs([5, 19, 12])
    ref = tiny[1].score(seqs)
    assert np.isfinite(ref[0, :5]).all() and np.isnan(ref[0, 5:]).all()
    for tp in (2, 4):
        np.testing.assert_allclose(tiny[tp].score(seqs), ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_prefill_then_decode_equals_full_forward(tiny, tp):
    """Teacher-forced decoding after prompts shorter and longer than the window (8) and past
    the bucket size must give the logits of one forward pass over the whole sequence."""
    m = tiny[tp]
    prompt_lens, steps = [3, 11, 20], 14
    seqs = _random_seqs([n + steps for n in prompt_lens], seed=tp)
    full = m.score(seqs)
    bucket = m.bucket_for(max(prompt_lens))
    tokens = np.zeros((3, bucket), np.int32)
    for b, n in enumerate(prompt_lens):
        tokens[b, :n] = seqs[b][:n]
    lengths = np.array(prompt_lens, np.int32)
    cache = m.init_cache(num_slots=3, max_seq_len=64)
    logits, cache = m.prefill(cache, tokens, lengths, np.arange(3, dtype=np.int32))
    np.testing.assert_allclose(np.asarray(logits), full[np.arange(3), lengths - 1], atol=2e-5)
    for step in range(steps):
        pos = lengths + step
        next_tokens = np.array([seqs[b][p] for b, p in enumerate(pos)], np.int32)
        logits, cache = m.decode_step(cache, next_tokens, pos)
        np.testing.assert_allclose(np.asarray(logits), full[np.arange(3), pos], atol=2e-5,
                                   err_msg=f"decode step {step}")


def test_prefill_all_logits_equal_score(tiny):
    m = tiny[2]
    seqs = _random_seqs([7, 30])
    tokens = np.zeros((2, 32), np.int32)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = s
    cache = m.init_cache(num_slots=2, max_seq_len=32)
    logits, _ = m.prefill(cache, tokens, np.array([7, 30], np.int32), np.array([1, 0], np.int32),
                          return_all_logits=True)
    assert logits.shape == (2, 32, 512)
    full = m.score(seqs)
    np.testing.assert_allclose(np.asarray(logits)[0, :7], full[0, :7], atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits)[1, :30], full[1, :30], atol=2e-5)


def test_slots_are_independent(tiny):
    """A sequence decoded in slot 2 of a busy cache equals the same sequence alone; other
    slots' prefills and idle slots (junk positions, even past the cache) do not disturb it."""
    m = tiny[2]
    a, b = _random_seqs([13, 21], seed=7)

    # The cache and prompt shapes of the tests around it (4 slots of 32, prompts of 16): their
    # programs, compiled once.
    def run(busy):
        cache = m.init_cache(num_slots=4, max_seq_len=32)
        if busy:
            cache = m.prefill(cache, np.array([b[:16]], np.int32),
                              np.array([16], np.int32), np.array([0], np.int32))[1]
        logits, cache = m.prefill(cache, np.array([a[:9] + [0] * 7], np.int32),
                                  np.array([9], np.int32), np.array([2], np.int32))
        out = [np.asarray(logits)[0]]
        for step in range(4):
            tokens = np.array([b[16 + step], 5, a[9 + step], 7], np.int32)
            positions = np.array([16 + step, 1000, 9 + step, 3], np.int32)
            logits, cache = m.decode_step(cache, tokens, positions)
            out.append(np.asarray(logits)[2])
        return np.stack(out)

    np.testing.assert_allclose(run(busy=True), run(busy=False), atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2])
def test_decoding_the_first_slots_only(tiny, tp):
    """decode_step with R < S tokens decodes slots 0..R-1 exactly as a full step does and
    leaves the other slots' cache rows untouched."""
    m = tiny[tp]
    seqs = _random_seqs([7, 11, 5, 9], seed=5)
    cache = m.init_cache(num_slots=4, max_seq_len=32)
    tokens = np.array([s + [0] * (16 - len(s)) for s in seqs], np.int32)
    _, cache = m.prefill(cache, tokens, np.array([len(s) for s in seqs], np.int32),
                         np.arange(4, dtype=np.int32))
    before = jax.tree.map(np.asarray, cache)
    nxt, pos = np.array([11, 12, 13, 14], np.int32), np.array([7, 11, 5, 9], np.int32)
    full_logits, full_cache = m.decode_step(jax.tree.map(jax.numpy.array, before), nxt, pos)
    part_logits, part_cache = m.decode_step(cache, nxt[:2], pos[:2])
    np.testing.assert_allclose(np.asarray(part_logits), np.asarray(full_logits)[:2], atol=1e-6)
    for full, part, old in zip(jax.tree.leaves(full_cache), jax.tree.leaves(part_cache),
                               jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(part)[:2], np.asarray(full)[:2])
        np.testing.assert_array_equal(np.asarray(part)[2:], old[2:])


def test_generate_is_greedy_and_uses_the_cache(tiny):
    m = tiny[2]
    seqs = _random_seqs([4, 10])
    out = m.generate(seqs, max_new_tokens=12)
    assert [len(o) for o in out] == [12, 12]
    for s, new in zip(seqs, out):
        logits = m.score([s + new])[0]
        assert new == np.argmax(logits[len(s) - 1:-1], axis=-1).tolist()


def test_sampling_is_seeded_and_bounded(tiny):
    m = tiny[1]
    seqs = _random_seqs([6, 6], seed=3)
    a = m.generate(seqs, 8, temperature=1.0, seed=11)
    assert a == m.generate(seqs, 8, temperature=1.0, seed=11)
    assert a != m.generate(seqs, 8, temperature=1.0, seed=12)
    assert m.generate(seqs, 8, temperature=0.7, top_k=1, seed=5) == m.generate(seqs, 8)
    assert m.generate(seqs, 8, temperature=0.7, top_p=1e-6, seed=5) == m.generate(seqs, 8)


def test_generate_stops_at_stop_ids(tiny):
    m = tiny[1]
    seqs = _random_seqs([5])
    free = m.generate(seqs, 10)[0]
    stop = free[3]
    out = m.generate(seqs, 10, stop_ids=[stop])[0]
    assert out == free[:free.index(stop) + 1]


def test_buckets():
    assert prefill_buckets(256) == (32, 64, 128, 256)
    assert prefill_buckets(1000) == (32, 64, 128, 256, 512, 1000)


def test_bad_input_gets_clear_errors(tiny):
    m = tiny[1]
    with pytest.raises(ValueError, match="token ids"):
        m.score([[2, 512]])
    with pytest.raises(ValueError, match="max_seq_len"):
        m.score([[2] * 300])
    with pytest.raises(ValueError, match="at least one token"):
        m.score([[]])
    cache = m.init_cache(num_slots=2, max_seq_len=32)
    with pytest.raises(ValueError, match="leading cache slots"):
        m.decode_step(cache, np.array([1, 1, 1], np.int32), np.array([0, 0, 0], np.int32))
    with pytest.raises(ValueError, match="leading cache slots"):
        m.decode_step(cache, np.array([1, 1], np.int32), np.array([0], np.int32))
    with pytest.raises(ValueError, match="exceeds"):
        m.init_cache(num_slots=1, max_seq_len=10_000)


def test_load_model_errors():
    with pytest.raises(ValueError, match="needs 16 devices"):
        load_model("random:tiny?heads=16&vocab=1024&kv_heads=16", tp=16)
    with pytest.raises(ValueError, match="must divide num_heads"):
        load_model(TINY, tp=3)
    with pytest.raises(ValueError, match="unknown Gemma 3 size"):
        load_model("random:huge")
    with pytest.raises(ValueError, match="unknown model source"):
        load_model("no/such/thing")
    with pytest.raises(ValueError, match="dtype"):
        load_model(TINY, dtype="float16")


def test_byte_tokenizer_for_small_vocabularies(tiny):
    tok = tiny[1].tokenizer
    text = "héllo\n世界"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < tiny[1].config.vocab_size
    assert tok.decode([tok.bos_id] + tok.encode("a") + [tok.eos_id]) == "a"


@pytest.mark.parametrize("window", [None, 8])
def test_long_prompts_attend_in_chunks_with_the_same_result(monkeypatch, window):
    import jax.numpy as jnp

    from models.gemma3 import model as fwd

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in [(2, 64, 4, 8), (2, 64, 2, 8), (2, 64, 2, 8)])
    whole = fwd.attend_prompt(q, k, v, window)
    monkeypatch.setattr(fwd, "PROMPT_CHUNK", 16)
    np.testing.assert_allclose(fwd.attend_prompt(q, k, v, window), whole, rtol=1e-6, atol=1e-6)


def test_compiles_while_loading():
    """load_model(warm_up=...) compiles from the weights' shapes while they load."""
    # The shapes of the warm-up tests below (which then find these programs compiled).
    m = load_model(TINY, tp=2, dtype="float32", allreduce=F32,
                   warm_up=dict(num_slots=2, max_seq_len=32, buckets=[8]))
    cache = m.init_cache(2, 32)
    logits, cache = m.prefill(cache, np.array([[2, 7, 9] + [0] * 5], np.int32),
                              np.array([3], np.int32), np.array([1], np.int32))
    full = m.score([[2, 7, 9]])[0, 2]
    np.testing.assert_allclose(np.asarray(logits)[0], full, atol=2e-5)


def test_warmed_programs_run_without_tracing():
    """warm_up keeps the executables it compiles: prefill and decode calls with those shapes run
    them (the jitted functions are never traced) and agree with a model that traces."""
    m = load_model(TINY, tp=2, dtype="float32", allreduce=F32)
    m.warm_up(num_slots=2, max_seq_len=32, buckets=[8], decode_rows=[1, 2])
    ref = load_model(TINY, tp=2, dtype="float32", allreduce=F32)
    outs = []
    for model in (m, ref):
        cache = model.init_cache(2, 32)
        logits, cache = model.prefill(cache, np.array([[2, 7, 9, 0, 0, 0, 0, 0]], np.int32),
                                      np.array([3]), np.array([1]))
        step, cache = model.decode_step(cache, np.array([5, 6], np.int32), np.array([0, 3], np.int32))
        one, cache = model.decode_step(cache, np.array([8], np.int32), np.array([1], np.int32))
        outs.append([np.asarray(x) for x in (logits, step, one)])
    cache = m.cache_shapes(2, 32)
    assert m.programs.kept() == {ProgramKey.prefill(1, 8, cache), ProgramKey.decode(1, cache),
                                 ProgramKey.decode(2, cache), ProgramKey.write_token(1, cache),
                                 ProgramKey.write_token(2, cache)}
    for program in (Program.PREFILL, Program.DECODE, Program.WRITE_TOKEN):
        assert m.programs.jitted(program)._cache_size() == 0  # never called: the kept ran
    assert ref.programs.jitted(Program.DECODE)._cache_size() == 2  # rows 2 and 1
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_warmed_programs_for_a_cache_shorter_than_the_window():
    """A cache shorter than the sliding window has local layers longer than its global ones:
    its program key must still name that cache (not the window's), so that warm_up compiles
    for it and prefill/decode run those executables. (The kept executables were once compiled
    for global layers as long as the window, and the first prefill failed.)"""
    m = load_model(TINY + "?window=64", tp=2, dtype="float32", allreduce=F32)
    for length in (4, 32, 64, 128):
        cache = m.cache_shapes(2, length)
        for key in (ProgramKey.prefill(1, 32, cache), ProgramKey.decode(2, cache),
                    ProgramKey.write_token(2, cache)):
            assert key.max_seq_len == length
            abstract = next(a for a in m.programs.abstract_args(key) if isinstance(a, KVCache))
            assert jax.tree.map(lambda x: x.shape, abstract) == jax.tree.map(
                lambda x: x.shape, cache)
    m.warm_up(num_slots=2, max_seq_len=32, buckets=[32], decode_rows=[2])
    cache = m.init_cache(2, 32)
    logits, cache = m.prefill(cache, np.array([[2, 7, 9] + [0] * 29], np.int32), np.array([3]),
                              np.array([0]))
    step, cache = m.decode_step(cache, np.array([5, 6], np.int32), np.array([3, 0], np.int32))
    for program in (Program.PREFILL, Program.DECODE, Program.WRITE_TOKEN):
        assert m.programs.jitted(program)._cache_size() == 0  # the kept executables ran
    full = m.score([[2, 7, 9, 5]])[0]
    np.testing.assert_allclose(np.asarray(logits)[0], full[2], atol=2e-5)
    np.testing.assert_allclose(np.asarray(step)[0], full[3], atol=2e-5)


def test_kept_executable_takes_ids_placed_anywhere():
    """Token ids already on one device (not the mesh) are moved to the mesh for a kept
    executable, as jit would do."""
    m = load_model(TINY, tp=2, dtype="float32", allreduce=F32)
    m.warm_up(num_slots=2, max_seq_len=32, buckets=[8], decode_rows=[2])
    one = jax.devices()[0]
    cache = m.init_cache(2, 32)
    tokens = jax.device_put(np.array([[2, 7, 9, 0, 0, 0, 0, 0]], np.int32), one)
    logits, cache = m.prefill(cache, tokens, jax.device_put(np.array([3]), one),
                              jax.device_put(np.array([0]), one))
    ref = m.score([[2, 7, 9]])[0, 2]
    np.testing.assert_allclose(np.asarray(logits)[0], ref, atol=2e-5)
    assert m.programs.jitted(Program.PREFILL)._cache_size() == 0


def test_reduction_hook_runs_at_every_tensor_parallel_reduction(tiny):
    """Gemma3Model(reduction=fn) traces fn at both reductions of every layer, in place of
    equarx.all_reduce: an exact psum gives the f32 model's logits, a wrong sum other logits."""
    from jax import lax

    from models.gemma3 import Gemma3Model

    base = tiny[2]
    calls = []

    def exact(x, axis_name):
        calls.append(x.shape)
        return lax.psum(x, axis_name)

    def partial_only(x, axis_name):  # no communication: each device keeps its own part
        return x

    def model(reduction):
        return Gemma3Model(base.config, base.weights, mesh=base.mesh, allreduce=F32,
                           dtype=base.dtype, tokenizer=base.tokenizer, reduction=reduction)

    seqs = _random_seqs([7, 4])
    want = base.score(seqs)
    np.testing.assert_allclose(model(exact).score(seqs), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * base.config.num_layers
    assert not np.allclose(model(partial_only).score(seqs)[0, :7], want[0, :7], atol=1e-2)
    assert "partial_only" in repr(model(partial_only))


def test_int8_rotation_is_folded_into_the_weights(tiny, tmp_path):
    """With the default int8 at tp > 1 the codec's rotation lives in the o and linear weights
    (the AllReduce skips it): the same logits as rotating at run time up to int8 code flips,
    far inside the int8 error itself; such a model refuses to save (its weights are no longer
    the checkpoint's) and to derive siblings."""
    base = tiny[2]
    seqs = _random_seqs([9, 21])
    ref = base.score(seqs)
    folded = load_model(TINY, tp=2, dtype="float32", allreduce=AllReduceConfig("int8"))
    plain = base.with_allreduce(AllReduceConfig("int8"), fold_rotation=False)
    assert folded.programs.rotation_folded and not plain.programs.rotation_folded
    assert base.with_allreduce(AllReduceConfig("int8")).programs.rotation_folded
    assert not base.with_allreduce(AllReduceConfig("int8", blocks="tile")).programs.rotation_folded
    assert not load_model(TINY, tp=1, allreduce=AllReduceConfig("int8")).programs.rotation_folded
    w, w0 = folded.weights.layers[0], base.weights.layers[0]
    np.testing.assert_array_equal(np.asarray(w.q), np.asarray(w0.q))
    assert w.o.shape == w0.o.shape and w.o.sharding == w0.o.sharding
    assert not np.allclose(np.asarray(w.o), np.asarray(w0.o))
    valid = np.isfinite(ref)
    a, b = plain.score(seqs)[valid], folded.score(seqs)[valid]
    int8_err = np.abs(a - ref[valid]).mean()
    assert 0 < int8_err < 0.05
    assert np.abs(b - a).mean() < 0.5 * int8_err
    with pytest.raises(ValueError, match="fold_rotation=False"):
        folded.save(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="fold_rotation=False"):
        folded.with_allreduce(F32)


def test_models_are_not_kept_alive_by_the_library():
    """Nothing module- or class-level holds a model (and its weights) once it is dropped."""
    import gc
    import weakref

    m = load_model(TINY, tp=2, dtype="float32", allreduce=F32)
    cache = m.init_cache(2, 32)
    # Shapes the tests above compiled programs for (the session's compilation cache has them).
    _, cache = m.prefill(cache, np.array([[2, 7, 9, 0, 0, 0, 0, 0]], np.int32), np.array([3]),
                         np.array([0]))
    m.generate([[2, 7], [2, 9]], 2)
    refs = [weakref.ref(m), weakref.ref(m.programs), weakref.ref(m.weights)]
    del m, cache
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_a_program_key_names_its_program_for_the_logs():
    """`ProgramKey.describe` (the warm-up's progress and the first-use compile lines): a ragged
    step's shapes and which of its variants it is."""
    from models.gemma3.config import get_config
    from models.gemma3.paged_kv import paged_shapes

    pages = paged_shapes(get_config("tiny"), 9, 5, 4, 2, "float32")
    plain = ProgramKey.ragged(16, 2, 8, 8, 3, pages)
    assert plain.describe() == "ragged step T=16 S=2 Q=8 Pg=8 Pl=3"
    assert ProgramKey.ragged(16, 2, 8, 8, 3, pages, logits=False).describe().endswith(
        "Pl=3 (no logits)")
    assert ProgramKey.ragged(16, 2, 8, 8, 3, pages, every_token=True).describe().endswith(
        "Pl=3 (every token's logits)")
    assert ProgramKey.ragged(16, 2, 8, 8, 3, pages, features=4).describe().endswith("Pl=3 F=4")
