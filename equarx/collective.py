"""`all_reduce`: pick the path, run it, unpad.

"f32" / "bf16", messages under `min_bytes` and empty ones: XLA's psum. Ring methods: a layout
(equarx.layout), a schedule (equarx.ring or equarx.two_shot; "auto" asks equarx.schedule), each
phase's codecs (equarx.codecs), and the codec's rotation, applied once before the reduce-scatter
and undone once after the all-gather. impl="pallas": one Pallas TPU kernel (equarx.pallas_ring).
Several mesh axes: equarx.multi_axis (with impl="pallas", equarx.pallas_torus).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from equarx import codecs, groups, hadamard, multi_axis, ring, schedule, two_shot
from equarx.config import QUANTIZED, AllReduceConfig
from equarx.layout import Layout, TokenLayout, plan_layout, plan_token_layout

__all__ = ["Layout", "TokenLayout", "all_reduce", "folds_rotation", "multi_axis_plan", "plan_for",
           "plan_layout", "plan_token_layout", "resolved_variant"]


def resolved_variant(config: AllReduceConfig, n_devices: int, message_bytes: float) -> str:
    """The schedule a message takes ("full", "semi" or "twoshot")."""
    if config.variant != "auto":
        return config.variant
    return schedule.choose(n_devices, message_bytes,
                           schedule.resolve_topology(config.topology))


def plan_for(config: AllReduceConfig, shape: tuple[int, ...], n_devices: int,
             variant: str) -> Layout | TokenLayout:
    """The layout a message of `shape` takes with `config` on `n_devices`."""
    size = 1
    for v in shape:
        size *= v
    if config.method in QUANTIZED and config.blocks != "group":
        return plan_layout(size, n_devices, config.minishards)
    halves = 2 if variant == "full" and n_devices > 2 else 1
    granule = config.group_size if config.method in QUANTIZED else 1
    return plan_token_layout(tuple(shape), n_devices, config.minishards, halves, granule)


def all_reduce(x: jax.Array, axis_name: str | Sequence[str],
               config: AllReduceConfig | None = None, *, rotated: bool = False) -> jax.Array:
    """Sum `x` (this device's partial sum) over the mesh axis `axis_name`, inside shard_map.

    Returns an array of x's shape and dtype, identical on every device of the axis. Accepts any
    shape and floating dtype (bf16 and f32 are the intended ones); padding is internal. With an
    axis of size 1 it returns x unchanged (no communication). Rows are x's last axis: with a
    token-local config (`config.token_local`) row i of the result depends on row i of every
    device's x alone, bitwise.

    `axis_name` may be a tuple of mesh axes (a torus' axes, e.g. ("x", "y")): the sum is then
    over all of them, and a ring method runs the multi-axis schedule (equarx.multi_axis), which
    reduce-scatters along each axis in turn with the message split so that every axis' links
    carry a part at once; XLA's psums take the tuple as it is.

    rotated=True: x's rows already carry the group codec's rotation (`folds_rotation(config,
    x.shape[-1])` must hold): each run of `group_size` columns is the caller's partial times
    `codec_spec.rotation(group_size)`, because the weights that produced it were multiplied by it
    (`groups.fold_rotation`). The schedule then skips its forward rotation, and the result is
    the sum of the un-rotated partials as usual. Paths that do not rotate (psums, an axis of
    size 1) un-rotate x first.
    """
    config = config or AllReduceConfig()
    if not isinstance(config, AllReduceConfig):
        raise TypeError(f"config must be an AllReduceConfig, got {type(config).__name__}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"all_reduce needs a floating dtype, got {x.dtype}")
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not axes or not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"axis_name must be a mesh axis name or a tuple of distinct ones, "
                         f"got {axis_name!r}")
    if rotated and not folds_rotation(config, x.shape[-1] if x.ndim else 1):
        raise ValueError(f"rotated=True needs a config whose codec rotates groups that tile "
                         f"the rows (folds_rotation), got {config.label} on rows of "
                         f"{x.shape[-1] if x.ndim else 1}")
    axes = tuple(a for a in axes if lax.axis_size(a) > 1)
    schedule_rotates = (rotated and x.size * x.dtype.itemsize >= config.min_bytes
                        and x.size > 0 and bool(axes))
    if rotated and not schedule_rotates:
        x = groups.unrotate_rows(x.reshape(-1, x.shape[-1]), config.group_size,
                                 x.shape).astype(x.dtype)
        rotated = False
    if not axes:
        return x
    psum_axes = axes[0] if len(axes) == 1 else axes
    if config.method == "f32":
        return lax.psum(x.astype(jnp.float32), psum_axes).astype(x.dtype)
    if config.method == "bf16" or x.size * x.dtype.itemsize < config.min_bytes or x.size == 0:
        return lax.psum(x.astype(jnp.bfloat16), psum_axes).astype(x.dtype)
    if len(axes) > 1 and config.impl == "pallas":
        from equarx import pallas_torus

        return pallas_torus.all_reduce(x, axes, config, rotated=rotated)
    if len(axes) > 1:
        return _multi_axis_all_reduce(x, axes, config, rotated)
    if config.impl == "pallas":
        # Imported here: Pallas' TPU modules are only needed by those who ask for the kernel.
        from equarx import pallas_ring

        return pallas_ring.all_reduce(x, axes[0], config, rotated=rotated)
    return _scheduled_all_reduce(x, axes[0], lax.axis_size(axes[0]), config, rotated)


def folds_rotation(config: AllReduceConfig, row_width: int) -> bool:
    """Whether the rotation of `config`'s codec can be folded into the weights that produce
    rows of `row_width` values (`all_reduce(..., rotated=True)`): a quantized method with
    blocks="group" whose groups tile the row exactly (no padding column)."""
    return (config.method in QUANTIZED and config.blocks == "group"
            and row_width % config.group_size == 0)


def _rotation(config: AllReduceConfig) -> str | None:
    quantized = config.method in QUANTIZED
    return config.blocks if quantized and config.blocks in ("group", "hadamard") else None


def _split(x: jax.Array, layout, config: AllReduceConfig, rotated: bool = False) -> jax.Array:
    """The caller's message -> the layout's buffer, rotated where the codec wants it (already
    rotated if `rotated`)."""
    rotation = _rotation(config)
    if rotation == "group" and rotated:
        # Already rotated: the rows in the caller's dtype. The codecs and the float32 adds
        # widen a bfloat16 piece where they read it (codecs.encode_sum).
        x = x.reshape(-1, x.shape[-1])
    elif rotation == "group":
        # Rotate the caller's rows as they are (contiguous, runs of g from column 0; the shard
        # width is a multiple of g, so the runs are the codec's groups), not the strided buffer.
        x = groups.message_rows(x, config.group_size, rotated)
    buf = layout.split(x)
    if rotation == "hadamard":
        buf = hadamard.rotate(buf.reshape(-1)).reshape(buf.shape)
    return buf


def _gather_codec(config: AllReduceConfig, ag_codec, dtype) -> tuple[object, object, bool]:
    """(the all-gather's codec, the dtype its assembly writes, whether it un-rotates). The
    group codec un-rotates as it decodes, straight to the caller's dtype
    (groups.unrotate_codes); the flat layout's rotation leaves float32 for `_join`."""
    if isinstance(ag_codec, codecs.GroupCodec):
        return dataclasses.replace(ag_codec, unrotate_to=jnp.dtype(dtype)), dtype, True
    return ag_codec, (jnp.float32 if _rotation(config) else dtype), False


def _join(out: jax.Array, layout, config: AllReduceConfig, x: jax.Array,
          unrotated: bool = False) -> jax.Array:
    """The reduced buffer -> the caller's shape and dtype, un-rotated (unless the all-gather's
    decode did that: `unrotated`)."""
    rotation = _rotation(config)
    if rotation == "group" and not unrotated:
        return groups.unrotate_rows(layout.join_rows(out), config.group_size,
                                    x.shape).astype(x.dtype)
    if rotation == "hadamard":
        out = hadamard.unrotate(out.reshape(-1)).reshape(out.shape)
    return layout.join(out, x.shape).astype(x.dtype)


def _scheduled_all_reduce(x: jax.Array, axis_name: str, n: int,
                          config: AllReduceConfig, rotated: bool = False) -> jax.Array:
    variant = resolved_variant(config, n, x.size * x.dtype.itemsize)
    layout = plan_for(config, x.shape, n, variant)
    buf = _split(x, layout, config, rotated)
    rs_codec, ag_codec = codecs.for_phases(config, x.dtype, layout.piece_shape)
    ag_codec, out_dtype, unrotated = _gather_codec(config, ag_codec, x.dtype)
    if variant == "twoshot":
        pieces = two_shot.pieces_for(layout.pieces, config.pipelined)
        arrivals = two_shot.reduce_scatter_arrivals(buf, axis_name, pieces, rs_codec, layout)
    else:
        rs_chains, ag_chains = ring.chains_for(variant, n, layout.pieces, config.pipelined)
        arrivals = ring.reduce_scatter_arrivals(buf, axis_name, rs_chains, rs_codec, layout)
    # The sum that ends the reduce-scatter and the all-gather's encode of it are one step, so
    # the reduced shard is never written out as float32 (one native kernel on the CPU).
    d = lax.axis_index(axis_name)
    wire = {p: codecs.encode_sum(ag_codec, buf, layout, d, p, arrived, rs_codec)
            for p, arrived in arrivals.items()}
    if variant == "twoshot":
        out = two_shot.all_gather_wires(wire, axis_name, pieces, ag_codec, layout, out_dtype)
    else:
        out = ring.all_gather_wires(wire, axis_name, ag_chains, ag_codec, layout, out_dtype)
    return _join(out, layout, config, x, unrotated)


def multi_axis_plan(config: AllReduceConfig, shape: tuple[int, ...],
                    axis_sizes: Sequence[int]) -> tuple[Layout | TokenLayout, list[str]]:
    """(layout, per-axis variants) of the multi-axis schedule over axes of `axis_sizes`: the
    single-axis layout for (devices x axes) shards (one part per axis), and each axis' schedule
    as `resolved_variant` picks it for that axis and a part of the message."""
    k = len(axis_sizes)
    n_all = math.prod(axis_sizes)
    nbytes = math.prod(shape) * 2 / k  # a part, in bf16 bytes
    variants = [resolved_variant(config, n, nbytes) for n in axis_sizes]
    return plan_for(config, tuple(shape), n_all * k, "twoshot"), variants


def _multi_axis_all_reduce(x: jax.Array, axes: tuple[str, ...],
                           config: AllReduceConfig, rotated: bool = False) -> jax.Array:
    sizes = [lax.axis_size(a) for a in axes]
    layout, variants = multi_axis_plan(config, x.shape, sizes)
    buf = _split(x, layout, config, rotated)
    if isinstance(layout, Layout):
        stacked = buf  # [shards, m, K, 8, 128] already
    else:
        stacked = jnp.stack([layout.piece(buf, s, 0, layout.pieces)
                             for s in range(layout.n_devices)])
    rs_codec, ag_codec = codecs.for_phases(config, x.dtype, layout.piece_shape)
    ag_codec, out_dtype, unrotated = _gather_codec(config, ag_codec, x.dtype)
    out = multi_axis.multi_axis_schedule(stacked, axes, variants, rs_codec, ag_codec,
                                         config.pipelined, out_dtype)
    return _join(layout.assemble(out), layout, config, x, unrotated)
