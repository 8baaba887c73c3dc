"""int8 / fp8 KV cache (`--kv-cache-dtype`, models/gemma3/paged_kv.py): pages hold the EQuARX
group codec's codes and scales. What is stored reads back within the codec's error bound; a
token's stored bytes depend on that token alone; the pools take ~0.53x the bytes of bfloat16;
the TPU kernel's path refuses clearly; and the quantized cache serves real steps: the real 270M's
logits close to an unquantized cache's, tp=2 as tp=1, a prefix-cache hit as a fresh run, an
image prompt, and a server started with the flag."""
import jax.numpy as jnp
import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import ProgramKey, StepShape, get_config, load_model
from equarx import codec_spec
from models.gemma3.paged_kv import (LayerPages, gather, kv_group, paged_shapes, rotate_runs,
                                    rotates, store)
from models.gemma3.ragged import check_kv_cache_dtype
from serving.paged_runner import PagedRunner
from serving.sampling import SamplingParams
from testkit import finish_all, running_core

F32 = AllReduceConfig(method="f32")
QUANTIZED = ("int8", "fp8")


def pool(kv_cache_dtype, pages=6, page=4, heads=4, h=64):
    """A zeroed quantized LayerPages of `heads` combined heads (keys and values interleaved)."""
    g = kv_group(h)
    codes = jnp.int8 if kv_cache_dtype == "int8" else jnp.uint8
    return LayerPages(kv=jnp.zeros((pages, page, heads, h), codes),
                      scale=jnp.zeros((pages, page, heads, h // g), jnp.uint16))


def rows(seed, t=5, kl=2, h=64):
    """Keys and values [t, kl, h], runs of 32 of different magnitudes (a few octaves apart: within
    the 8 octaves below its row's largest scale where a run keeps a scale of its own)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, t, kl, h // 32, 32)) * np.exp2(
        rng.integers(-2, 3, (2, t, kl, h // 32, 1)))
    x = x.reshape(2, t, kl, h)
    return jnp.asarray(x[0], jnp.float32), jnp.asarray(x[1], jnp.float32)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_stored_rows_read_back_within_the_codecs_bound(kv_cache_dtype):
    """Each run's error within the codec's: int8 half a step of a scale rounded up to 5 mantissa
    bits from the run's absmax / 127, of the run rotated (the inverse rotation averages the
    errors: no larger than the largest); fp8 e4m3's half-ulp of each value (subnormal steps
    2^-9 of the scale), unrotated. The gather reads what the `k` / `v` views show (rotated)."""
    k, v = rows(0)
    slots = jnp.asarray([5, 6, 9, 17, 22], jnp.int32)  # flat page * 4 + offset
    pages = store(pool(kv_cache_dtype), slots, k, v)
    table = jnp.asarray([[1, 2, 4, 5]], jnp.int32)  # logical positions 0..15 -> these pages
    logical = [1, 2, 5, 9, 14]  # each slot's position in the table's pages
    gathered = gather(pages, table, jnp.float32)
    for x, view, got in ((k, pages.k, gathered[0]), (v, pages.v, gathered[1])):
        runs = np.asarray(rotate_runs(x) if rotates(kv_cache_dtype) else x).reshape(5, 2, 2, 32)
        amax = np.abs(runs).max(-1, keepdims=True)
        back = np.asarray(view).reshape(-1, 2, 64)[np.asarray(slots)]
        err = np.abs(back - np.asarray(x)).reshape(runs.shape)
        scale = amax / codec_spec.CODES[kv_cache_dtype] * (1 + 2.0 ** -5)
        if rotates(kv_cache_dtype):
            bound = scale.max(-1, keepdims=True) / 2 + 1e-5 * amax  # + float32 rotations
        else:
            bound = np.abs(runs) / 16 + scale * 2.0 ** -10
        assert np.all(err <= bound), float((err / bound).max())
        assert np.max(err) > 0  # (it is quantized)
        got = np.asarray(got)[0, logical]
        want = rotate_runs(jnp.asarray(back)) if rotates(kv_cache_dtype) else back
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(amax.max()))


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_tokens_stored_bytes_depend_on_that_token_alone(kv_cache_dtype):
    """The same token written beside different neighbours (other tokens of the step, of other
    magnitudes) and at another slot: the same code and scale bytes."""
    k, v = rows(1)
    k2, v2 = rows(2)
    others = jnp.asarray([0, 1, 2, 4])
    k2 = k2.at[others].multiply(1000.0).at[3].set(k[3])  # neighbours far larger
    v2 = v2.at[others].multiply(1e-3).at[3].set(v[3])  # ... and far smaller

    def stored(keys, values, slot_of_3):
        slots = jnp.asarray([1, 2, 7, slot_of_3, 9], jnp.int32)
        p = store(pool(kv_cache_dtype), slots, keys, values)
        flat = lambda a: np.asarray(a).reshape(-1, *a.shape[2:])  # noqa: E731
        return flat(p.kv)[slot_of_3].tobytes(), flat(p.scale)[slot_of_3].tobytes()

    assert stored(k, v, 13) == stored(k2, v2, 13) == stored(k2, v2, 21)


def test_bytes_per_token_are_053x_bfloat16():
    c = get_config("gemma3-270m")
    auto = paged_shapes(c, 9, 9, 16, c.num_kv_heads, jnp.uint16)
    for kv in QUANTIZED:
        q = paged_shapes(c, 9, 9, 16, c.num_kv_heads, jnp.uint16, kv)
        assert q.nbytes / auto.nbytes == pytest.approx((1 + 2 / 32) / 2)  # 0.53
        assert q.kv_cache_dtype == kv and auto.kv_cache_dtype == "auto"


def test_the_tpu_kernel_refuses_quantized_pages_clearly():
    for kv in QUANTIZED:
        with pytest.raises(ValueError, match=f"--kv-cache-dtype {kv} is not served on tpu.*auto"):
            check_kv_cache_dtype(kv, "tpu")
        check_kv_cache_dtype(kv, "cpu")
        check_kv_cache_dtype(kv, "gpu")
    check_kv_cache_dtype("auto", "tpu")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        check_kv_cache_dtype("int4", "cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        load_model("random:tiny", kv_cache_dtype="float16")


# ---- real models ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return {tp: load_model("random:tiny", tp=tp, dtype="float32", allreduce=F32)
            for tp in (1, 2)}


def test_a_derived_model_has_its_own_programs_and_keys(tiny):
    m = tiny[1]
    q = m.with_allreduce(kv_cache_dtype="int8")
    assert q.kv_cache_dtype == "int8" and m.kv_cache_dtype == "auto"
    assert q.weights is m.weights and q.allreduce == m.allreduce
    shape = StepShape(8, 1, 8, 8, 8)
    kq, ka = ProgramKey.of(shape, q.pages_shapes(9, 9, 4)), ProgramKey.of(shape, m.pages_shapes(9, 9, 4))
    assert kq.kv_cache_dtype == "int8" and ka.kv_cache_dtype == "auto" and kq != ka


def test_tp2_as_tp1(tiny):
    """KV heads split over devices, codes and scales with them: tp=2 gives tp=1's logits (f32
    model, exact AllReduce; a code may round the other way where the sums' order moved a key by
    an ulp), and both stay close to the unquantized cache's."""
    seqs = [[2] + np.random.default_rng(i).integers(4, 500, 30 + 7 * i).tolist() for i in range(2)]
    q2 = tiny[2].with_allreduce(kv_cache_dtype="int8")
    assert q2.init_pages(3, 3, 4).layers[0].scale.sharding.spec[2] is not None  # split heads
    one, two = (q.score(seqs) for q in (tiny[1].with_allreduce(kv_cache_dtype="int8"), q2))
    np.testing.assert_allclose(two, one, atol=5e-3)
    auto = tiny[1].score(seqs)
    ok = ~np.isnan(auto[..., 0])
    assert np.max(np.abs(one - auto)[ok]) < 0.05 * np.max(np.abs(auto[ok]))
    assert np.mean(one[ok].argmax(-1) == auto[ok].argmax(-1)) > 0.9


