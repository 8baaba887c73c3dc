"""Dynamic block-wise symmetric int8 quantization with 8x128 scale tiles (the paper's tile codec).

A minishard is K tiles of 8x128 with one 8x128 scale tile, an elementwise max over tiles. Qp1
(`absmax`) and Qp2 (`scale_round_cast`) stay separate, as in the paper, so Qp1 can start while the
next minishard is on the wire. A NaN or Inf travels in the float32 scale. See docs/algorithm.md,
"Codecs"."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from equarx.codec_spec import round_int8

TILE = (8, 128)
TILE_ELEMENTS = TILE[0] * TILE[1]
QMAX = 127.0
SCALE_BYTES = TILE_ELEMENTS * 4  # one float32 8x128 tile per minishard


def _check_minishards(x: jax.Array) -> None:
    if x.ndim < 3 or x.shape[-2:] != TILE:
        raise ValueError(f"expected [..., K, 8, 128] minishards, got shape {x.shape}")


# Qp1's first level takes the max over this many disjoint slices of the tiles at once.
_FAN_IN = 16


def _magnitude(x: jax.Array) -> jax.Array:
    """|x| in float32, with NaN mapped to Inf (so no max ever depends on NaN handling)."""
    mag = jnp.abs(x.astype(jnp.float32))
    return jnp.where(jnp.isnan(mag), jnp.inf, mag)


def _tree_max(m: jax.Array) -> jax.Array:
    """f32[..., K, 8, 128] (K >= 1, values >= 0) -> f32[..., 8, 128] by halving K."""
    k = m.shape[-3]
    width = 1 << (k - 1).bit_length()
    if width != k:  # zeros never raise a max of magnitudes
        pad = [(0, 0)] * m.ndim
        pad[-3] = (0, width - k)
        m = jnp.pad(m, pad)
    while m.shape[-3] > 1:
        half = m.shape[-3] // 2
        m = jnp.maximum(m[..., :half, :, :], m[..., half:, :, :])
    return m[..., 0, :, :]


def _absmax_16bit(x: jax.Array) -> jax.Array:
    """Qp1 for a 16-bit float x, on its bit patterns: with the sign bit cleared, the order of
    the integers is the order of the magnitudes, and every NaN pattern lies above Inf's (so
    clamping to Inf's pattern maps NaN to Inf). Exact."""
    bits = lax.bitcast_convert_type(x, jnp.uint16) & jnp.uint16(0x7FFF)
    inf_bits = lax.bitcast_convert_type(jnp.array(jnp.inf, x.dtype), jnp.uint16)
    top = jnp.minimum(jnp.max(bits, axis=-3), inf_bits)
    return lax.bitcast_convert_type(top, x.dtype).astype(jnp.float32)


def absmax(x: jax.Array) -> jax.Array:
    """Qp1: per-lane absmax over the tiles. x: float[..., K, 8, 128] -> f32[..., 8, 128].

    A NaN or Inf anywhere in a block gives it an Inf absmax. Max is exact, so every path below
    gives the values of a plain reduce; they differ only in how XLA:CPU compiles them.

    float32 x: elementwise maxima, not a reduce, in two stages. A bare max-reduce goes to a
    library kernel (YNNPACK) that cannot take the elementwise |x| along, so |x| (and, after a
    hop, the dequantize-and-add that makes x) is first written out in float32; a plain halving
    tree over |x| has the same problem once |x| feeds too many slices to be duplicated. Here
    the first stage takes |.| of each of 16 disjoint slices of x itself (every element read
    once, one fused loop, 1/16 of the size out), then a halving tree finishes (its timings:
    docs/results.md).
    """
    _check_minishards(x)
    if jnp.dtype(x.dtype).itemsize == 2:
        # A bfloat16 piece of the caller's message (the reduce-scatter's first hop): an integer
        # max-reduce over its bits reads 2 bytes per value where the float path below has XLA
        # write a float32 copy first. On float32 input the integer reduce is the slower one, so
        # each dtype takes its own path (docs/results.md).
        return _absmax_16bit(x)
    k = x.shape[-3]
    fan = min(_FAN_IN, k)
    size = k // fan
    parts = [_magnitude(x[..., i * size:(i + 1) * size, :, :]) for i in range(fan)]
    while len(parts) > 1:
        pairs = [jnp.maximum(a, b) for a, b in zip(parts[::2], parts[1::2])]
        parts = pairs + parts[len(pairs) * 2:]
    result = _tree_max(parts[0])
    if k > fan * size:  # fewer than _FAN_IN leftover tiles
        result = jnp.maximum(result, _tree_max(_magnitude(x[..., fan * size:, :, :])))
    return result


