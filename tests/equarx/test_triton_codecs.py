"""equarx.triton_codecs: the GPU kernels give the group codec's bits (`groups`' XLA forms, a NaN
of any bits where they have a NaN: testkit.assert_same_bits), run here in Pallas' interpreter,
and lower to Triton for a CUDA GPU (checked without one)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from equarx import codec_spec, codecs, groups, triton_codecs
from equarx.layout import plan_token_layout
from testkit import assert_same_bits

# (shape [B, rows, W], code, dtype): widths that are and are not powers of two, row counts that
# are not a multiple of a block's rows, one row of one run.
SHAPES = [((2, 16, 1024), "int8", jnp.float32), ((3, 5, 160), "int8", jnp.bfloat16),
          ((2, 3, 64), "int4", jnp.bfloat16), ((3, 37, 640), "int8", jnp.float32),
          ((2, 300, 96), "int4", jnp.float32), ((1, 1, 32), "int8", jnp.float32)]


# The inputs and the XLA references are each one compiled program: run op by op they compiled
# a program per operation and shape (a thousand in this file, most of its time), and the models
# run the XLA forms compiled, as here.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _values(shape, dtype, seed=0):
    """Gaussian values whose runs' magnitudes spread over ~2^9 (steps all over the scale grid),
    with a zero run, a NaN, an Inf and a value near float32's largest."""
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    runs = shape[:-1] + (shape[-1] // 32,)
    spread = jnp.exp(3 * jax.random.normal(k[1], runs))[..., None].repeat(32, -1)
    x = (jax.random.normal(k[0], shape) * spread.reshape(shape)).reshape(-1)
    x = x.at[:32].set(0.0).at[37].set(jnp.nan).at[70].set(jnp.inf)
    x = x.at[x.size - 1].set(3e38 if dtype == jnp.float32 else 1e38)
    return x.reshape(shape).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1,))
def _encode(x, code):
    return groups.encode(x, 32, code)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _unrotate_codes(parts, code, out_dtype):
    return groups.unrotate_codes(*parts, 32, code, out_dtype, native=False)


# The chunked blocks (a row as power-of-two pieces, `_chunks`) where a width is not a power of
# two: 160 = 128 + 32, 96 = 64 + 32, 640 = 512 + 128, 352 = 256 + 64 + 32.
CHUNKED = [(shape, code, dtype, True) for shape, code, dtype in SHAPES
           if shape[-1] & (shape[-1] - 1)] + [((2, 7, 352), "int4", jnp.bfloat16, True)]
# Unchunked, the shapes tests/equarx/test_codec_conformance.py does not hold to the
# specification (its pieces are 32 rows of Gemma's widths): few or odd rows, one run.
ODD = [case for case in SHAPES if case[0] not in ((2, 16, 1024), (3, 37, 640))]


@pytest.mark.parametrize("shape,code,dtype,chunked",
                         [(*case, False) for case in ODD] + CHUNKED)
def test_encode_gives_the_group_codecs_wire(shape, code, dtype, chunked):
    x = _values(shape, dtype)
    want = jax.jit(lambda v: groups.encode(v, 32, code))(x)
    got = jax.jit(lambda v: triton_codecs.encode(v, 32, code, interpret=True,
                                                 chunked=chunked))(x)
    assert got.shape == want.shape and got.dtype == jnp.int8
    assert_same_bits(got, want, wire=(shape[1:], 32, code))


def test_chunks_cover_a_row_in_powers_of_two():
    assert triton_codecs._chunks(640, 32, False) == ((0, 1024),)
    assert triton_codecs._chunks(640, 32, True) == ((0, 512), (512, 128))
    assert triton_codecs._chunks(352, 32, True) == ((0, 256), (256, 64), (320, 32))
    assert triton_codecs._chunks(1024, 32, True) == ((0, 1024),)
    # A block's rows: about BLOCK_VALUES values, and 16 runs of its smallest piece for the dot.
    assert triton_codecs._block_rows(((0, 1024),), 32, 4096) == 4
    assert triton_codecs._block_rows(((0, 128), (128, 32)), 32, 4096) == 16
    assert triton_codecs._block_rows(((0, 64), (64, 32)), 32, 4096) == 32


