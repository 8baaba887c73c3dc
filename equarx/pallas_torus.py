"""The multi-axis AllReduce (equarx.multi_axis' schedule) through Pallas TPU kernels: `all_reduce(x,
("x", "y"), AllReduceConfig(impl="pallas"))` on a torus' axes.

The buffer is cut into k parts that visit the axes in rotated orders, so one kernel per stage drives
every axis' links. `reference_all_reduce` runs the same stages through ppermutes, bitwise the same.
See docs/native_kernel.md, "Through the kernels"."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from equarx import groups, multi_axis, pallas_ring, ring
from equarx.config import AllReduceConfig
from equarx.layout import MIN_PIECE_ELEMENTS
from equarx.pallas_codecs import (MAX_PIECE_ELEMENTS, WINDOW, GroupCodec, KernelCodec,
                                  KernelPlan, TileCodec)
from equarx.pallas_ring import (COLLECTIVE_ID, check_untyped, interpret_default,
                                meet_neighbours, parts_kernel_call, reference_codec,
                                vmem_per_part)


def plan_for(config: AllReduceConfig, shape: tuple[int, ...], axis_sizes,
             min_piece: int = MIN_PIECE_ELEMENTS) -> KernelPlan:
    """The kernel plan of the multi-axis schedule: the single-axis plan for k N shards (N the
    product of the k axis sizes), its minishards capped so that the k parts of a
    reduce-scatter kernel fit the VMEM of one. `min_piece` as in equarx.pallas_codecs.plan."""
    sizes = tuple(int(v) for v in axis_sizes)
    if len(sizes) < 2 or min(sizes) < 2:
        raise ValueError(f"the kernel's multi-axis schedule needs two or more axes of two or "
                         f"more devices, got {sizes}")
    k = len(sizes)
    return pallas_ring.plan_for(config, shape, k * math.prod(sizes), min_piece,
                                MAX_PIECE_ELEMENTS // k)


def vmem_bytes(p: KernelPlan, axis_sizes, in_dtype) -> int:
    """The VMEM scratch of the largest reduce-scatter kernel (its k parts; the gathers use
    none): bounded by the window and the piece cap, whatever the message."""
    k, n_all = len(axis_sizes), math.prod(axis_sizes)
    # Stage 0 has the most minishards: part q's blocks along its first axis, N / n_q shards each.
    window = min(WINDOW, n_all // min(axis_sizes) * p.minishards)
    # Stage 0 reads the caller's dtype, later stages float32 partials (as wide or wider).
    wider = in_dtype if jnp.dtype(in_dtype).itemsize > 4 else jnp.float32
    return k * vmem_per_part(p.codec, p.piece, window, wider, jnp.float32)


def gather_kernel_call(wires: list[list[jax.Array]], axis_names: tuple[str, ...],
                       interpret=None) -> list[list[jax.Array]]:
    """The all-gather of wire bytes along one axis per part, verbatim, in one kernel.

    wires[p]: the arrays of this device's block of part p ([2, U_p, ...]: the payload, and the
    scales if the codec has them; half 0 travels to the right neighbour, half 1 to the left)
    -> the same arrays gathered, [N_p, 2, U_p, ...] (N_p the size of part p's axis
    `axis_names[p]`), row c the block of the device at index c along that axis (the other
    coordinates this device's). Remote DMAs from HBM to HBM: every block lands in its own
    place, so no slot is reused and nothing needs flow control beyond waiting for a block
    before forwarding it. Parts on shorter axes finish earlier."""
    n_parts = len(wires)
    if len(axis_names) != n_parts or len(set(axis_names)) != n_parts:
        raise ValueError(f"need {n_parts} distinct axes, one per part, got {axis_names}")
    sizes = [lax.axis_size(a) for a in axis_names]
    kinds = len(wires[0])
    flat_in = [w for part in wires for w in part]  # part-major, then kind

    def kernel(*refs):
        ins = [refs[p * kinds:(p + 1) * kinds] for p in range(n_parts)]
        outs = [refs[(n_parts + p) * kinds:(n_parts + p + 1) * kinds] for p in range(n_parts)]
        local_sem, send_sem, recv_sem = refs[2 * n_parts * kinds:]
        index, mesh_id, neighbours = meet_neighbours(axis_names)

        def owner(p, h, t):  # whose block arrives at step t in direction h (t = 0: own)
            n = sizes[p]
            return lax.rem(index[p] - (1 - 2 * h) * t + n * n, n)

        def transfer(p, h, t, kind):
            """The block of owner(p, h, t), sent at step t to the next device in direction h
            (it arrives there as step t + 1, on that step's semaphore)."""
            left, right = neighbours(p)
            src = ins[p][kind].at[h] if t == 0 else outs[p][kind].at[owner(p, h, t), h]
            return pltpu.make_async_remote_copy(
                src, outs[p][kind].at[owner(p, h, t), h], send_sem.at[p, h, kind],
                recv_sem.at[p, h, t + 1, kind], device_id=mesh_id(p, right if h == 0 else left),
                device_id_type=pl.DeviceIdType.MESH)

        def arrival(p, h, t, kind):  # the descriptor this device waits on for step t's block
            left, right = neighbours(p)
            dst = outs[p][kind].at[owner(p, h, t), h]
            return pltpu.make_async_remote_copy(
                dst, dst, send_sem.at[p, h, kind], recv_sem.at[p, h, t, kind],
                device_id=mesh_id(p, left if h == 0 else right),
                device_id_type=pl.DeviceIdType.MESH)

        streams = [(p, h, kind) for p in range(n_parts) for h in range(2) for kind in range(kinds)]
        own = [pltpu.make_async_copy(ins[p][kind].at[h], outs[p][kind].at[index[p], h],
                                     local_sem.at[p, h, kind]) for p, h, kind in streams]
        for c in own:
            c.start()
        for p, h, kind in streams:
            transfer(p, h, 0, kind).start()
        for t in range(1, max(sizes)):
            for p, h, kind in streams:
                if t >= sizes[p]:
                    continue  # part p's ring is done
                arrival(p, h, t, kind).wait_recv()
                transfer(p, h, t - 1, kind).wait_send()  # one send in flight per stream
                if t <= sizes[p] - 2:
                    transfer(p, h, t, kind).start()
        for c in own:
            c.wait()

    out_shapes = [jax.ShapeDtypeStruct((sizes[p], *w.shape), w.dtype)
                  for p in range(n_parts) for w in wires[p]]
    call = pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(flat_in),
        out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(flat_in),
        scratch_shapes=[pltpu.SemaphoreType.DMA((n_parts, 2, kinds)),
                        pltpu.SemaphoreType.DMA((n_parts, 2, kinds)),
                        pltpu.SemaphoreType.DMA((n_parts, 2, max(sizes), kinds))],
        compiler_params=pltpu.CompilerParams(collective_id=COLLECTIVE_ID),
        interpret=interpret if interpret is not None else False,
    )
    out = list(call(*flat_in))
    return [out[p * kinds:(p + 1) * kinds] for p in range(n_parts)]


def all_reduce(x: jax.Array, axis_names: tuple[str, ...], config: AllReduceConfig,
               interpret="auto", min_piece: int = MIN_PIECE_ELEMENTS,
               rotated: bool = False) -> jax.Array:
    """equarx.all_reduce's multi-axis path through the kernels (inside shard_map over the
    axes). `interpret`, `min_piece` and `rotated` as in equarx.pallas_ring.all_reduce."""
    check_untyped(x)
    if interpret == "auto":
        interpret = interpret_default()

    def rs_stage(bufs, axes, codec):
        return parts_kernel_call(bufs, axes, codec, jnp.float32, interpret, phase="rs")

    def gather_stage(wires, axes):
        return gather_kernel_call(wires, axes, interpret)

    return _stages(x, tuple(axis_names), config, rs_stage, gather_stage, min_piece, rotated)


def reference_all_reduce(x: jax.Array, axis_names: tuple[str, ...], config: AllReduceConfig,
                         min_piece: int = MIN_PIECE_ELEMENTS) -> jax.Array:
    """The same stages through equarx.ring (ppermutes, equarx.codecs' codecs) and
    lax.all_gather: bitwise what `all_reduce` computes."""

    def rs_stage(bufs, axes, codec):
        ref, to_ref, from_ref = _reference_codec(codec)
        out = []
        for buf, axis in zip(bufs, axes):
            n, _, mh = buf.shape[:3]
            stacked = to_ref(buf.reshape(n, 2 * mh, *buf.shape[3:]))
            chains = [ring.Chain(+1, n - 1, tuple((j, j + 1) for j in range(mh))),
                      ring.Chain(-1, n - 1, tuple((j, j + 1) for j in range(mh, 2 * mh)))]
            y = ring.ring_reduce_scatter(stacked, axis, chains, ref,
                                         multi_axis.StackedLayout(n, 2 * mh))
            out.append(from_ref(y).reshape(2, mh, *buf.shape[3:]))
        return out

    def gather_stage(wires, axes):
        return [[lax.all_gather(w, axis) for w in part] for part, axis in zip(wires, axes)]

    return _stages(x, tuple(axis_names), config, rs_stage, gather_stage, min_piece)


def _reference_codec(codec: KernelCodec):
    """(equarx.codecs codec, kernel pieces [.., R, L] -> the layout's pieces, and back)."""
    if isinstance(codec, TileCodec):  # [8 K, 128] <-> [K, 8, 128]: the flat layout's tiles
        def to_ref(v):
            return v.reshape(*v.shape[:-2], codec.rows // 8, 8, v.shape[-1])

        def from_ref(v):
            return v.reshape(*v.shape[:-3], codec.rows, v.shape[-1])

        return reference_codec(codec), to_ref, from_ref

    def swap(v):  # [W, Tm] <-> [Tm, W]: the token layout's rows of a piece
        return jnp.swapaxes(v, -1, -2)

    return reference_codec(codec), swap, swap


def _stages(x, axes, config, rs_stage, gather_stage, min_piece, rotated=False):
    """Around the stages: the plan, the rotation, the parts, the encode and the decode."""
    sizes = [lax.axis_size(a) for a in axes]
    p = plan_for(config, x.shape, sizes, min_piece)
    codec = p.codec
    k, n_all = len(axes), math.prod(sizes)
    r, l = p.piece
    m = 2 * p.minishards  # pieces of a block (one device's share of a part)
    grouped = isinstance(codec, GroupCodec)
    x_in = groups.message_rows(x, config.group_size, rotated) if grouped else x
    # [k N, 2, mh, R, L] -> part q: its N blocks, in q's axis order (the first axis major).
    parts = list(p.to_kernel(p.layout.split(x_in)).reshape(k, n_all * m, r, l))
    orders = multi_axis.axis_orders(k)
    for t in range(k):
        stage_axes = tuple(axes[orders[q][t]] for q in range(k))
        bufs = [parts[q].reshape(sizes[orders[q][t]], 2, -1, r, l) for q in range(k)]
        parts = [y.reshape(-1, r, l) for y in rs_stage(bufs, stage_axes, codec)]
    # Each owner encodes its blocks once; the barrier keeps XLA from folding its own
    # decode(encode(y)) (every device must decode the same bytes).
    encoded = [jax.vmap(codec.encode)(y) for y in parts]  # over pieces
    wires = lax.optimization_barrier([[w for w in e if w is not None] for e in encoded])
    for t in reversed(range(k)):
        stage_axes = tuple(axes[orders[q][t]] for q in range(k))
        wires = gather_stage([[w.reshape(2, -1, *w.shape[1:]) for w in part] for part in wires],
                             stage_axes)
        wires = [[w.reshape(-1, *w.shape[3:]) for w in part] for part in wires]
    out_dtype = jnp.float32 if grouped else x.dtype
    decode = jax.vmap(lambda *w: codec.decode(w[0], w[1] if len(w) > 1 else None))
    out = jnp.stack([decode(*part).astype(out_dtype) for part in wires])  # [k, N m, R, L]
    out = p.from_kernel(out.reshape(k * n_all, 2, p.minishards, r, l))
    if grouped:
        return groups.unrotate_rows(p.layout.join_rows(out), config.group_size,
                                    x.shape).astype(x.dtype)
    return p.layout.join(out, x.shape).astype(x.dtype)


__all__ = ["all_reduce", "gather_kernel_call", "plan_for", "reference_all_reduce", "vmem_bytes"]
