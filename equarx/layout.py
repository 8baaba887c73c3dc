"""How a message is cut into N shards of `pieces` pieces, behind one view for the schedules
(`piece`, `assemble`, `split`, `join`).

`Layout` (blocks "tile", "hadamard") is the paper's flat layout. `TokenLayout` (blocks "group",
unquantized rings) splits every row by columns, so a value's shard and the order of its sums depend
on its column alone (token-local). See docs/algorithm.md, "Layout" and "Version 2"."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from equarx import quantize as qz

MIN_TILES_PER_MINISHARD = 128
MIN_PIECE_ELEMENTS = MIN_TILES_PER_MINISHARD * qz.TILE_ELEMENTS


@dataclasses.dataclass(frozen=True)
class Layout:
    """The flat layout: `n_devices` shards x `minishards` x `tiles` tiles of 8x128."""

    n_elements: int
    n_devices: int
    minishards: int
    tiles: int  # K: tiles per minishard; a tile scale covers K elements

    @property
    def padded_elements(self) -> int:
        return self.n_devices * self.minishards * self.tiles * qz.TILE_ELEMENTS

    @property
    def pieces(self) -> int:
        return self.minishards

    @property
    def piece_shape(self) -> tuple[int, ...]:
        return (self.tiles, *qz.TILE)

    def split(self, x: jax.Array) -> jax.Array:
        flat = jnp.pad(x.reshape(-1), (0, self.padded_elements - x.size))
        return flat.reshape(self.n_devices, self.minishards, self.tiles, *qz.TILE)

    def piece(self, buf: jax.Array, shard, j0: int, j1: int) -> jax.Array:
        start = (shard, j0) + (0,) * (buf.ndim - 2)
        return lax.dynamic_slice(buf, start, (1, j1 - j0) + buf.shape[2:])[0]

    def assemble(self, stacked: jax.Array) -> jax.Array:
        return stacked  # [N, m, K, 8, 128] is the buffer's own order

    def join(self, buf: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return buf.reshape(-1)[: self.n_elements].reshape(shape)


def plan_layout(n_elements: int, n_devices: int, minishards: int) -> Layout:
    """The flat layout for a message of `n_elements`: a minishard is never cut below
    MIN_TILES_PER_MINISHARD tiles (each carries a 4 KiB float32 scale tile: at 128 tiles the
    scales add at most 1/32 to the int8 payload)."""
    if n_elements < 1 or n_devices < 1 or minishards < 1:
        raise ValueError(f"bad layout request: {n_elements=} {n_devices=} {minishards=}")
    tiles_per_shard = math.ceil(n_elements / (n_devices * qz.TILE_ELEMENTS))
    m = max(1, min(minishards, tiles_per_shard // MIN_TILES_PER_MINISHARD))
    return Layout(n_elements, n_devices, m, math.ceil(tiles_per_shard / m))


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Rows [T, D] -> buffer [m, Tm, N, H, W]: m row minishards of Tm rows, N column shards,
    H column halves (2 for the full-loop ring, else 1) of W columns (w = H W per shard)."""

    shape: tuple[int, ...]  # the caller's
    n_devices: int
    minishards: int  # m
    rows_per_minishard: int  # Tm
    halves: int  # H
    width: int  # W

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1

    @property
    def columns(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def shard_width(self) -> int:
        return self.halves * self.width

    @property
    def pieces(self) -> int:
        return self.halves * self.minishards

    @property
    def piece_shape(self) -> tuple[int, ...]:
        return (self.rows_per_minishard, self.width)

    @property
    def padded_elements(self) -> int:
        return (self.minishards * self.rows_per_minishard * self.n_devices * self.shard_width)

    def split(self, x: jax.Array) -> jax.Array:
        t = self.rows
        rows = x.reshape(t, -1)  # the caller's columns, or more (already padded, <= N w)
        m, tm = self.minishards, self.rows_per_minishard
        pad = self.n_devices * self.shard_width - rows.shape[1]
        rows = jnp.pad(rows, ((0, m * tm - t), (0, pad)))
        return rows.reshape(m, tm, self.n_devices, self.halves, self.width)

    def _start(self, j0: int, j1: int) -> tuple[int, int]:
        """(column half, first minishard) of piece [j0, j1)."""
        m = self.minishards
        half, i0 = divmod(j0, m)
        if (j1 - 1) // m != half:  # a schedule bug, not a user error
            raise AssertionError(f"piece [{j0}, {j1}) crosses a column half of {m} minishards")
        return half, i0

    def piece(self, buf: jax.Array, shard, j0: int, j1: int) -> jax.Array:
        half, i0 = self._start(j0, j1)
        size = (j1 - j0, self.rows_per_minishard, 1, 1, self.width)
        return lax.dynamic_slice(buf, (i0, 0, shard, half, 0), size).reshape(
            j1 - j0, self.rows_per_minishard, self.width)

    def piece_geometry(self, j0: int, j1: int) -> dict[str, int]:
        """Where `piece(buf, shard, j0, j1)` lies in the flattened buffer, for a kernel that
        reads it in place: `pieces` minishards of `rows` rows of `width` values, row i at
        element base + shard * shard_stride + i * row_stride, for 0 <= shard < shards."""
        half, i0 = self._start(j0, j1)
        row_stride = self.n_devices * self.shard_width
        return dict(pieces=j1 - j0, rows=self.rows_per_minishard, width=self.width,
                    row_stride=row_stride, base=i0 * self.rows_per_minishard * row_stride
                    + half * self.width, shard_stride=self.shard_width, shards=self.n_devices)

    def assemble(self, stacked: jax.Array) -> jax.Array:
        """[N, H m, Tm, W] (pieces in half-major order) -> the buffer [m, Tm, N, H, W]."""
        n, h, m = self.n_devices, self.halves, self.minishards
        v = stacked.reshape(n, h, m, self.rows_per_minishard, self.width)
        return v.transpose(2, 3, 0, 1, 4)

    def join_rows(self, buf: jax.Array) -> jax.Array:
        """The buffer back to the caller's rows [T, N w] (column padding kept)."""
        rows = buf.reshape(self.minishards * self.rows_per_minishard,
                           self.n_devices * self.shard_width)
        return rows[: self.rows]

    def join(self, buf: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        t, d = self.rows, self.columns
        rows = buf.reshape(self.minishards * self.rows_per_minishard,
                           self.n_devices * self.shard_width)
        return rows[:t, :d].reshape(shape)


def plan_token_layout(shape: tuple[int, ...], n_devices: int, minishards: int, halves: int = 1,
                      granule: int = 1) -> TokenLayout:
    """The token layout of a message of `shape`: each shard's column half is a multiple of
    `granule` (the codec's group) wide; minishards are never cut below MIN_PIECE_ELEMENTS."""
    if n_devices < 1 or minishards < 1 or halves not in (1, 2) or granule < 1:
        raise ValueError(f"bad layout request: {shape=} {n_devices=} {minishards=} {halves=}")
    t = math.prod(shape[:-1]) if len(shape) > 1 else 1
    d = shape[-1] if shape else 1
    if t * d < 1:
        raise ValueError(f"bad layout request: empty message of shape {shape}")
    width = math.ceil(d / (n_devices * halves * granule)) * granule
    per_row = halves * width
    m = max(1, min(minishards, (t * per_row) // MIN_PIECE_ELEMENTS, t))
    return TokenLayout(tuple(shape), n_devices, m, math.ceil(t / m), halves, width)