@pytest.mark.parametrize("shape,code,dtype,out_dtype,chunked",
                         [(*case, (jnp.bfloat16, jnp.float32)[i % 2], False)
                          for i, case in enumerate(ODD)]
                         + [(*case[:3], jnp.bfloat16, True) for case in CHUNKED])
def test_unrotate_gives_unrotate_codes(shape, code, dtype, out_dtype, chunked):
    rows, w = int(np.prod(shape[1:-1])), shape[-1]
    wire = _encode(_values(shape, dtype), code)
    parts = codec_spec.wire_parts(wire, (rows, w), 32, code)
    want = _unrotate_codes(parts, code, out_dtype)
    got = jax.jit(lambda *p: triton_codecs.unrotate(*p, 32, code, out_dtype, interpret=True,
                                                    chunked=chunked))(*parts)
    assert got.shape == want.shape == (*shape[:-1], w) and got.dtype == out_dtype
    assert_same_bits(got, want)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_rows_codes_do_not_depend_on_the_rows_beside_it(chunked):
    # Blocks of 4 rows of 1024 (or of 640, padded to 1024 or in pieces of 512 and 128): the
    # first k rows' wire is the same alone as in a longer piece, whatever the other rows hold.
    enc = jax.jit(lambda v: triton_codecs.encode(v, 32, "int8", interpret=True,
                                                 chunked=chunked))
    # The rows are cut and replaced, and the wire's parts sliced, in numpy (not an eager
    # program per slice and shape).
    for w in (1024, 640):
        x = np.asarray(_values((1, 40, w), jnp.float32, seed=1))
        for k in (1, 13):
            other = x.copy()
            other[:, k:] = _values((1, 40 - k, w), jnp.float32, seed=k)
            alone = codec_spec.wire_parts(np.asarray(enc(x[:, :k])), (k, w), 32, "int8")
            for full in (x, other):
                for a, b in zip(alone, codec_spec.wire_parts(np.asarray(enc(full)), (40, w), 32,
                                                             "int8")):
                    assert_same_bits(a, b[:, :k])


def test_under_vmap_each_slice_is_encoded_as_alone():
    x = np.asarray(_values((3, 2, 5, 160), jnp.float32))  # sliced and stacked in numpy
    got = np.asarray(jax.vmap(lambda v: triton_codecs.encode(v, 32, "int8", interpret=True))(x))
    want = np.stack([_encode(x[i], "int8") for i in range(3)])
    for i in range(3):
        assert_same_bits(got[i], want[i], wire=((5, 160), 32, "int8"))
    parts = [np.stack(p) for p in zip(*(codec_spec.wire_parts(want[i], (5, 160), 32, "int8")
                                        for i in range(3)))]
    got = jax.vmap(lambda *p: triton_codecs.unrotate(*p, 32, "int8", jnp.bfloat16,
                                                     interpret=True))(*parts)
    want = jax.jit(jax.vmap(lambda *p: groups.unrotate_codes(*p, 32, "int8", jnp.bfloat16,
                                                             native=False)))(*parts)
    assert_same_bits(got, want)


@pytest.mark.parametrize("code,chunked", [("int8", False), ("int4", False), ("int8", True),
                                          ("int4", True)])