def _round_cast(x: jax.Array, amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Qp2 for any block shape: amax broadcasts against x (same rank)."""
    x = x.astype(jnp.float32)
    scale = amax / QMAX
    positive = jnp.isfinite(amax) & (amax > 0)
    inv = QMAX / jnp.where(positive, amax, 1.0)
    usable = positive & jnp.isfinite(inv)
    inv = jnp.where(usable, inv, 0.0)
    q = round_int8(x * inv)  # the group codec's rounding (equarx.codec_spec)
    # Where x is NaN/Inf the sum is too and its low byte is meaningless: force q to 0.
    return jnp.where(usable, q, jnp.int8(0)), scale


def scale_round_cast(x: jax.Array, amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Qp2: scale, round half to even, cast. x: f32[..., K, 8, 128], amax: f32[..., 8, 128].

    Returns (q: int8[..., K, 8, 128], scale: f32[..., 8, 128]) with x ~= q * scale. No clip is needed:
    |x| <= amax makes |x * 127 / amax| round to at most 127. A zero block gets scale 0 and
    q 0, so it dequantizes to exactly 0; so does a block too small for 127 / amax to be finite
    (|x| < 1e-36). A block with a non-finite absmax gets q 0 and a non-finite scale: it
    dequantizes to NaN/Inf everywhere.
    """
    q, scale = _round_cast(x, amax[..., None, :, :])
    return q, scale[..., 0, :, :]


def quantize_blockwise(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Qp1 then Qp2. x: f32[..., K, 8, 128] -> (int8[..., K, 8, 128], f32[..., 8, 128])."""
    return scale_round_cast(x, absmax(x))


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """int8[..., K, 8, 128], f32[..., 8, 128] -> f32[..., K, 8, 128]."""
    return q.astype(jnp.float32) * scale[..., None, :, :]


# -- wire format: one int8 buffer per minishard, so one ppermute moves data and scales ---------
# Rows of 1024 bytes: K rows of int8 values, then 4 rows holding the float32 scales' bytes.
# Joining along the major axis keeps the copy two contiguous blocks (a flat 1-D concatenate
# compiles to a per-element select on XLA:CPU and costs several times the quantization).
SCALE_ROWS = SCALE_BYTES // TILE_ELEMENTS


def pack(q: jax.Array, scale: jax.Array) -> jax.Array:
    """(int8[..., K, 8, 128], f32[..., 8, 128]) -> int8[..., K + 4, 1024]: payload rows, then
    the scale rows, per minishard."""
    batch = q.shape[:-3]
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.int8)  # [..., 8, 128, 4]
    return jnp.concatenate(
        [q.reshape(*batch, -1, TILE_ELEMENTS),
         scale_bytes.reshape(*batch, SCALE_ROWS, TILE_ELEMENTS)], axis=-2)


def unpack(buf: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of `pack`: int8[..., K + 4, 1024] -> (int8[..., K, 8, 128], f32[..., 8, 128])."""
    if buf.ndim < 2 or buf.shape[-2] <= SCALE_ROWS or buf.shape[-1] != TILE_ELEMENTS:
        raise ValueError(f"not packed minishards: shape {buf.shape}")
    batch = buf.shape[:-2]
    q = buf[..., :-SCALE_ROWS, :].reshape(*batch, -1, *TILE)
    scale_bytes = buf[..., -SCALE_ROWS:, :].reshape(*batch, *TILE, 4)
    return q, jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)


def packed_dequantize(buf: jax.Array) -> jax.Array:
    """int8[..., K + 4, 1024] -> f32[..., K, 8, 128]."""
    return dequantize(*unpack(buf))


# -- row blocks (AllReduceConfig.blocks="hadamard"): one scale per 128 consecutive values --------
# A cross-lane max per row (cheap on CPU and GPU; on TPU it is the relayout the tile layout
# avoids). The values are meant to be Hadamard-rotated first (equarx.hadamard), so a row's
# absmax reflects its bulk rather than one outlier channel.
ROW_BYTES = 32  # wire rows of 32 bytes: a K-tile minishard is 32 K payload rows + K scale rows


def absmax_rows(x: jax.Array) -> jax.Array:
    """Qp1 for row blocks: f32[..., K, 8, 128] -> f32[..., K, 8] (NaN -> Inf, as `absmax`)."""
    _check_minishards(x)
    mag = jnp.abs(x.astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isnan(mag), jnp.inf, mag), axis=-1)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """f32[..., K, 8, 128] -> (int8[..., K, 8, 128], f32[..., K, 8]): Qp1 then Qp2 per row."""
    q, scale = _round_cast(x, absmax_rows(x)[..., None])
    return q, scale[..., 0]


def dequantize_rows(q: jax.Array, scale: jax.Array) -> jax.Array:
    """int8[..., K, 8, 128], f32[..., K, 8] -> f32[..., K, 8, 128]."""
    return q.astype(jnp.float32) * scale[..., None]


def pack_rows(q: jax.Array, scale: jax.Array) -> jax.Array:
    """(int8[..., K, 8, 128], f32[..., K, 8]) -> int8[..., 33 K, 32]: payload, then scales.
    Rows of 32 bytes keep the join a major-axis concatenate (see `pack`)."""
    batch = q.shape[:-3]
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.int8)  # [..., K, 8, 4]
    return jnp.concatenate(
        [q.reshape(*batch, -1, ROW_BYTES),
         scale_bytes.reshape(*batch, -1, ROW_BYTES)], axis=-2)


def unpack_rows(buf: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of `pack_rows`: int8[..., 33 K, 32] -> (int8[..., K, 8, 128], f32[..., K, 8])."""
    if buf.ndim < 2 or buf.shape[-1] != ROW_BYTES or buf.shape[-2] % 33:
        raise ValueError(f"not packed row-block minishards: shape {buf.shape}")
    batch = buf.shape[:-2]
    k = buf.shape[-2] // 33
    q = buf[..., : 32 * k, :].reshape(*batch, k, *TILE)
    scale_bytes = buf[..., 32 * k:, :].reshape(*batch, k, TILE[0], 4)
    return q, jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)


def packed_dequantize_rows(buf: jax.Array) -> jax.Array:
    """int8[..., 33 K, 32] -> f32[..., K, 8, 128]."""
    return dequantize_rows(*unpack_rows(buf))
