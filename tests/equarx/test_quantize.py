"""The int8 codec (Qp1 / Qp2 / dequantize / wire packing) and the HLO byte accounting."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equarx import accounting
from equarx import quantize as qz


# The codec's steps as compiled programs (as the collectives run them): one program each per
# shape rather than one per eager op.
_quantize_blockwise = jax.jit(qz.quantize_blockwise)
_dequantize = jax.jit(qz.dequantize)
_scale_round_cast = jax.jit(qz.scale_round_cast)
_pack = jax.jit(qz.pack)
_unpack = jax.jit(qz.unpack)
_quantize_rows = jax.jit(qz.quantize_rows)
_pack_rows = jax.jit(qz.pack_rows)
_packed_dequantize_rows = jax.jit(qz.packed_dequantize_rows)


def _minishard(values, k=3):
    x = np.zeros((k, 8, 128), np.float32)
    x.reshape(-1)[: len(values)] = values
    return x


def test_quantize_error_within_half_a_step():
    x = np.random.default_rng(0).standard_normal((16, 8, 128)).astype(np.float32) * 3
    q, scale = _quantize_blockwise(jnp.asarray(x))
    assert q.dtype == jnp.int8 and q.shape == x.shape and scale.shape == (8, 128)
    np.testing.assert_allclose(np.asarray(scale), np.abs(x).max(0) / 127, rtol=1e-6)
    err = np.abs(np.asarray(_dequantize(q, scale)) - x)
    assert np.all(err <= np.asarray(scale) / 2 * (1 + 1e-5))
    # The block's absmax lands exactly on +-127.
    assert np.all(np.abs(np.asarray(q)).max(0) == 127)


def test_qp1_and_qp2_compose_to_quantize_blockwise():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8, 128)), jnp.float32)
    amax = qz.absmax(x)
    q1, s1 = _scale_round_cast(x, amax)
    q2, s2 = _quantize_blockwise(x)
    assert np.array_equal(np.asarray(q1), np.asarray(q2))
    assert np.array_equal(np.asarray(s1), np.asarray(s2))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 13, 40])
def test_absmax_is_the_exact_per_lane_max_for_any_tile_count(k, dtype):
    """Qp1 (float32: slices then a halving tree; 16-bit floats: a max over bit patterns) equals
    numpy's max of |x| per lane, with leading batch dimensions, and a NaN or Inf anywhere makes
    that lane Inf (NaN of either sign, Inf of either sign)."""
    x = np.random.default_rng(k).standard_normal((2, k, 8, 128)).astype(np.float32)
    x[1, k - 1, 3, 7] = np.nan
    x[0, 0, 5, 9] = -np.inf
    x[0, k // 2, 6, 1] = -np.nan
    x[1, 0, 0, 0] = -1e4  # a negative absmax
    xs = jnp.asarray(x, dtype)
    got = np.asarray(jax.jit(qz.absmax)(xs))
    assert got.dtype == np.float32
    want = np.abs(np.asarray(xs.astype(jnp.float32))).max(axis=1)
    want[np.isnan(want)] = np.inf
    np.testing.assert_array_equal(got, want)


def test_rounds_half_to_even():
    # Tile 1 puts 127 in every lane, so every scale is exactly 1 and q = round(tile 0).
    x = np.stack([_minishard([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5], k=1)[0],
                  np.full((8, 128), 127.0, np.float32)])
    q, scale = _quantize_blockwise(jnp.asarray(x))
    assert np.all(np.asarray(scale) == 1.0)
    assert list(np.asarray(q)[0].reshape(-1)[:7]) == [0, 2, 2, 4, 0, -2, -2]


def test_tiny_blocks_flush_to_zero_without_overflow():
    x = np.full((4, 8, 128), 1e-40, np.float32)  # 127 / 1e-40 overflows float32
    x[:, 0, 0] = 1.0
    q, scale = _quantize_blockwise(jnp.asarray(x))
    deq = np.asarray(_dequantize(q, scale))
    assert np.isfinite(deq).all() and np.abs(deq[:, 1:]).max() <= 1e-40
    np.testing.assert_allclose(deq[:, 0, 0], 1.0)


def test_zero_block_is_exact_and_scale_zero():
    x = np.zeros((2, 8, 128), np.float32)
    x[:, 0, 0] = [1.0, -2.0]  # one live lane, every other lane is an all-zero block
    q, scale = _quantize_blockwise(jnp.asarray(x))
    deq = np.asarray(_dequantize(q, scale))
    assert np.asarray(scale)[0, 1] == 0 and np.all(deq[:, 0, 1:] == 0) and np.all(deq[:, 1:] == 0)
    assert np.isfinite(deq).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_travels_in_the_scale(bad):
    x = np.ones((300, 8, 128), np.float32)  # large enough for XLA's vectorised reductions
    x[100, 2, 5] = bad
    q, scale = jax.jit(qz.quantize_blockwise)(jnp.asarray(x))
    q, scale = np.asarray(q), np.asarray(scale)
    assert not np.isfinite(scale[2, 5])
    assert np.isfinite(scale).sum() == 8 * 128 - 1
    assert q.dtype == np.int8 and np.all(q[:, 2, 5] == 0)  # q itself stays a defined integer
    deq = np.asarray(_dequantize(jnp.asarray(q), jnp.asarray(scale)))
    assert not np.isfinite(deq[:, 2, 5]).any()  # the whole block, the bad element included
    assert np.isfinite(np.delete(deq.reshape(300, -1), 2 * 128 + 5, axis=1)).all()


def test_pack_roundtrip_is_bit_exact():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 8, 128)), jnp.float32)
    q, scale = _quantize_blockwise(x)
    buf = _pack(q, scale)
    assert buf.dtype == jnp.int8 and buf.size == 5 * 1024 + qz.SCALE_BYTES
    q2, s2 = _unpack(buf)
    assert np.array_equal(np.asarray(q2), np.asarray(q))
    assert np.array_equal(np.asarray(s2).view(np.uint32), np.asarray(scale).view(np.uint32))


def test_row_blocks_quantize_pack_and_poison_one_row():
    x = np.random.default_rng(4).standard_normal((6, 8, 128)).astype(np.float32)
    x[2, 3, 7] = np.nan
    q, scale = _quantize_rows(jnp.asarray(x))
    assert q.shape == x.shape and scale.shape == (6, 8)
    buf = _pack_rows(q, scale)
    assert buf.dtype == jnp.int8 and buf.size == 6 * 1024 + 6 * 8 * 4  # 4 bytes per 128 values
    deq = np.asarray(_packed_dequantize_rows(buf))
    assert not np.isfinite(deq[2, 3]).any()
    ok = np.ones((6, 8), bool)
    ok[2, 3] = False
    good = np.abs(x).max(-1)[ok] / 127
    assert np.all(np.abs(deq[ok] - x[ok]).max(-1) <= good / 2 * (1 + 1e-5))
    assert np.all(np.abs(np.asarray(q)[ok]).max(-1) == 127)


def test_hadamard_rotation_is_exactly_invertible_and_orthogonal():
    from equarx import hadamard
    h = np.array([[1.0]])
    for _ in range(7):
        h = np.block([[h, h], [h, -h]])  # Sylvester's construction of the 128x128 matrix
    x = np.random.default_rng(5).standard_normal(3 * 128).astype(np.float32)
    r = np.asarray(jax.jit(hadamard.rotate)(x)).reshape(3, 128)
    np.testing.assert_allclose(r, (x.reshape(3, 128) * hadamard._SIGNS) @ h.T, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(r, axis=1),
                               np.sqrt(128) * np.linalg.norm(x.reshape(3, 128), axis=1), rtol=1e-5)
    back = np.asarray(jax.jit(hadamard.unrotate)(r.reshape(-1)))
    np.testing.assert_allclose(back, x, atol=1e-6)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="8, 128"):
        qz.absmax(jnp.zeros((4, 128)))
    with pytest.raises(ValueError, match="packed"):
        qz.unpack(jnp.zeros((4, 1024), jnp.int8))
    with pytest.raises(ValueError, match="packed"):
        qz.unpack_rows(jnp.zeros((32, 32), jnp.int8))


# -- byte accounting on HLO text ---------------------------------------------------------------

_HLO = """HloModule jit_f, entry_computation_layout={()->()}, num_partitions=4

