"""Every backend of the group codec against its one specification (equarx.codec_spec), bit for
bit under the project's NaN rule (testkit.assert_same_bits): a NaN where the specification has
one, every other value's bits, a non-finite run's codes free.

Backends: XLA (the forms equarx.groups and equarx.codecs compile, kernels off); the native CPU
kernels as the table runs them and each instruction-set build this processor can run (AVX-512,
AVX2, plain loops); the Triton kernels in Pallas' interpreter; the Pallas TPU kernel's codec
(equarx.pallas_codecs, int8: its codes and its bfloat16 scales' values; its wire is its own).
Operations (equarx.backends): encode, encode_sum (decode-add fused with the encode, two
arrivals) and unrotate (to bfloat16 and float32). Codecs: int8, int4, fp8 in runs of 32 and 64,
on Gemma's row widths, powers of two or not. The specification runs op by op (eagerly); each
backend runs compiled. Values: runs whose scales spread over the whole grid, a zero run, a NaN,
+-Inf, values near float32's largest (their sums with the arrivals overflow), one far below its
run's step. A new backend is a row of equarx.backends plus a `_BACKENDS` entry here."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equarx import codec_spec, codecs, groups, native_cpu, pallas_codecs, triton_codecs
from equarx.layout import plan_token_layout
from testkit import NATIVE_BUILDS, assert_same_bits, native_build_targets

# (g, row width): Gemma 3 270M's d_model 640 and its half, 320 (a tp=2 shard's columns), and 1B's
# 1152 in runs of 64: none a power of two (a Triton block pads them, a C++ loop runs to the end).
GEOMETRIES = [(32, 640), (32, 320), (64, 1152)]
CODES = ["int8", "int4", "fp8"]
ROWS = 32  # tokens of a piece: 2 minishards of 16 rows


def _values(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    g = 32
    x *= np.exp(4 * rng.standard_normal(shape[:-1] + (shape[-1] // g, 1))).repeat(
        g, -1).reshape(shape).astype(np.float32)  # runs' scales far apart
    return x


def _buffer(g: int, width: int, dtype, seed: int = 0):
    """(layout, buffer, two arrivals): a token layout of 2 shards, pieces of ROWS / 2 rows of
    `width`; the edge cases in shard 1's minishard 0."""
    layout = dataclasses.replace(plan_token_layout((ROWS, 2 * width), 2, 2, granule=g),
                                 minishards=2, rows_per_minishard=ROWS // 2)
    assert layout.width == width, (layout.width, width)
    x = _values((ROWS, 2 * width), seed)
    s = width  # shard 1's columns
    x[0, s:s + g] = 0.0  # a zero run
    x[1, s + 5] = np.nan
    x[2, s + g + 3] = np.inf
    x[3, s + 2 * g] = -np.inf
    x[4, s:s + 3 * g] = 3e38  # huge: with the arrivals the sums overflow to Inf
    x[5, s + 7] = 1e-30  # far below its run's step: a zero code
    x[6, s:s + g] = 0.0
    x[6, s + 1] = -1e-3  # a run of one value and zeros (the zeros' signs)
    return layout, layout.split(jnp.asarray(x, dtype)), x


def _arrivals(layout, g, code, seed=1):
    codec = codecs.GroupCodec(g, code, layout.piece_shape)
    shape = (layout.minishards, *layout.piece_shape)
    return [jax.jit(codec.encode)(jnp.asarray(_values(shape, seed + i) * 4)) for i in range(2)]


# ---- the specification, op by op ----

def _spec_encode_sum(layout, buf, shard, arrivals, g, code):
    piece = layout.piece(buf, shard, 0, layout.minishards)
    with jax.disable_jit():
        v = piece
        for wire in arrivals:
            v = v.astype(jnp.float32) + codec_spec.decode(wire, g, code, v.shape)
        return codec_spec.encode(v, g, code)


def _spec_unrotate(wire, layout, g, code, dtype):
    with jax.disable_jit():
        parts = codec_spec.wire_parts(wire, layout.piece_shape, g, code)
        return codec_spec.unrotate_codes(*parts, g, code, dtype)


# ---- the backends ----

@functools.cache
def _native_targets(arch: str | None):
    """(unrotate, encode_sum) FFI targets of the default build (None) or of `arch`'s."""
    if not native_cpu.available():
        pytest.skip("no native CPU kernels here")
    if arch is None:
        return native_cpu.TARGET, native_cpu.ENCODE_TARGET
    unrotate, encode_sum, *_ = native_build_targets(arch, "_conformance_")
    return unrotate, encode_sum


def _xla_encode_sum(layout, buf, shard, arrivals, g, code, monkeypatch):
    monkeypatch.setattr(native_cpu, "in_use", lambda: False)
    codec = codecs.GroupCodec(g, code, layout.piece_shape)
    f = jax.jit(lambda b, s, *a: codecs.encode_sum(codec, b, layout, s, (0, layout.minishards),
                                                   a))
    assert native_cpu.ENCODE_TARGET not in f.lower(buf, jnp.int32(shard), *arrivals).as_text()
    return f(buf, jnp.int32(shard), *arrivals)


def _native_encode_sum(arch):
    def run(layout, buf, shard, arrivals, g, code, monkeypatch):
        _, target = _native_targets(arch)
        geometry = layout.piece_geometry(0, layout.minishards)
        return jax.jit(lambda b, s, *a: native_cpu.encode_sum(b, s, a, geometry, g, code,
                                                              target=target))(
            buf, jnp.int32(shard), *arrivals)
    return run


def _table_encode_sum(layout, buf, shard, arrivals, g, code, monkeypatch):
    """codecs.encode_sum as the backend table picks it on this CPU: the native kernel."""
    codec = codecs.GroupCodec(g, code, layout.piece_shape)
    f = jax.jit(lambda b, s, *a: codecs.encode_sum(codec, b, layout, s, (0, layout.minishards),
                                                   a))
    assert native_cpu.ENCODE_TARGET in f.lower(buf, jnp.int32(shard), *arrivals).as_text()
    return f(buf, jnp.int32(shard), *arrivals)


def _triton_encode_sum(layout, buf, shard, arrivals, g, code, monkeypatch):
    if not triton_codecs.supports(layout.width, g, code):
        pytest.skip(f"the Triton kernels do not take {code}")
    geometry = layout.piece_geometry(0, layout.minishards)
    if not arrivals:  # the plain encode kernel, on the piece's values
        piece = layout.piece(buf, shard, 0, layout.minishards)
        return jax.jit(lambda x: triton_codecs.encode(x, g, code, interpret=True))(piece)
    return jax.jit(lambda b, s, *a: triton_codecs.encode_sum(b, s, a, geometry, g, code,
                                                             interpret=True))(
        buf, jnp.int32(shard), *arrivals)


def _xla_unrotate(parts, g, code, dtype):
    return jax.jit(lambda *p: groups.unrotate_codes(*p, g, code, dtype, native=False))(*parts)


def _native_unrotate(arch):
    def run(parts, g, code, dtype):
        target, _ = _native_targets(arch)
        if arch is None:  # as the table runs it: groups.unrotate_codes' program calls it
            f = jax.jit(lambda *p: groups.unrotate_codes(*p, g, code, dtype))
            assert target in f.lower(*parts).as_text()
            return f(*parts)
        return jax.jit(lambda *p: native_cpu.unrotate(*p, codec_spec.rotation(g).T, code, dtype,
                                                      target=target))(*parts)
    return run


def _triton_unrotate(parts, g, code, dtype):
    if not triton_codecs.supports(parts[1].shape[-1] * g, g, code):
        pytest.skip(f"the Triton kernels do not take {code}")
    return jax.jit(lambda *p: triton_codecs.unrotate(*p, g, code, dtype, interpret=True))(*parts)


# backend -> (encode_sum, unrotate)
_BACKENDS = {
    "xla": (_xla_encode_sum, _xla_unrotate),
    "native": (_table_encode_sum, _native_unrotate(None)),
    **{f"native-{arch}": (_native_encode_sum(arch), _native_unrotate(arch)) for arch in NATIVE_BUILDS},
    "triton-interpret": (_triton_encode_sum, _triton_unrotate),
}


# The inputs and the specification's results of a geometry and code, made once for all the
# backends held to them (the same seeded inputs, the same op-by-op specification).
@functools.cache
def _encode_case(g: int, width: int, code: str, dtype: str, n: int):
    """(layout, buffer, n arrivals, the specification's encode_sum of shard 1's piece)."""
    layout, buf, _ = _buffer(g, width, jnp.dtype(dtype))
    arrivals = tuple(_arrivals(layout, g, code)[:n]) if n else ()
    return layout, buf, arrivals, _spec_encode_sum(layout, buf, 1, list(arrivals), g, code)


@functools.cache
def _unrotate_case(g: int, width: int, code: str, dtype: str):
    """The specification's un-rotation of the float32 encode_sum case's wire."""
    layout, _, _, want = _encode_case(g, width, code, "float32", 2)
    return _spec_unrotate(want, layout, g, code, jnp.dtype(dtype))


@pytest.mark.parametrize("backend", list(_BACKENDS))
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("g,width", GEOMETRIES)
def test_backend_gives_the_specifications_bits(backend, code, g, width, monkeypatch):
    """encode (no arrivals, the buffer bfloat16), encode_sum (two arrivals, float32), and the
    un-rotation of what was encoded, to bfloat16 and float32."""
    encode_sum, unrotate = _BACKENDS[backend]
    for dtype, n in ((jnp.bfloat16, 0), (jnp.float32, 2)):
        layout, buf, arrivals, want = _encode_case(g, width, code, jnp.dtype(dtype).name, n)
        got = encode_sum(layout, buf, 1, list(arrivals), g, code, monkeypatch)
        assert_same_bits(got, want, wire=(layout.piece_shape, g, code),
                         err_msg=f"encode with {n} arrivals of {dtype.__name__}")
        steps = codec_spec.wire_parts(np.asarray(want), layout.piece_shape, g, code)[1]
        assert (steps.view(np.uint8) == codec_spec.NOT_FINITE).any()  # the edges are in it
    parts = codec_spec.wire_parts(want, layout.piece_shape, g, code)
    for dtype in (jnp.bfloat16, jnp.float32):
        assert_same_bits(unrotate(parts, g, code, dtype),
                         _unrotate_case(g, width, code, jnp.dtype(dtype).name),
                         err_msg=f"unrotate to {dtype.__name__}")


@pytest.mark.parametrize("g,width", [(32, 640), (64, 256)])
def test_pallas_codec_gives_the_specifications_codes_and_scales(g, width):
    """The Pallas TPU kernel's group codec (int8 on transposed pieces [W, 128 tokens]): the
    specification's codes for every finite run, and each run's scale value, carried as a
    bfloat16 (codec_spec's docstring says why its wire differs); decoded, the specification's
    values."""
    x = _values((128, width), seed=3)
    x[0, :g] = 0.0
    x[1, 5] = np.nan
    x[2, g + 3] = -np.inf
    x[4, :2 * g] = 3e38
    kernel_codec = pallas_codecs.GroupCodec(width, 128, g)
    q, scale = jax.jit(kernel_codec.encode)(jnp.asarray(x.T))
    decoded = jax.jit(kernel_codec.decode)(q, scale)
    with jax.disable_jit():
        wire = codec_spec.encode(jnp.asarray(x)[None], g, "int8")
        codes, steps, exps = codec_spec.wire_parts(wire, (128, width), g, "int8")
        want_scales = codec_spec.row_scales(steps, exps)[0]  # [128, W / g]
        want_values = codec_spec.decode(wire, g, "int8", (1, 128, width))[0]
    assert scale.dtype == jnp.bfloat16
    assert_same_bits(np.asarray(scale, np.float32).T, np.asarray(want_scales))
    finite = np.repeat(np.isfinite(np.asarray(want_scales)), g, axis=-1)
    np.testing.assert_array_equal(np.asarray(q).T[finite], np.asarray(codes[0])[finite])
    assert_same_bits(np.asarray(decoded).T, np.asarray(want_values))