def generate(engine, prompts, max_tokens=6):
    with running_core(engine) as c:
        outs = finish_all(c, [(p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True, logprobs=0)) for p in prompts])
    for o in outs:
        assert o.finish == "length", o.error
    return [[(t.id, t.logprob) for t in o.tokens] for o in outs]


def test_a_reused_prefix_gives_a_fresh_runs_tokens(tiny):
    """Prefix caching over int8 pages: the second request of a shared 40-token prefix reads its
    pages from the cache and gives what an engine without prefix caching gives."""
    m = tiny[1].with_allreduce(kv_cache_dtype="int8")
    args = dict(max_num_seqs=2, max_seq_len=96, page_size=4, long_prefill_token_threshold=8)
    shared = [2] + np.random.default_rng(3).integers(4, 500, 39).tolist()
    prompts = [shared + [7, 8, 9], shared + [11, 12]]
    cached = PagedRunner(m, prefix_caching=True, **args)
    with running_core(cached) as c:
        first = finish_all(c, [(prompts[0], SamplingParams(max_tokens=4, temperature=0.0,
                                                           ignore_eos=True, logprobs=0))])
        hits = c.scheduler.kv.hits
        second = finish_all(c, [(prompts[1], SamplingParams(max_tokens=4, temperature=0.0,
                                                            ignore_eos=True, logprobs=0))])
        assert c.scheduler.kv.hits - hits == 40  # the shared prefix's whole pages
    fresh = PagedRunner(m, prefix_caching=False, **args)
    want = [generate(fresh, [p], 4)[0] for p in prompts]  # one at a time, as above
    got = [[(t.id, t.logprob) for t in o.tokens] for o in first + second]
    assert [[i for i, _ in g] for g in got] == [[i for i, _ in w] for w in want]
    np.testing.assert_allclose([[lp for _, lp in g] for g in got],
                               [[lp for _, lp in w] for w in want], atol=1e-4)


