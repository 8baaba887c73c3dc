"""Unrolled ring schedules: reduce-scatter and all-gather as chains of ppermutes.

Shards are addressed relative to this device, so every device runs the same Python loops, one
`ppermute` per piece per hop. A `Chain` moves minishards one ring direction for some hops.
Full-loop: two chains of N-1 hops; semi-loop: two chains of about N/2 hops (fewer re-quantizations).
See docs/algorithm.md, "Schedules"."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from equarx import codecs
from equarx.codecs import Codec

# Putting relative rows in absolute order: XLA:CPU fuses a gather (or a chain of
# dynamic-update-slices) over the stacked pieces into per-element selects, 2-3x slower than
# selecting, with lax.switch, one of N static concatenations; but the N branches cost compile
# time (about a third of the compile time of a model's worth of small all-reduces). Large
# messages take the switch, small ones the gather.
SWITCH_MIN_ELEMENTS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Chain:
    direction: int  # +1: send to device d+1; -1: send to device d-1
    hops: int
    pieces: tuple[tuple[int, int], ...]  # [start, stop) minishard ranges, one ppermute each

    @property
    def minishards(self) -> tuple[int, ...]:
        return tuple(j for a, b in self.pieces for j in range(a, b))


def _pieces(start: int, stop: int, pipelined: bool) -> tuple[tuple[int, int], ...]:
    if start >= stop:
        return ()
    return tuple((j, j + 1) for j in range(start, stop)) if pipelined else ((start, stop),)


def full_loop_chains(n_devices: int, n_minishards: int, pipelined: bool = True
                     ) -> tuple[list[Chain], list[Chain]]:
    """(reduce-scatter chains, all-gather chains) of the full-loop ring, both directions.

    With two devices the two directions are the same pair of links (each device's next is
    also its previous), so a single chain already uses both, without a second message."""
    half = n_minishards if n_devices == 2 else (n_minishards + 1) // 2
    ranges = [(0, half), (half, n_minishards)]
    chains = [Chain(s, n_devices - 1, _pieces(a, b, pipelined))
              for s, (a, b) in zip((+1, -1), ranges) if b > a]
    return chains, chains


def semi_loop_chains(n_devices: int, n_minishards: int, pipelined: bool = True
                     ) -> tuple[list[Chain], list[Chain]]:
    """(reduce-scatter chains, all-gather chains) of the semi-loop (bidirectional chains)."""
    left = (n_devices - 1) // 2
    right = n_devices - 1 - left
    every = _pieces(0, n_minishards, pipelined)
    rs = [Chain(-1, right, every)] + ([Chain(+1, left, every)] if left else [])
    ag = [Chain(+1, right, every)] + ([Chain(-1, left, every)] if left else [])
    return rs, ag


def chains_for(variant: str, n_devices: int, n_minishards: int, pipelined: bool = True
               ) -> tuple[list[Chain], list[Chain]]:
    if variant == "full":
        return full_loop_chains(n_devices, n_minishards, pipelined)
    if variant == "semi":
        return semi_loop_chains(n_devices, n_minishards, pipelined)
    raise ValueError(f"unknown ring variant {variant!r}")


def ring_hops(variant: str, n_devices: int) -> tuple[int, int]:
    """(hops one after another in one phase, hops each value makes in one phase summed over the
    chains that carry it), read off the chains themselves so a cost model cannot drift from
    them: full-loop (n-1, n-1), each minishard on one of two chains; semi-loop (right, right +
    left), every minishard on both."""
    rs, _ = chains_for(variant, n_devices, 2, pipelined=False)
    per_value = sum(c.hops * len(c.minishards) for c in rs)
    return max(c.hops for c in rs), per_value // 2


def _ring_perm(n: int, direction: int) -> list[tuple[int, int]]:
    return [(i, (i + direction) % n) for i in range(n)]


def reduce_scatter_arrivals(buf: jax.Array, axis_name: str, chains: Sequence[Chain],
                            codec: Codec, layout) -> dict:
    """buf: this device's partial sums of every shard in `layout`'s buffer (any float dtype)
    -> {piece: the wire bytes that arrived for this device's own shard of it, one per chain
    that carries it, in chain order}. At each hop the arriving partial is decoded, the local
    piece added in float32, and the sum encoded afresh (`codecs.encode_sum`)."""
    n, m = layout.n_devices, layout.pieces
    d = lax.axis_index(axis_name)
    in_flight: dict[tuple[int, tuple[int, int]], jax.Array] = {}
    for t in range(max(c.hops for c in chains)):
        for ci, chain in enumerate(chains):
            if t >= chain.hops:
                continue
            owner = chain.direction * (chain.hops - t)
            perm = _ring_perm(n, chain.direction)
            for piece in chain.pieces:
                arrived = [in_flight[ci, piece]] if t > 0 else []
                wire = codecs.encode_sum(codec, buf, layout, (d + owner) % n, piece, arrived)
                in_flight[ci, piece] = lax.ppermute(wire, axis_name, perm)
    pieces = sorted({p for c in chains for p in c.pieces})
    if [j for a, b in pieces for j in range(a, b)] != list(range(m)):  # a schedule bug
        raise AssertionError(f"reduce-scatter pieces {pieces} do not tile {m} minishards")
    return {p: [in_flight[ci, p] for ci, c in enumerate(chains) if p in c.pieces]
            for p in pieces}


def ring_reduce_scatter(
    buf: jax.Array, axis_name: str, chains: Sequence[Chain], codec: Codec, layout
) -> jax.Array:
    """`reduce_scatter_arrivals` as values: f32[pieces, *piece], this device's fully reduced
    shard (the owner adds every chain's final partial to its own minishards)."""
    arrivals = reduce_scatter_arrivals(buf, axis_name, chains, codec, layout)
    return codecs.reduced(codec, buf, layout, lax.axis_index(axis_name), arrivals)


def forward_along_chains(own: dict, wire: dict, chains: Sequence[Chain], axis_name: str,
                         n: int) -> list[dict]:
    """The all-gather's transfers: each chain forwards the wire bytes of its pieces hop by hop,
    verbatim. Returns rows[r][p], the bytes of piece p of the device r steps along the ring (row
    0 is `own`, this device's own pieces as it keeps them)."""
    pieces = set(own)
    rows: list[dict] = [own] + [{} for _ in range(n - 1)]
    in_flight = {(ci, p): wire[p] for ci, c in enumerate(chains) for p in c.pieces}
    for t in range(max(c.hops for c in chains)):
        for ci, chain in enumerate(chains):
            if t >= chain.hops:
                continue
            perm = _ring_perm(n, chain.direction)
            source = (-chain.direction * (t + 1)) % n
            for p in chain.pieces:
                in_flight[ci, p] = lax.ppermute(in_flight[ci, p], axis_name, perm)
                rows[source][p] = in_flight[ci, p]
    if any(set(row) != pieces for row in rows):  # a schedule bug, not a user error
        raise AssertionError("all-gather chains leave pieces uncovered")
    return rows


def ring_all_gather(
    y: jax.Array, axis_name: str, chains: Sequence[Chain], codec: Codec, layout,
    out_dtype=jnp.float32,
) -> jax.Array:
    """y: f32[pieces, *piece], this device's reduced shard -> every shard, in `layout`'s buffer
    order and `out_dtype` (`all_gather_wires` of y's pieces encoded)."""
    pieces = sorted({p for c in chains for p in c.pieces})
    wire = {p: codec.encode(y[p[0]:p[1]]) for p in pieces}
    return all_gather_wires(wire, axis_name, chains, codec, layout, out_dtype)


def all_gather_wires(wire: dict, axis_name: str, chains: Sequence[Chain], codec: Codec, layout,
                     out_dtype=jnp.float32) -> jax.Array:
    """wire: {piece: this device's reduced shard's piece as `codec`'s wire bytes} -> every
    shard, in `layout`'s buffer order and `out_dtype`. Each owner encodes its shard once;
    receivers forward the wire bytes verbatim and decode them. The owner keeps decode(encode(y)),
    so every device holds identical values."""
    n = layout.n_devices
    pieces = sorted({p for c in chains for p in c.pieces})
    # got[r][p]: the wire bytes of piece p of relative row r (the shard of device d + r).
    # The barrier makes the owner decode the very bytes it sends: without it XLA folds
    # decode(encode(y)) algebraically and the owner's copy can differ by an ulp.
    got = forward_along_chains({p: lax.optimization_barrier(wire[p]) for p in pieces}, wire,
                               chains, axis_name, n)
    return assemble(got, pieces, axis_name, codec, layout, out_dtype)


def assemble(got: list[dict], pieces, axis_name: str, codec: Codec, layout, out_dtype):
    """got[r][p]: the wire bytes of piece p of relative shard r (device d + r's) -> the decoded
    buffer in absolute order. Pieces are decoded where the result is assembled (inside the
    switch branch for large messages), so each decoded value is written once. A codec that
    un-rotates as it decodes (`unrotate_to`) has its codes and scales put in place as bytes
    first and decoded in one pass over the whole buffer (its rotation is a reduction that runs
    best over a large array, outside the switch); on the CPU one native kernel decodes every
    piece straight into its place instead (codecs.GroupCodec.unrotate_gathered)."""
    rows = [[row[p] for p in pieces] for row in got]
    switch = layout.padded_elements >= SWITCH_MIN_ELEMENTS
    if getattr(codec, "unrotate_to", None) is None:
        return _place(rows, axis_name, layout, lambda w: codec.decode(w).astype(out_dtype),
                      switch)

    def shards(wires) -> list[list[jax.Array]]:
        return [list(wires[r * len(pieces):(r + 1) * len(pieces)]) for r in range(len(got))]

    def placed_then_unrotated(*wires):
        # Codes and scale bytes are placed one after the other, each split from the wire inside
        # the assembly (split outside it, XLA recomputes the owner's encode for each of the two).
        rows = shards(wires)
        widths = [part.shape[-1] for part in codec.wire_parts(rows[0][0])]
        placed = [_place(rows, axis_name, dataclasses.replace(layout, width=width),
                         lambda wire, i=i: codec.wire_parts(wire)[i], switch)
                  for i, width in enumerate(widths)]
        return codec.decode_parts(*placed)

    flat = [w for row in rows for w in row]
    if not codec.gathers_natively(layout):
        return placed_then_unrotated(*flat)

    def on_cpu(*wires):
        return codec.unrotate_gathered(lax.axis_index(axis_name), shards(wires), pieces, layout)
    return lax.platform_dependent(*flat, cpu=on_cpu, default=placed_then_unrotated)


def _place(rows: list[list[jax.Array]], axis_name: str, layout, decode, switch: bool):
    """rows[r]: relative shard r's pieces -> `decode`d into `layout`'s buffer, absolute order."""
    n = layout.n_devices
    d = lax.axis_index(axis_name)
    if switch:
        return lax.switch(d, [_assemble_for(dd, n, decode, layout) for dd in range(n)], rows)
    rel = jnp.stack([_decoded_row(row, decode) for row in rows])
    return layout.assemble(jnp.take(rel, (jnp.arange(n) - d) % n, axis=0))


def _assemble_for(d: int, n: int, decode, layout):
    """The absolute-order assembly on device d: a static concatenation of decoded pieces
    (the decode fuses into the copy)."""

    def assemble_d(rows: list[list[jax.Array]]) -> jax.Array:
        # Absolute shard c is relative row c - d.
        return layout.assemble(jnp.stack([_decoded_row(rows[(c - d) % n], decode)
                                          for c in range(n)]))

    return assemble_d


def _decoded_row(wires: list[jax.Array], decode) -> jax.Array:
    """One shard from its pieces' wire bytes, decoded in place of the copy that joins them."""
    return jnp.concatenate([decode(w) for w in wires])