def test_the_kernels_lower_to_triton_inside_shard_map(code, chunked):
    # What a CUDA machine compiles, lowered here: the Pallas side of the Triton lowering (block
    # sizes, masks, the dot) and the result types shard_map(check_vma=True) asks for.
    mesh = jax.make_mesh((2,), ("x",))
    x = jax.device_put(jnp.ones((4, 12, 640), jnp.bfloat16), NamedSharding(mesh, P("x")))

    layout = dataclasses.replace(plan_token_layout((24, 1280), 2, 2, granule=32), minishards=2,
                                 rows_per_minishard=12)

    def body(v):
        wire = triton_codecs.encode(v, 32, code, chunked=chunked)
        parts = codec_spec.wire_parts(wire, (12, 640), 32, code)
        back = triton_codecs.unrotate(*parts, 32, code, jnp.bfloat16, chunked=chunked)
        buf = layout.split(back.reshape(24, 640).repeat(2, axis=1))
        summed = triton_codecs.encode_sum(buf, jnp.int32(1), [wire], layout.piece_geometry(0, 2),
                                          32, code, chunked=chunked)
        return back, summed
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3


def test_which_shapes_the_kernels_take():
    assert triton_codecs.supports(640, 32, "int8") and triton_codecs.supports(96, 32, "int4")
    assert not triton_codecs.supports(640, 32, "fp8")  # e4m3 stays in XLA ops
    assert not triton_codecs.supports(100, 32, "int8")  # not whole runs
    assert not triton_codecs.supports(64, 16, "int8")  # a dot needs 16 rows of a half run
    with pytest.raises(ValueError, match="multiple of 32"):
        triton_codecs.encode(jnp.ones((1, 2, 48)), 32, "int8")
    # No CUDA backend here: programs traced on this machine keep the XLA and native forms.
    assert not triton_codecs.in_use()


@pytest.mark.parametrize("code,dtype,halves,chunked",
                         [("int8", jnp.float32, 2, True), ("int4", jnp.bfloat16, 1, True)])
def test_encode_sum_gives_codecs_encode_sum(code, dtype, halves, chunked):
    # A strided piece of the token layout's buffer read in place at a run-time shard, with 0, 1
    # and 2 arrivals decoded and added: the bits of codecs.encode_sum (its native CPU kernel,
    # itself the pure form's bits). Rows of 640 (padded to 1024 in a block), huge values whose
    # sums overflow, zero runs, exact bfloat16 ties.
    layout = dataclasses.replace(
        plan_token_layout((96, 2 * 640 * halves), 2, 3, halves=halves, granule=32),
        minishards=3, rows_per_minishard=32)
    x = np.array(_values((96, 2 * 640 * halves), jnp.float32, seed=5))
    col = np.arange(x.shape[1]) % 640  # the same columns of every shard and half
    x[40, (col >= 96) & (col < 200)] = 3e38
    x[41, col < 32] = np.float32(x[41, 32]) * np.tile(np.arange(32) / 2, x.shape[1] // 640)
    buf = jax.jit(layout.split)(jnp.asarray(np.nan_to_num(x, nan=1.0, posinf=2.0), dtype))
    codec = codecs.GroupCodec(32, code, layout.piece_shape)
    shape = (layout.minishards * halves, *layout.piece_shape)
    arrivals = [np.asarray(jax.jit(lambda v: codec.encode(v * 4))(
        _values(shape, jnp.float32, seed=6 + i))) for i in range(2)]
    for shard, piece, n in ((0, (0, 1), 1), (1, (1, 3), 2), (1, (3 * halves - 1, 3 * halves), 0)):
        got_in = [a[piece[0]:piece[1]] for a in arrivals[:n]]
        want = jax.jit(lambda b, s, *a: codecs.encode_sum(codec, b, layout, s, piece, a))(
            buf, jnp.int32(shard), *got_in)
        got = jax.jit(lambda b, s, *a: triton_codecs.encode_sum(
            b, s, a, layout.piece_geometry(*piece), 32, code, interpret=True,
            chunked=chunked))(
                buf, jnp.int32(shard), *got_in)
        assert_same_bits(got, want, wire=(layout.piece_shape, 32, code))
        if piece == (1, 3):  # the edge cases were in what was compared
            out = np.asarray(jax.jit(lambda w: codec_spec.decode(w, 32, code, (2, 32, 640)))(
                got))
            assert np.isinf(out[0, 8]).any() or (np.abs(out[0, 8]) > 1e38).any()
