"""The two-shot schedule (as in QuickReduce, FlashInfer, Flash Communication): each device encodes
its partial of every other shard once and sends it to the owner, which adds the N-1 arrivals in
float32 in a fixed order, then sends its encoded shard to every device.

Each value is quantized exactly twice whatever N. See docs/algorithm.md, "Version 2"."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from equarx import codecs
from equarx.codecs import Codec
from equarx.ring import _pieces, assemble


def _shift(n: int, k: int) -> list[tuple[int, int]]:
    return [(i, (i + k) % n) for i in range(n)]


def pieces_for(n_pieces: int, pipelined: bool) -> tuple[tuple[int, int], ...]:
    return _pieces(0, n_pieces, pipelined)


def reduce_scatter_arrivals(buf: jax.Array, axis_name: str, pieces, codec: Codec,
                            layout) -> dict:
    """buf: this device's partials in `layout`'s buffer -> {piece: the N-1 wire bytes that
    arrived for this device's own shard of it, from device d - k for k = 1..N-1 (a fixed
    order)}."""
    n = layout.n_devices
    shards = owners(axis_name, n)
    return {p: send(codecs.encode_shards(codec, buf, layout, shards, p), axis_name)
            for p in pieces}


def owners(axis_name: str, n: int) -> list:
    """The shards this device sends in the reduce-scatter, in order: device d + k's, k = 1..N-1."""
    d = lax.axis_index(axis_name)
    return [(d + k) % n for k in range(1, n)]


def send(wires: jax.Array, axis_name: str) -> list[jax.Array]:
    """wires [N-1, ...]: row k-1 for device d + k (`owners`' order) -> what arrived here, from
    device d - k for k = 1..N-1 (one ppermute each)."""
    n = wires.shape[0] + 1
    return [lax.ppermute(wires[k - 1], axis_name, _shift(n, k)) for k in range(1, n)]


def all_gather_wires(wire: dict, axis_name: str, pieces, codec: Codec, layout,
                     out_dtype=jnp.float32) -> jax.Array:
    """wire: {piece: this device's reduced shard's piece as `codec`'s wire bytes} -> every
    shard in `layout`'s buffer order, decoded to `out_dtype`. The owner sends the same bytes
    to every other device."""
    n = layout.n_devices
    # The barrier makes the owner decode the very bytes it sends (see ring.all_gather_wires).
    got: list[dict] = [{p: lax.optimization_barrier(wire[p]) for p in pieces}]
    got += [{} for _ in range(n - 1)]
    for k in range(1, n):
        for p in pieces:
            # What arrives from device d - k is the shard of relative row -k.
            got[(-k) % n][p] = lax.ppermute(wire[p], axis_name, _shift(n, k))
    return assemble(got, pieces, axis_name, codec, layout, out_dtype)
