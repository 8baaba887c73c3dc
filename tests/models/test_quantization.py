"""Quantized weights (`--quantization int8|fp8`): the codec's error bound, models close to the
unquantized one and identical across tp, `none` bit-identical, the bytes, int8 operands in the
compiled program, the weights cache keeping them, and a server answering with them; and the
real 270M's next-token distributions with int8 weights and an int8 KV cache, alone and
together."""
from __future__ import annotations

import dataclasses

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import load_model, quantization as Q
from models.gemma3.config import get_config
from models.gemma3.weights import weight_shapes

F32 = AllReduceConfig(method="f32")
TINY = "random:tiny"
# The real 270M with per-channel int8 weights, one window (measured: KL 2.8e-3, top-1 95.7%)
FLOOR_KL, FLOOR_TOP1 = 3.5e-3, 0.94
SEQS = [[2] + list(range(5, 40)), [2, 7, 9, 100, 200, 3, 11]]


@pytest.fixture(scope="module")
def tiny():
    """The tiny random model (float32, exact AllReduce), unquantized at tp=1 and int8 at tp=1, 2."""
    return {"none": load_model(TINY, dtype="float32", allreduce=F32),
            **{("int8", tp): load_model(TINY, tp=tp, dtype="float32", allreduce=F32,
                                        quantization="int8") for tp in (1, 2)}}