def test_an_image_prompt_runs_with_int8_pages(vision_golden, tmp_path_factory):
    """The tiny multimodal golden's one-image prompt through the engine (its span written a layer
    at a time into int8 pages): the greedy tokens of an unquantized cache, logprobs close."""
    from testkit import vision_golden_images, vision_golden_model

    m = vision_golden_model(vision_golden, tmp_path_factory.mktemp("hf_mm"))
    ids = vision_golden["ids_1"].tolist()
    out = {}
    for kv in ("auto", "int8"):
        engine = PagedRunner(m.with_allreduce(kv_cache_dtype=kv), max_num_seqs=2,
                             max_seq_len=128, page_size=4, long_prefill_token_threshold=8)
        with running_core(engine) as c:
            [o] = finish_all(c, [(ids, SamplingParams(max_tokens=4, temperature=0.0,
                                                      ignore_eos=True, logprobs=0),
                                  vision_golden_images(m, vision_golden, 1))])
        assert o.error is None, o.error
        assert engine.images_encoded == 1
        out[kv] = o.tokens
    assert [t.id for t in out["int8"]] == [t.id for t in out["auto"]]
    np.testing.assert_allclose([t.logprob for t in out["int8"]],
                               [t.logprob for t in out["auto"]], atol=0.05)


def test_a_server_started_with_int8_kv(tmp_path):
    """`--kv-cache-dtype int8` from the command line through the server's own loader: a
    completion, /health's KV cache dtype and bytes, and the /metrics gauge."""
    import argparse
    import os

    import httpx

    from serving.config import add_arguments, from_sources
    from serving.runtime import load_runner
    from testkit import ServerThread

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = parser.parse_args(["--model", "random:tiny", "--dtype", "float32", "--max-num-seqs",
                               "2", "--max-seq-len", "48", "--max-num-batched-tokens", "32",
                               "--kv-cache-dtype", "int8",
                               "--precompile", "warmup", "--compile-cache-dir",
                               os.environ.get("GEMMA3_TEST_COMPILATION_CACHE", "")])
    config = from_sources(vars(flags), env={})
    assert config.kv_cache_dtype == "int8"
    runner = load_runner(config, lambda msg: None)
    server = ServerThread(config, runner)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            r = client.post("/v1/completions", json={"model": "random:tiny", "prompt": "abc",
                                                     "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            kv = client.get("/health").json()["kv_cache"]
            assert kv == {"dtype": "int8", "bytes": runner.pages.nbytes}
            auto = runner.model.with_allreduce(kv_cache_dtype="auto").pages_shapes(
                runner.info.num_global_pages, runner.info.num_local_pages, 16).nbytes
            assert kv["bytes"] < 0.6 * auto
            metrics = client.get("/metrics").text
            assert (f'gemma3:kv_cache_bytes{{allreduce="bf16",kv_cache_dtype="int8",'
                    f'model_name="random:tiny"}} {float(kv["bytes"])}') in metrics
    finally:
        server.stop()
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])
