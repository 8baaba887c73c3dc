"""Unrolled ring schedules: reduce-scatter and all-gather as chains of ppermutes.

Shards are addressed *relative* to this device d: relative row r is the shard owned by device
(d + r) % N. With that convention the schedule is the same on every device, and it is plain
Python loops that emit one `ppermute` per minishard per hop, so XLA sees independent
collective-permutes it may overlap with the (de)quantization of other minishards. Only the row
offsets into the local buffer depend on d: each read is a dynamic slice of one minishard, and
the gathered result is put in absolute order by a `lax.switch` over N static concatenations.

A *chain* moves a set of minishards in one ring direction for a number of hops:
- reduce-scatter: at hop t a device sends the partial sum for owner d + s*(H - t) to d + s
  (s = direction, H = hops); after the last hop the partial for the device's own shard arrives.
- all-gather: at hop t a device forwards to d + s the payload of owner d - s*t (its own at t=0);
  the payload is encoded once by its owner and forwarded verbatim.

Variants:
- full-loop: two chains of N-1 hops, one per direction, each taking half the minishards.
- semi-loop: for owner c, L = (N-1)//2 and R = N-1-L; devices c+R..c+1 pass partials leftwards
  and c-L..c-1 rightwards, so every minishard is reduced by two chains of about N/2 hops (fewer
  re-quantizations, lower error); the owner adds both arriving partials to its own value. The
  all-gather mirrors it (R hops rightwards, L hops leftwards).
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from equarx import quantize as qz


class Codec(Protocol):
    """How a float32 minishard f32[K, 8, 128] travels on the wire (one array, one ppermute)."""

    def encode(self, x: jax.Array) -> jax.Array: ...

    def decode(self, wire: jax.Array) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class Int8Codec:
    """EQuARX: int8 payload with its float32 8x128 scales appended (one int8 buffer)."""

    def encode(self, x: jax.Array) -> jax.Array:
        return qz.pack(*qz.quantize_blockwise(x))

    def decode(self, wire: jax.Array) -> jax.Array:
        return qz.packed_dequantize(wire)


@dataclasses.dataclass(frozen=True)
class FloatCodec:
    """Unquantized: the values rounded to `dtype`. 16-bit floats travel bit-cast to uint16
    because gloo moves bfloat16 at about half the bytes/s of integer types; the cast is pure
    data movement and changes nothing numerically."""

    dtype: jnp.dtype

    def encode(self, x: jax.Array) -> jax.Array:
        v = x.astype(self.dtype)
        if jnp.dtype(self.dtype).itemsize == 2:
            v = lax.bitcast_convert_type(v, jnp.uint16)
        return v

    def decode(self, wire: jax.Array) -> jax.Array:
        if wire.dtype == jnp.uint16:
            wire = lax.bitcast_convert_type(wire, self.dtype)
        return wire.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Chain:
    direction: int  # +1: send to device d+1; -1: send to device d-1
    hops: int
    minishards: tuple[int, ...]


def full_loop_chains(n_devices: int, n_minishards: int) -> tuple[list[Chain], list[Chain]]:
    """(reduce-scatter chains, all-gather chains) of the full-loop ring, both directions."""
    half = (n_minishards + 1) // 2
    groups = [tuple(range(half)), tuple(range(half, n_minishards))]
    chains = [Chain(s, n_devices - 1, g) for s, g in zip((+1, -1), groups) if g]
    return chains, chains


def semi_loop_chains(n_devices: int, n_minishards: int) -> tuple[list[Chain], list[Chain]]:
    """(reduce-scatter chains, all-gather chains) of the semi-loop (bidirectional chains)."""
    left = (n_devices - 1) // 2
    right = n_devices - 1 - left
    every = tuple(range(n_minishards))
    rs = [Chain(-1, right, every)] + ([Chain(+1, left, every)] if left else [])
    ag = [Chain(+1, right, every)] + ([Chain(-1, left, every)] if left else [])
    return rs, ag


def chains_for(variant: str, n_devices: int, n_minishards: int) -> tuple[list[Chain], list[Chain]]:
    if variant == "full":
        return full_loop_chains(n_devices, n_minishards)
    if variant == "semi":
        return semi_loop_chains(n_devices, n_minishards)
    raise ValueError(f"unknown ring variant {variant!r}")


def _ring_perm(n: int, direction: int) -> list[tuple[int, int]]:
    return [(i, (i + direction) % n) for i in range(n)]


def _row(d: jax.Array, r: int, n: int) -> jax.Array:
    return (d + r) % n


def ring_reduce_scatter(
    x: jax.Array, axis_name: str, chains: Sequence[Chain], codec: Codec
) -> jax.Array:
    """x: [N, m, K, 8, 128] (any float dtype), this device's partial sums of every shard -> f32[m, K, 8, 128],
    this device's fully reduced shard (row d). Partial sums are decoded to float32, the local
    minishard is added in float32, and the new partial is encoded afresh before the next hop."""
    n, m = x.shape[0], x.shape[1]
    d = lax.axis_index(axis_name)

    def local(r: int, j: int) -> jax.Array:
        # The caller's dtype stays in memory; the float32 view is made per minishard (fused).
        start = (_row(d, r, n), j) + (0,) * (x.ndim - 2)
        return lax.dynamic_slice(x, start, (1, 1) + x.shape[2:])[0, 0].astype(jnp.float32)

    in_flight: dict[tuple[int, int], jax.Array] = {}
    for t in range(max(c.hops for c in chains)):
        for ci, chain in enumerate(chains):
            if t >= chain.hops:
                continue
            owner = chain.direction * (chain.hops - t)
            perm = _ring_perm(n, chain.direction)
            for j in chain.minishards:
                partial = local(owner, j)
                if t > 0:
                    partial = codec.decode(in_flight[ci, j]) + partial
                in_flight[ci, j] = lax.ppermute(codec.encode(partial), axis_name, perm)
    reduced = []
    for j in range(m):
        acc = local(0, j)
        for ci, chain in enumerate(chains):
            if j in chain.minishards:
                acc = acc + codec.decode(in_flight[ci, j])
        reduced.append(acc)
    return jnp.stack(reduced)


def ring_all_gather(
    y: jax.Array, axis_name: str, n_devices: int, chains: Sequence[Chain], codec: Codec,
    out_dtype=jnp.float32,
) -> jax.Array:
    """y: f32[m, K, 8, 128], this device's reduced shard -> out_dtype[N, m, K, 8, 128], every
    shard. Each owner encodes its shard once; receivers forward the wire bytes verbatim and
    decode them. The owner keeps decode(encode(y)), so every device holds identical values."""
    n, m = n_devices, y.shape[0]
    out: list[list[jax.Array | None]] = [[None] * m for _ in range(n)]  # relative rows
    wire = [codec.encode(y[j]) for j in range(m)]
    for j in range(m):
        # The barrier makes the owner decode the very bytes it sends: without it XLA folds
        # decode(encode(y)) algebraically and the owner's copy can differ by an ulp.
        out[0][j] = codec.decode(lax.optimization_barrier(wire[j]))
    in_flight = {(ci, j): wire[j] for ci, c in enumerate(chains) for j in c.minishards}
    for t in range(max(c.hops for c in chains)):
        for ci, chain in enumerate(chains):
            if t >= chain.hops:
                continue
            perm = _ring_perm(n, chain.direction)
            source = (-chain.direction * (t + 1)) % n
            for j in chain.minishards:
                in_flight[ci, j] = lax.ppermute(in_flight[ci, j], axis_name, perm)
                out[source][j] = codec.decode(in_flight[ci, j])
    missing = [(r, j) for r in range(n) for j in range(m) if out[r][j] is None]
    if missing:  # a schedule bug, not a user error
        raise AssertionError(f"all-gather chains leave minishards uncovered: {missing[:4]}")
    pieces = [v.astype(out_dtype) for row in out for v in row]
    d = lax.axis_index(axis_name)
    return lax.switch(d, [_assemble_for(dd, n, m) for dd in range(n)], pieces)


def _assemble_for(d: int, n: int, m: int):
    """The absolute-order assembly on device d: a static concatenation (a copy per piece).
    Selecting one of N such programs with lax.switch is far cheaper on CPU than a gather or a
    chain of dynamic-update-slices, which XLA fuses into per-element selects over N*m pieces."""

    def assemble(pieces: list[jax.Array]) -> jax.Array:
        rows = [(c - d) % n for c in range(n)]  # absolute row c is relative row c - d
        return jnp.stack([jnp.stack(pieces[r * m : (r + 1) * m]) for r in rows])

    return assemble
