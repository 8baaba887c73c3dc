"""Multi-axis AllReduce: reduce-scatter along each mesh axis in turn, all-gather back in reverse,
the message cut into one part per axis so that every axis' links are busy at once.

Part p visits the axes in a rotated order (`axis_orders`), each stage a single-axis schedule. The
all-gather forwards encoded bytes verbatim, so replicas are bitwise identical; token-local exactly
when the single-axis layout is. See docs/native_kernel.md, "The multi-axis schedule"."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from equarx import codecs, ring, two_shot
from equarx.codecs import Codec


@dataclasses.dataclass(frozen=True)
class StackedLayout:
    """The view equarx.ring / equarx.two_shot need of a buffer [n, pieces, *piece]: shard s is
    row s (an absolute index along the axis), piece j its row j."""

    n_devices: int
    pieces: int

    def piece(self, buf: jax.Array, shard, j0: int, j1: int) -> jax.Array:
        start = (shard, j0) + (0,) * (buf.ndim - 2)
        return lax.dynamic_slice(buf, start, (1, j1 - j0) + buf.shape[2:])[0]


def axis_orders(k: int) -> list[tuple[int, ...]]:
    """Part p's axis order: the axes rotated to start at axis p (stage t of every part uses a
    different axis)."""
    return [tuple((p + t) % k for t in range(k)) for p in range(k)]


def reduce_scatter_stage(bufs: Sequence[jax.Array], axis_names: Sequence[str],
                         variants: Sequence[str], codec: Codec, pipelined: bool
                         ) -> list[jax.Array]:
    """One reduce-scatter stage of every part: bufs[i] [n, M, *piece] (part i's partials; row
    s is the block of index s along axis_names[i]) -> f32 [M, *piece] each, the block of this
    device's index reduced over that axis. The two-shot parts' sends are encoded as one
    (`codecs.encode_together`: one set of fused kernels for the stage instead of one per part
    and piece, the same bits) and still travel as one ppermute per piece; a ring's hops depend
    on each other and encode one by one."""
    out: list = [None] * len(bufs)
    layouts = [StackedLayout(buf.shape[0], buf.shape[1]) for buf in bufs]
    sends = []  # (part, piece, [n - 1, j1 - j0, *piece]: the piece of every shard sent)
    for i, (buf, axis, variant, layout) in enumerate(zip(bufs, axis_names, variants, layouts)):
        n, m = layout.n_devices, layout.pieces
        if variant != "twoshot":
            rs_chains, _ = ring.chains_for(variant, n, m, pipelined)
            out[i] = ring.ring_reduce_scatter(buf, axis, rs_chains, codec, layout)
            continue
        shards = two_shot.owners(axis, n)
        sends += [(i, p, jnp.stack([layout.piece(buf, s, *p) for s in shards]))
                  for p in two_shot.pieces_for(m, pipelined)]
    arrivals: dict = {}
    for (i, p, _), w in zip(sends, codecs.encode_together(codec, [x for _, _, x in sends])):
        arrivals.setdefault(i, {})[p] = two_shot.send(w, axis_names[i])
    for i, got in arrivals.items():
        out[i] = codecs.reduced(codec, bufs[i], layouts[i], lax.axis_index(axis_names[i]), got)
    return out


def gather_axis(payload: jax.Array, axis_name: str, n: int, variant: str,
                pipelined: bool) -> jax.Array:
    """payload [U, *wire] (wire bytes, forwarded verbatim) -> [n, U, *wire], row r the payload
    of the device r steps further along the axis (relative order)."""
    u = payload.shape[0]
    got: list[list[jax.Array] | None] = [None] * n
    if variant == "twoshot":
        for k in range(1, n):
            # What arrives from device d - k is the payload of relative row -k.
            got[(-k) % n] = [lax.ppermute(payload, axis_name, [(i, (i + k) % n)
                                                               for i in range(n)])]
        got[0] = [payload]
        return jnp.stack([jnp.concatenate(row) for row in got])
    _, ag_chains = ring.chains_for(variant, n, u, pipelined)
    pieces = sorted({p for c in ag_chains for p in c.pieces})
    wire = {p: payload[p[0]:p[1]] for p in pieces}
    rows = ring.forward_along_chains(dict(wire), wire, ag_chains, axis_name, n)
    return jnp.stack([jnp.concatenate([row[p] for p in pieces]) for row in rows])


def multi_axis_schedule(buf: jax.Array, axis_names: Sequence[str], variants: Sequence[str],
                        rs_codec: Codec, ag_codec: Codec, pipelined: bool,
                        out_dtype) -> jax.Array:
    """buf [k N, m, *piece] (k = len(axis_names) parts of N shards of m pieces) -> the same
    shape in `out_dtype`, summed over every axis, identical on every device.

    variants[a]: the single-axis schedule ("full", "semi", "twoshot") run along axis a."""
    k = len(axis_names)
    sizes = [lax.axis_size(a) for a in axis_names]
    n_all = math.prod(sizes)
    m, piece = buf.shape[1], buf.shape[2:]
    if buf.shape[0] != k * n_all:
        raise ValueError(f"buffer of {buf.shape[0]} shards for {k} parts of {n_all}")
    orders = axis_orders(k)
    # Part p: [n_{o_0}, ..., n_{o_{k-1}}, m, *piece] in its axis order o = orders[p]; stage t
    # works on [n_{o_t}, rest, *piece] with the earlier axes already reduced away.
    parts = [buf[p * n_all:(p + 1) * n_all] for p in range(k)]
    for t in range(k):
        axes = [orders[p][t] for p in range(k)]
        stage = [parts[p].reshape(sizes[a], -1, *piece) for p, a in enumerate(axes)]
        parts = reduce_scatter_stage(stage, [axis_names[a] for a in axes],
                                     [variants[a] for a in axes], rs_codec, pipelined)
    # Each owner encodes its m reduced pieces once (every part in one encode); the barrier
    # makes it decode the very bytes it sends (see equarx.ring.all_gather_wires).
    wires = [lax.optimization_barrier(w[0]) for w in
             codecs.encode_together(ag_codec, [y[None] for y in parts])]
    tail = wires[0].shape[1:]  # one piece's wire bytes
    for t in reversed(range(k)):
        for p in range(k):
            a = orders[p][t]
            w = wires[p]  # [n_{o_{t+1}}, ..., n_{o_{k-1}}, m, *tail]
            got = gather_axis(w.reshape(-1, *tail), axis_names[a], sizes[a], variants[a],
                              pipelined)
            wires[p] = got.reshape(sizes[a], *w.shape)
    gathered = []
    for p in range(k):
        w = wires[p]  # [n_{o_0}, ..., n_{o_{k-1}}, m, *wire], relative along every axis
        for t in range(k):
            # Relative row r along this axis is absolute (d + r) % n: roll by d.
            w = _roll(w, lax.axis_index(axis_names[orders[p][t]]), t)
        gathered.append(w.reshape(n_all * m, *tail))
    # Every part decoded at once: one set of fused kernels (each row decodes alone).
    return ag_codec.decode(jnp.concatenate(gathered)).astype(out_dtype).reshape(
        k * n_all, m, *piece)


def _roll(x: jax.Array, shift, axis: int) -> jax.Array:
    """x rolled by a traced `shift` along `axis` (out[i] = x[(i - shift) % n]): a dynamic slice
    of the axis doubled, one copy."""
    n = x.shape[axis]
    doubled = jnp.concatenate([x, x], axis=axis)
    return lax.dynamic_slice_in_dim(doubled, (n - shift) % n, n, axis)