@pytest.mark.parametrize("code", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_round_trip_error_bound(code, dtype):
    """codes * scale is within half a code step of w (int8), or e4m3's relative rounding
    (fp8), per output channel; the scale is the keepdims form in w's dtype."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 3, 40)).astype(np.float32)
    w[5, 1, 7] = 40.0  # an outlier: its channel's scale is coarser, the others' are not
    w[:, 2, 0] = 0.0  # an all-zero channel: scale 0, codes 0
    w = jnp.asarray(w, dtype)
    q = Q.quantize(w, code, contracted=(0,))
    assert q.codes.dtype == Q.CODE_DTYPES[code] and q.codes.shape == w.shape
    assert q.scale.shape == (1, 3, 40) and q.scale.dtype == dtype
    w32, s = np.asarray(w, np.float32), np.asarray(q.scale, np.float32)
    err = np.abs(np.asarray(q.dequantize(), np.float32) - w32)
    exact = np.asarray(q.codes, np.float32) * s  # what the matmul multiplies by
    if code == "int8":
        assert np.abs(np.asarray(q.codes, np.float32)).max() <= 127
        # Half a step of the stored scale (the dequantized value then rounds to w's dtype).
        bound = 0.5 * s * (1 + 1e-6) + np.abs(exact) * float(jnp.finfo(dtype).eps)
    else:
        bound = np.abs(w32) / 16 + s * 2.0 ** -10 + np.abs(exact) * float(jnp.finfo(dtype).eps)
    assert (err <= bound).all(), float((err - bound).max())
    assert np.asarray(q.scale)[0, 2, 0] == 0 and not np.asarray(q.codes, np.float32)[:, 2, 0].any()
    # The outlier's channel reaches the largest code; a channel without it keeps its resolution.
    assert np.asarray(q.codes, np.float32)[5, 1, 7] == Q.CODES[code]
    assert s[0, 0, 0] < s[0, 1, 7] / 5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_quantize_is_codes_times_the_repeated_scale(dtype):
    """A scale per 32 values along the innermost contracted dim: each group's absmax maps to
    +-127, and dequantizing gives exactly codes * the scale repeated over its group."""
    rng = np.random.default_rng(2)
    for shape, contracted, scale_shape, axis in [((128, 3, 8), (0,), (4, 3, 8), 0),
                                                 ((4, 64, 8), (0, 1), (4, 2, 8), 1)]:  # o
        w = rng.standard_normal(shape).astype(np.float32)
        w[tuple(3 if i == axis else 1 for i in range(3))] = 40.0  # one group's outlier
        w = jnp.asarray(w, dtype)
        q = Q.quantize(w, "int8", contracted, group_size=32)
        assert q.codes.shape == shape and q.codes.dtype == jnp.int8
        assert q.scale.shape == scale_shape and q.scale.dtype == dtype
        codes, s = np.asarray(q.codes, np.float32), np.asarray(q.scale, np.float32)
        exact = codes * np.repeat(s, 32, axis=axis)
        np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float32)), exact)
        np.testing.assert_array_equal(np.asarray(q.dequantize()), exact.astype(dtype))
        groups = np.abs(codes).reshape(*shape[:axis], shape[axis] // 32, 32, *shape[axis + 1:])
        assert (groups.max(axis=axis + 1) == 127).all()
        w32 = np.asarray(w, np.float32)
        assert (np.abs(exact - w32) <= 0.5 * np.repeat(s, 32, axis=axis) * (1 + 1e-6)).all()
        # The outlier coarsens its own group's scale only.
        assert s.max() == s[tuple(0 if i == axis else 1 for i in range(3))]
        assert np.sort(s, axis=None)[-2] < s.max() / 5


@pytest.mark.parametrize("tp,native", [(1, True), (2, True), (4, True), (2, False)])
def test_grouped_model_runs_its_dequantized_weights(tp, native, monkeypatch):
    """int8 weights with a scale per 8 values give the logits of the same model over their
    dequantized weights as plain arrays; the scales are sharded as the codes (o's heads,
    linear's FFN rows too). On a CPU the products are the native kernel's (each group's sum,
    then its scale); without it, the weights dequantized inside the program."""
    from equarx import native_cpu
    from models.gemma3 import ProgramKey, StepShape
    from models.gemma3.api import Gemma3Model
    from models.gemma3.programs import ModelPrograms
    from models.gemma3.sharding import named, weight_specs

    if not native:
        monkeypatch.setattr(native_cpu, "in_use", lambda: False)
    m = load_model(TINY, tp=tp, dtype="float32", allreduce=F32, quantization="int8",
                   quantization_group_size=8)
    text = m.programs.lower(ProgramKey(StepShape(8, 2, 4, 8, 8, logits=True), (9, 9, 4))).as_text()
    assert (native_cpu.MATMUL_TARGET in text) == native
    lw = m.weights.layers[0]
    assert (lw.o.scale.shape, lw.linear.scale.shape, lw.kv.scale.shape) == (
        (4, 2, 64), (16, 64), (8, 2, 2, 16))
    for name in Q.QUANTIZED_FIELDS:
        w = getattr(lw, name)
        assert w.scale.sharding.spec == w.codes.sharding.spec, name
    assert lw.linear.scale.addressable_shards[0].data.shape == (16 // tp, 64)
    summary = m.weights_summary()
    assert summary["group_size"] == 8 and summary["bytes"] == sum(
        Q._nbytes(x) for x in jax.tree.leaves(m.weights))
    plain = ModelPrograms(m.config, mesh=m.mesh, allreduce=F32, dtype="float32")
    dequantized = jax.device_put(Q.map_quantized(m.weights, lambda _, q: q.dequantize()),
                                 named(m.mesh, weight_specs(m.config, tp)))
    want = Gemma3Model.from_programs(plain, dequantized, m.tokenizer).score(SEQS)
    np.testing.assert_allclose(m.score(SEQS), want, rtol=1e-5, atol=1e-5)


def test_bad_group_size_is_refused():
    from serving.config import ServerConfig

    with pytest.raises(ValueError, match=r"o weight.*\(4, 16, 64\): 16 values a shard at tp=1"):
        load_model(TINY, quantization="int8", quantization_group_size=32)  # head_dim 16
    with pytest.raises(ValueError, match=r"linear weight.*8 values a shard at tp=4"):
        load_model(TINY + "?ffn=32", tp=4, quantization="int8", quantization_group_size=16)
    for bad in (dict(quantization="int8", quantization_group_size=24),
                dict(quantization="int8", quantization_group_size=-32),
                dict(quantization="none", quantization_group_size=32)):
        with pytest.raises(ValueError, match="quantization_group_size must be 0"):
            load_model(TINY, **bad)
        with pytest.raises(ValueError, match="quantization_group_size must be 0"):
            ServerConfig(**bad)


def test_int8_model_is_close_to_unquantized_and_the_same_across_tp(tiny):
    ref = tiny["none"].score(SEQS)
    ok = ~np.isnan(ref)
    one, two = (tiny[("int8", tp)].score(SEQS) for tp in (1, 2))
    # Same codes and scales at every tp (global absmax). Beside the sum order, on a CPU the
    # o and linear products round each device's own activation rows to their 15-bit grid
    # (`model._int8_product`): a difference far below the weights' quantization error.
    err = np.abs(one[ok] - ref[ok]).max()
    assert 0 < err < 0.05 * np.abs(ref[ok]).max(), err
    np.testing.assert_allclose(two, one, rtol=0, atol=0.05 * err)
    agree = (one.argmax(-1) == ref.argmax(-1))[ok[..., 0]].mean()
    assert agree >= 0.9, agree
    # Deriving it from the unquantized model quantizes the same weights the same way.
    derived = tiny["none"].with_allreduce(F32, quantization="int8")
    np.testing.assert_array_equal(derived.score(SEQS), one)
    fp8 = tiny["none"].with_allreduce(F32, quantization="fp8").score(SEQS)
    assert 0 < np.abs(fp8[ok] - ref[ok]).max() < 0.2 * np.abs(ref[ok]).max()


def test_int8_weights_and_kv_cache_at_tp4_with_the_int8_allreduce(tiny):
    """Both quantizations beside the int8 AllReduce (its rotation folded into the weights
    before they are quantized) at tp=4: close to the same storage at tp=1, as the int8
    AllReduce alone is (measured 0.10 on these logits)."""
    both = dict(quantization="int8", kv_cache_dtype="int8")
    one = tiny["none"].with_allreduce(F32, **both).score(SEQS)
    four = load_model(TINY, tp=4, dtype="float32", allreduce=AllReduceConfig.from_label("int8"),
                      **both)
    assert four.programs.rotation_folded and four.kv_cache_dtype == "int8"
    out = four.score(SEQS)
    ok = ~np.isnan(one)
    assert np.array_equal(ok, ~np.isnan(out)), "padding positions differ"
    assert np.abs(out[ok] - one[ok]).max() < 0.2


def test_quantized_weights_are_stored_quantized_and_sharded(tiny):
    m = tiny[("int8", 2)]
    layer = m.weights.layers[0]
    for name in Q.QUANTIZED_FIELDS:
        w = m.weights.embed if name == "embed" else getattr(layer, name)
        assert isinstance(w, Q.QuantizedArray) and w.codes.dtype == jnp.int8
        assert w.scale.dtype == jnp.float32
    assert layer.gating.codes.addressable_shards[0].data.shape == (64, 2, 128 // 2)  # FFN split
    assert layer.gating.scale.addressable_shards[0].data.shape == (1, 2, 128 // 2)
    assert layer.linear.scale.shape == (1, 64) and layer.linear.scale.sharding.is_fully_replicated
    # Norms and the embedding stay unquantized.
    assert m.weights.final_norm.dtype == jnp.float32 and m.weights.embed.dtype == jnp.float32
    summary = m.weights_summary()
    assert summary["dtype"] == "int8" and summary["quantization"] == "int8"
    assert summary["bytes"] < 0.5 * tiny["none"].weights_summary()["bytes"]  # float32 weights
    with pytest.raises(ValueError, match="quantized"):
        m.save("/nonexistent/never-written")
    with pytest.raises(ValueError, match="quantized"):
        m.with_allreduce(F32, quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(TINY, quantization="int4")


def test_quantization_none_is_bit_identical():
    """--quantization none loads and runs exactly what a load without it does."""
    default = load_model(TINY, dtype="bfloat16")
    none = load_model(TINY, dtype="bfloat16", quantization="none")
    assert not any(isinstance(x, Q.QuantizedArray) for x in jax.tree.leaves(
        none.weights, is_leaf=lambda x: isinstance(x, Q.QuantizedArray)))
    for a, b in zip(jax.tree.leaves(default.weights), jax.tree.leaves(none.weights)):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    np.testing.assert_array_equal(none.score(SEQS), default.score(SEQS))
    assert none.weights_summary() == {"bytes": default.weights_summary()["bytes"],
                                      "dtype": "bfloat16", "quantization": "none",
                                      "group_size": 0}


@pytest.mark.parametrize("size", ["270m", "1b", "27b"])
def test_linear_layers_take_under_055x_of_bf16(size):
    """Codes and scales of the linear layers (abstract shapes: nothing is allocated)."""
    c = get_config(size)
    shapes = weight_shapes(c, jnp.bfloat16)
    quantized = Q.quantized_shapes(shapes, "int8")
    fields = [f for f in Q.QUANTIZED_FIELDS if f != "embed"]

    def nbytes(tree):
        return sum(Q._nbytes(x) for lw in tree.layers for f in fields
                   for x in jax.tree.leaves(getattr(lw, f)))

    assert nbytes(quantized) < 0.55 * nbytes(shapes)


@pytest.mark.parametrize("group_size", [0, 16])
def test_quantized_embedding_serves_lookup_and_logits(group_size):
    """The embedding's QuantizedArray (row scales [V, 1], or [V, D/G] grouped) gives the rows
    and the tied logits of its dequantized table."""
    from models.gemma3 import model as forward

    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.standard_normal((512, 64)), jnp.float32)
    q = Q.quantize(table, "int8", Q.CONTRACTED["embed"], group_size=group_size)
    assert q.scale.shape == (512, 64 // group_size if group_size else 1)
    ctx = forward.Ctx(config=get_config("tiny"), tp=1, allreduce=F32)
    tokens = jnp.asarray([[3, 511, 0, 77]])
    np.testing.assert_allclose(forward.embed_tokens(q, tokens, ctx),
                               forward.embed_tokens(q.dequantize(), tokens, ctx), rtol=1e-6)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    np.testing.assert_allclose(forward.output_logits(x, q), forward.output_logits(x, q.dequantize()),
                               rtol=1e-5, atol=1e-5)


def test_compiled_step_reads_int8_weights(tiny):
    """The program's weight arguments are the int8 codes (what stays on the devices), never a
    dequantized copy; on a CPU the dots take them as int8 operands (int32 products), one dot
    per weight."""
    import re

    from models.gemma3 import ProgramKey, StepShape

    m = tiny[("int8", 1)]
    key = ProgramKey(StepShape(8, 2, 4, 8, 8, logits=True), (9, 9, 4))
    lowered = m.programs.lower(key)
    weights = jax.tree.leaves(lowered.args_info[0][0])  # the first argument's leaves
    n_linear = len(m.weights.layers) * 5
    assert sum(str(a.dtype) == "int8" for a in weights) == n_linear
    text = lowered.as_text()
    to_float = r"stablehlo.convert[^\n]*\(tensor<[0-9x]+x{}>\) -> tensor<[0-9x]+x(bf16|f32)>"
    int8_dots = re.findall(r"stablehlo.dot_general[^\n]*xi8>[^\n]*-> tensor<[0-9x]+xi32>", text)
    assert len(int8_dots) == n_linear and not re.search(to_float.format("i8"), text)
    assert re.search(r"s32\[[^\]]*\]\S* dot\(", lowered.compile().as_text())
    # fp8 codes (and int8 on a GPU) are converted inside the program, next to their dots.
    fp8 = tiny["none"].with_allreduce(F32, quantization="fp8").programs.lower(key)
    assert sum(str(a.dtype) == "float8_e4m3fn"
               for a in jax.tree.leaves(fp8.args_info[0][0])) == n_linear
    assert len(re.findall(to_float.format("f8E4M3FN"), fp8.as_text())) == n_linear


@pytest.fixture(scope="module")
def server():
    """A server over a model loaded from its settings (--quantization int8, a scale per 8
    values)."""
    from serving.config import ServerConfig
    from serving.paged_runner import PagedRunner
    from serving.runtime import load_configured_model
    from testkit import ServerThread

    config = ServerConfig(model=TINY, quantization="int8", quantization_group_size=8,
                          max_num_seqs=2, max_seq_len=64, compile_cache_dir="")
    model = load_configured_model(config)
    assert model.quantization == "int8" and model.weights.layers[0].q.scale.shape == (8, 4, 16)
    s = ServerThread(config, PagedRunner(model, max_num_seqs=2, max_seq_len=64))
    yield s
    s.stop()


def test_server_with_int8_weights_answers_and_reports_them(server):
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": TINY, "prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    weights = httpx.get(server.url + "/health").json()["weights"]
    assert weights["dtype"] == "int8" and weights["quantization"] == "int8"
    assert weights["group_size"] == 8 and weights == server.runner.model.weights_summary()
    # The codes and the scales, all of them.
    assert weights["bytes"] == sum(x.nbytes for x in jax.tree.leaves(server.runner.model.weights))
    assert weights["bytes"] < load_model(TINY).weights_summary()["bytes"]  # bfloat16
    metrics = httpx.get(server.url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("gemma3:weights_bytes{"))
    assert 'quantization="int8"' in line and 'group_size="8"' in line
    assert float(line.split()[-1]) == weights["bytes"]


def test_settings_take_quantization():
    from eval import common, quality
    from serving.config import ServerConfig, from_sources

    assert from_sources(cli={"quantization": "fp8"}).quantization == "fp8"
    assert from_sources(cli={"quantization": "int8", "quantization_group_size": 32},
                        env={"GEMMA3_QUANTIZATION_GROUP_SIZE": "64"}).quantization_group_size == 32
    assert from_sources(env={"GEMMA3_QUANTIZATION": "int8",
                             "GEMMA3_QUANTIZATION_GROUP_SIZE": "64"}).quantization_group_size == 64
    with pytest.raises(ValueError, match="quantization"):
        ServerConfig(quantization="int4")
    args = common.parser("bench", {"step": "a step"}).parse_args(
        ["--quantization", "int8", "--quantization-group-size", "32"])
    config = common.server_config(args, compile_cache_dir="")
    assert (config.quantization, config.quantization_group_size) == ("int8", 32)
    assert quality.mode_parts("bf16:w-int8-g32:kv-int8") == ("bf16", True, {
        "quantization": "int8", "quantization_group_size": 32, "kv_cache_dtype": "int8"})
    assert quality.mode_parts("f32:w-fp8") == ("f32", True, {"quantization": "fp8"})
    assert dataclasses.replace(ServerConfig(), quantization="none").quantization == "none"


@pytest.fixture(scope="module")
def real_270m():
    """compare_logits sums of the real 270M (float32 model: a bfloat16 model carries any change,
    however small, to a KL floor of ~1.7e-3, docs/quality.md) over one window of real text,
    each variant against the unquantized model; docs/results.md has them over more text."""
    from eval import corpus
    from eval.quality import compare_logits

    m = load_model("gemma3-270m", dtype="float32", max_seq_len=256, fold_rotation=False)
    [window] = corpus.token_windows(m.tokenizer.encode, 255, 256, m.tokenizer.bos_id)
    ref, targets = m.score([window])[0], np.array(window[1:] + [-1])
    out, g32 = {}, dict(quantization="int8", quantization_group_size=32)
    for name, kw in {"kv": dict(kv_cache_dtype="int8"), "w": dict(quantization="int8"),
                     "w-g32+kv": dict(g32, kv_cache_dtype="int8")}.items():
        s = compare_logits(ref, m.with_allreduce(**kw).score([window])[0], targets)
        out[name] = (s["kl"] / s["count"], s["agree"] / s["count"])
    return out


def test_real_270m_int8_kv_cache_meets_its_quality_target(real_270m):
    kl, top1 = real_270m["kv"]
    assert kl <= 5e-4 and top1 >= 0.99, real_270m


def test_real_270m_int8_weights_floor(real_270m):
    """Per-channel int8 weights, as measured (the target is the strict xfail below)."""
    kl, top1 = real_270m["w"]
    assert kl <= FLOOR_KL and top1 >= FLOOR_TOP1, real_270m


def test_real_270m_grouped_int8_weights_meet_the_target(real_270m):
    """A scale per 32 values, with the int8 KV cache beside them (measured: KL 8.1e-4, top-1
    98.8%; the weights alone 5.9e-4, 98.8%)."""
    kl, top1 = real_270m["w-g32+kv"]
    assert kl <= 2e-3 and top1 >= 0.97, real_270m


@pytest.mark.xfail(strict=True, reason="per-channel int8 weights cost the 270M KL ~3-5e-3 "
                   "(docs/deployment.md, 'Quantized weights'); grouped scales meet it")
def test_real_270m_int8_weights_quality_target(real_270m):
    kl, top1 = real_270m["w"]
    assert kl <= 2e-3 and top1 >= 0.97, real_270m
