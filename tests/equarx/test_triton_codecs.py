"""equarx.triton_codecs: the GPU kernels give the group codec's bits (`groups`' XLA forms), run
here in Pallas' interpreter, and lower to Triton for a CUDA GPU (checked without one)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from equarx import groups, triton_codecs

# (shape [B, rows, W], code, dtype): widths that are and are not powers of two, row counts that
# are not a multiple of a block's rows, one row of one run.
SHAPES = [((4, 64, 1024), "int8", jnp.float32), ((2, 8, 256), "int4", jnp.float32),
          ((3, 5, 160), "int8", jnp.bfloat16), ((2, 3, 64), "int4", jnp.bfloat16),
          ((3, 37, 640), "int8", jnp.float32), ((2, 300, 96), "int4", jnp.float32),
          ((1, 1, 32), "int8", jnp.float32)]


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


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("shape,code,dtype", SHAPES)
def test_encode_gives_the_group_codecs_wire(shape, code, dtype):
    x = _values(shape, dtype)
    want = jax.jit(lambda v: groups.encode(v, 32, code))(x)
    got = jax.jit(lambda v: triton_codecs.encode(v, 32, code, interpret=True))(x)
    assert got.shape == want.shape and got.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("shape,code,dtype,out_dtype",
                         [(*case, (jnp.bfloat16, jnp.float32)[i % 2])
                          for i, case in enumerate(SHAPES)])
def test_unrotate_gives_unrotate_codes(shape, code, dtype, out_dtype):
    rows, w = int(np.prod(shape[1:-1])), shape[-1]
    wire = groups.encode(_values(shape, dtype), 32, code)
    parts = groups.wire_parts(wire, (rows, w), 32, code)
    want = groups.unrotate_codes(*parts, 32, code, out_dtype, native=False)
    got = jax.jit(lambda *p: triton_codecs.unrotate(*p, 32, code, out_dtype,
                                                    interpret=True))(*parts)
    assert got.shape == want.shape == (*shape[:-1], w) and got.dtype == out_dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_a_rows_codes_do_not_depend_on_the_rows_beside_it():
    # Blocks of 8 rows of 1024 (or of 640, padded to 1024): the first k rows' wire is the same
    # alone as in a longer piece, whatever the other rows hold.
    enc = jax.jit(lambda v: triton_codecs.encode(v, 32, "int8", interpret=True))
    for w in (1024, 640):
        x = _values((1, 40, w), jnp.float32, seed=1)
        for k in (1, 13):
            other = x.at[:, k:].set(_values((1, 40 - k, w), jnp.float32, seed=k))
            alone = groups.wire_parts(enc(x[:, :k]), (k, w), 32, "int8")
            for full in (x, other):
                for a, b in zip(alone, groups.wire_parts(enc(full), (40, w), 32, "int8")):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b[:, :k]))


def test_under_vmap_each_slice_is_encoded_as_alone():
    x = _values((3, 2, 5, 160), jnp.float32)
    got = jax.vmap(lambda v: triton_codecs.encode(v, 32, "int8", interpret=True))(x)
    want = jnp.stack([groups.encode(x[i], 32, "int8") for i in range(3)])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    parts = [jnp.stack(p) for p in zip(*(groups.wire_parts(want[i], (5, 160), 32, "int8")
                                         for i in range(3)))]
    got = jax.vmap(lambda *p: triton_codecs.unrotate(*p, 32, "int8", jnp.bfloat16,
                                                     interpret=True))(*parts)
    want = jax.vmap(lambda *p: groups.unrotate_codes(*p, 32, "int8", jnp.bfloat16,
                                                     native=False))(*parts)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("code", ["int8", "int4"])
def test_the_kernels_lower_to_triton_inside_shard_map(code):
    # What a CUDA machine compiles, lowered here: the Pallas side of the Triton lowering (block
    # sizes, masks, the dot) and the result types shard_map(check_vma=True) asks for.
    mesh = jax.make_mesh((2,), ("x",))
    x = jax.device_put(jnp.ones((2, 12, 640), jnp.bfloat16), NamedSharding(mesh, P("x")))

    def body(v):
        wire = triton_codecs.encode(v, 32, code)
        parts = groups.wire_parts(wire, (12, 640), 32, code)
        return triton_codecs.unrotate(*parts, 32, code, jnp.bfloat16)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


def test_which_shapes_the_kernels_take():
    assert triton_codecs.supports(640, 32, "int8") and triton_codecs.supports(96, 32, "int4")
    assert not triton_codecs.supports(640, 32, "fp8")  # e4m3 stays in XLA ops
    assert not triton_codecs.supports(100, 32, "int8")  # not whole runs
    assert not triton_codecs.supports(64, 16, "int8")  # a dot needs 16 rows of a half run
    with pytest.raises(ValueError, match="multiple of 32"):
        triton_codecs.encode(jnp.ones((1, 2, 48)), 32, "int8")
    # No CUDA backend here: programs traced on this machine keep the XLA and native forms.
    assert not triton_codecs.in_use()