ENTRY %main {
  %a = s8[1000]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %b = u16[10]{0} collective-permute(%y), channel_id=2, source_target_pairs={{0,1},{0,2}}
  %c = f32[100]{0} all-reduce(%z), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
  %d = bf16[4,8]{1,0} all-gather(%w), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}
  %e = f32[25]{0} reduce-scatter(%v), channel_id=5, replica_groups={{0,1},{2,3}}, dimensions={0}
  %f = (s8[64]{0}, s8[64]{0}, u32[], u32[]) collective-permute-start(%u), source_target_pairs={{1,0}}
  %g = s8[64]{0} collective-permute-done(%f)
}
"""


def test_accounting_reads_each_collective_kind():
    ops = accounting.collectives(_HLO)
    assert [o.kind for o in ops] == [
        "collective-permute", "collective-permute", "all-reduce", "all-gather",
        "reduce-scatter", "collective-permute"]
    assert ops[0].bytes_by_device == {0: 1000, 1: 1000, 2: 1000, 3: 1000}
    assert ops[1].bytes_by_device == {0: 40}  # device 0 sends to two peers
    assert ops[2].bytes_by_device[2] == pytest.approx(2 * 3 / 4 * 400)
    assert ops[3].bytes_by_device == {None: pytest.approx(3 / 4 * 64)}
    assert ops[4].bytes_by_device[3] == pytest.approx(1 * 100)
    assert ops[5].bytes_by_device == {1: 64}
    # Device 0: 1000 + 40 + 600 + 48 + 100; device 1 adds 64 instead of 40.
    assert accounting.bytes_sent_per_device(_HLO) == pytest.approx(1000 + 64 + 600 + 48 + 100)


def test_ideal_ring_bytes():
    assert accounting.ideal_ring_bytes(1000, 2, 4) == pytest.approx(3000)
    assert accounting.ideal_ring_bytes(1000, 2, 1) == 0
    with pytest.raises(ValueError):
        accounting.ideal_ring_bytes(10, 2, 0)
    with pytest.raises(TypeError):
        accounting.hlo_text(42)
