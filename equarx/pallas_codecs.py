"""The codecs and layouts of the Pallas ring kernel (equarx.pallas_ring): a minishard in VMEM and on
the wire, written with the operations Mosaic lowers.

Each codec sizes its arrays as whole native TPU tiles and uses only tile-aligned reshapes,
elementwise arithmetic, equal-width bit casts and major-axis reductions. Each computes what
equarx.codecs computes, operation for operation, so equarx.ring is its bitwise reference."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from equarx import codec_spec
from equarx import quantize as qz
from equarx.layout import MIN_PIECE_ELEMENTS, Layout, TokenLayout, plan_token_layout

LANES = 128
INT8_ROWS = 32  # the int8 tile's sublanes: payload arrays are whole 32x128 tiles
BF16_ROWS = 16
# A kernel minishard holds at most this many values, so that the kernel's VMEM buffers
# (about 20 bytes per minishard value over both directions, see pallas_ring.vmem_bytes) stay
# far under the smallest default scoped VMEM limit (16 MiB on v5e).
MAX_PIECE_ELEMENTS = 1 << 17
# The kernel goes through a direction's minishards a window of (at most) this many at a time,
# all hops of a window before the next, so its receive slots (window + 2), and with them its
# VMEM, do not grow with the message (equarx.pallas_ring).
WINDOW = 4


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _magnitude(v: jax.Array) -> jax.Array:
    """|v| with NaN mapped to Inf (as equarx.quantize and equarx.groups do)."""
    mag = jnp.abs(v)
    return jnp.where(mag != mag, jnp.inf, mag)


@dataclasses.dataclass(frozen=True)
class TileCodec:
    """The paper's codec on [8 K, 128] minishards: q int8 [8 K, 128], scale f32 [8, 128]."""

    rows: int  # 8 K

    wire_dtype = jnp.int8
    scale_dtype = jnp.float32

    @property
    def scale_shape(self) -> tuple[int, int]:
        return qz.TILE

    def _per_value(self, tile: jax.Array) -> jax.Array:
        """An [8, 128] tile repeated over the K tiles: [8 K, 128] (a tile-aligned reshape)."""
        k = self.rows // qz.TILE[0]
        return jnp.broadcast_to(tile[None], (k, *qz.TILE)).reshape(self.rows, LANES)

    def encode(self, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """f32 [8 K, 128] -> (int8 [8 K, 128], f32 [8, 128]): quantize.absmax then
        quantize.scale_round_cast."""
        k = self.rows // qz.TILE[0]
        amax = jnp.max(_magnitude(v).reshape(k, *qz.TILE), axis=0)
        scale = amax / qz.QMAX
        positive = (amax < jnp.inf) & (amax > 0)
        inv = qz.QMAX / jnp.where(positive, amax, 1.0)
        usable = positive & (inv < jnp.inf)
        inv = jnp.where(usable, inv, 0.0)
        q = codec_spec.round_int8(v * self._per_value(inv))
        q = jnp.where(self._per_value(usable.astype(jnp.int32)) != 0, q, jnp.int8(0))
        return q, scale

    def decode(self, q: jax.Array, scale: jax.Array) -> jax.Array:
        return q.astype(jnp.float32) * self._per_value(scale)


@dataclasses.dataclass(frozen=True)
class GroupCodec:
    """Rotated runs of `group` values (rotation done outside the kernel) on transposed pieces
    [W, Tm]: q int8 [W, Tm], scale bf16 [W / group, Tm]. The codes and the scale values are
    equarx.codec_spec's (tests/equarx/test_codec_conformance.py); the wire is its own, label
    "int8@pallas", `codec_spec.wire_bytes_per_value(g, "int8", scale="bf16")` (0.531 of bf16's
    bytes where the specification's step and exponent bytes make 0.516).

    Why not the specification's bytes here: the kernel's arrays are whole native TPU tiles
    (int8 32x128), and a row's exponent byte would be an int8 array [1, Tm] (one sublane),
    which Mosaic lays out, and its DMAs move, as a whole 32-row tile: 32 bytes a token instead
    of one; the step bytes [W / g, Tm] pad to 32 rows as the bfloat16 scales pad to 16. Packing
    the exponent into the step array (an extra sublane row) needs an unaligned sublane slice of
    a packed int8 array, which this kernel avoids (see the module docstring). Until that is
    written and timed on a TPU, this codec keeps the bfloat16 scale."""

    rows: int  # W
    lanes: int  # Tm
    group: int

    wire_dtype = jnp.int8
    scale_dtype = jnp.bfloat16

    @property
    def scale_shape(self) -> tuple[int, int]:
        return (self.rows // self.group, self.lanes)

    def _groups(self, v: jax.Array) -> jax.Array:
        return v.reshape(self.rows // self.group, self.group, self.lanes)

    def encode(self, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        amax = jnp.max(_magnitude(self._groups(v)), axis=1)  # [W / g, Tm]
        # codec_spec.scale_parts along the token's runs (axis 0); the scale it picks is a
        # bfloat16 value, which travels as such here (2 bytes where groups' wire packs the
        # same scale in a step byte and a row's exponent byte).
        _, _, s32, inv = codec_spec.scale_parts(amax, codec_spec.CODES["int8"], axis=0)
        scale = s32.astype(jnp.bfloat16)
        q = codec_spec.round_int8(self._groups(v) * inv[:, None, :])
        return q.reshape(self.rows, self.lanes), scale

    def decode(self, q: jax.Array, scale: jax.Array) -> jax.Array:
        v = self._groups(q.astype(jnp.float32)) * scale.astype(jnp.float32)[:, None, :]
        return v.reshape(self.rows, self.lanes)


@dataclasses.dataclass(frozen=True)
class FloatCodec:
    """Unquantized (bf16_ring): bfloat16 on the wire, no scales."""

    wire_dtype = jnp.bfloat16
    scale_dtype = None
    scale_shape = None

    def encode(self, v: jax.Array) -> tuple[jax.Array, None]:
        return v.astype(jnp.bfloat16), None

    def decode(self, w: jax.Array, scale) -> jax.Array:
        return w.astype(jnp.float32)


KernelCodec = TileCodec | GroupCodec | FloatCodec


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How a message becomes the kernel's buffer [N, 2, mh, R, L] and back.

    `layout` is the equarx.layout object of the same pieces, so that equarx.ring's functions
    (the ppermute implementation) can run the very same schedule as a reference: direction +1
    carries pieces 0..mh-1, direction -1 pieces mh..2 mh-1."""

    layout: Layout | TokenLayout
    codec: KernelCodec
    minishards: int  # mh, per direction

    @property
    def n_devices(self) -> int:
        return self.layout.n_devices

    @property
    def window(self) -> int:
        return min(self.minishards, WINDOW)

    @property
    def piece(self) -> tuple[int, int]:  # (R, L)
        if isinstance(self.layout, Layout):
            return (self.layout.tiles * qz.TILE[0], LANES)
        return (self.layout.width, self.layout.rows_per_minishard)

    def to_kernel(self, buf: jax.Array) -> jax.Array:
        """The layout's buffer -> [N, 2, mh, R, L]."""
        n, mh = self.n_devices, self.minishards
        if isinstance(self.layout, Layout):  # [N, 2 mh, K, 8, 128]: a free reshape
            return buf.reshape(n, 2, mh, *self.piece)
        return buf.transpose(2, 3, 0, 4, 1)  # [mh, Tm, N, 2, W] -> [N, 2, mh, W, Tm]

    def from_kernel(self, kbuf: jax.Array) -> jax.Array:
        if isinstance(self.layout, Layout):
            return kbuf.reshape(self.n_devices, 2 * self.minishards, self.layout.tiles,
                                *qz.TILE)
        return kbuf.transpose(2, 4, 0, 1, 3)


def plan(method: str, blocks: str, group_size: int, shape: tuple[int, ...], n_devices: int,
         minishards: int, min_piece: int = MIN_PIECE_ELEMENTS,
         max_piece: int = MAX_PIECE_ELEMENTS) -> KernelPlan:
    """The kernel's plan for a message of `shape`: `minishards` pieces per shard at most (split
    over the two directions, at least one each), more where a piece would exceed `max_piece`
    values (default MAX_PIECE_ELEMENTS: VMEM), fewer where a piece would fall under
    `min_piece` values (the ppermute path's minimum; tests lower it to pipeline small
    messages)."""
    size = math.prod(shape)
    if method == "int8" and blocks == "tile":
        tiles = math.ceil(size / (n_devices * qz.TILE_ELEMENTS))  # per shard
        mh = max(1, min(minishards // 2, tiles * qz.TILE_ELEMENTS // (2 * min_piece)))
        mh = max(mh, math.ceil(tiles * qz.TILE_ELEMENTS / (2 * max_piece)))
        k = _round_up(math.ceil(tiles / (2 * mh)), INT8_ROWS // qz.TILE[0])
        layout = Layout(size, n_devices, 2 * mh, k)
        return KernelPlan(layout, TileCodec(k * qz.TILE[0]), mh)
    if method == "int8" and blocks == "group":
        granule = max(group_size, INT8_ROWS)
    elif method == "bf16_ring":
        granule = BF16_ROWS
    else:
        raise ValueError(f"the Pallas kernel covers int8 with blocks 'tile' or 'group' and "
                         f"bf16_ring, not {method!r} with blocks {blocks!r}")
    base = plan_token_layout(tuple(shape), n_devices, 1, 2, granule)  # the columns
    t, width = base.rows, base.width  # width: one direction's columns of one shard
    # Minishards are whole blocks of 128 tokens (lanes): as many as `minishards` and
    # `min_piece` ask for, fewer blocks each where a piece would exceed `max_piece`.
    blocks = math.ceil(t / LANES)
    wish = max(1, min(minishards // 2, t * width // min_piece))
    per_piece = max(1, min(math.ceil(blocks / wish), max_piece // (width * LANES)))
    mh = math.ceil(blocks / per_piece)
    tm = math.ceil(blocks / mh) * LANES  # the blocks spread evenly over the minishards
    layout = TokenLayout(tuple(shape), n_devices, mh, tm, 2, width)
    if method == "bf16_ring":
        return KernelPlan(layout, FloatCodec(), mh)
    return KernelPlan(layout, GroupCodec(width, tm, group_size), mh)
