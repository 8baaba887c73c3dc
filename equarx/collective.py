"""`all_reduce`: flatten, pad, dispatch to XLA's psum or to the ring schedules, unpad.

Layout of a message of n elements on an axis of N devices (N >= 2):
  padded to N shards x m minishards x K tiles x (8 x 128), zeros in the padding.
The requested `minishards` is an upper bound. A minishard is never cut below
MIN_TILES_PER_MINISHARD tiles (128 x 1024 elements), because each minishard carries one
float32 8x128 scale tile (4 KiB): at 128 tiles the scales add at most 1/32 to the int8 payload,
i.e. int8 moves <= 0.516x the bytes of bf16. Shards smaller than that get a single minishard
and pay a larger relative scale overhead (e.g. 40 tiles per shard: 0.55x); `min_bytes` exists
to send such messages through the plain bf16 psum instead.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from equarx import hadamard
from equarx import quantize as qz
from equarx import ring
from equarx.config import AllReduceConfig

MIN_TILES_PER_MINISHARD = 128


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a message is cut: `n_devices` shards x `minishards` x `tiles` tiles of 8x128."""

    n_elements: int
    n_devices: int
    minishards: int
    tiles: int  # K: tiles per minishard; a scale covers K elements

    @property
    def padded_elements(self) -> int:
        return self.n_devices * self.minishards * self.tiles * qz.TILE_ELEMENTS

    @property
    def elements_per_scale(self) -> int:
        return self.tiles


def plan_layout(n_elements: int, n_devices: int, minishards: int) -> Layout:
    """The layout `all_reduce` uses for a message of `n_elements` (see the module docstring)."""
    if n_elements < 1 or n_devices < 1 or minishards < 1:
        raise ValueError(f"bad layout request: {n_elements=} {n_devices=} {minishards=}")
    tiles_per_shard = math.ceil(n_elements / (n_devices * qz.TILE_ELEMENTS))
    m = max(1, min(minishards, tiles_per_shard // MIN_TILES_PER_MINISHARD))
    return Layout(n_elements, n_devices, m, math.ceil(tiles_per_shard / m))


def _codecs(config: AllReduceConfig, dtype) -> tuple[ring.Codec, ring.Codec]:
    """(reduce-scatter codec, all-gather codec). An unquantized int8 phase moves the caller's
    own precision (bf16 -> bf16, f32 -> f32), so it adds no error beyond the input's."""
    if config.method == "bf16_ring":
        bf16 = ring.FloatCodec(jnp.bfloat16)
        return bf16, bf16
    plain = ring.FloatCodec(jnp.dtype(dtype))
    int8 = ring.Int8RowCodec() if config.blocks == "hadamard" else ring.Int8Codec()
    rs = int8 if config.phases in ("both", "rs") else plain
    ag = int8 if config.phases in ("both", "ag") else plain
    return rs, ag


def all_reduce(x: jax.Array, axis_name: str, config: AllReduceConfig | None = None) -> jax.Array:
    """Sum `x` (this device's partial sum) over the mesh axis `axis_name`, inside shard_map.

    Returns an array of x's shape and dtype, identical on every device of the axis. Accepts any
    shape and floating dtype (bf16 and f32 are the intended ones); padding is internal. With an
    axis of size 1 it returns x unchanged (no communication).
    """
    config = config or AllReduceConfig()
    if not isinstance(config, AllReduceConfig):
        raise TypeError(f"config must be an AllReduceConfig, got {type(config).__name__}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"all_reduce needs a floating dtype, got {x.dtype}")
    n_devices = lax.axis_size(axis_name)
    if n_devices == 1:
        return x
    if config.method == "f32":
        return lax.psum(x.astype(jnp.float32), axis_name).astype(x.dtype)
    if config.method == "bf16" or x.size * x.dtype.itemsize < config.min_bytes or x.size == 0:
        return lax.psum(x.astype(jnp.bfloat16), axis_name).astype(x.dtype)
    return _ring_all_reduce(x, axis_name, n_devices, config)


def _ring_all_reduce(x: jax.Array, axis_name: str, n: int, config: AllReduceConfig) -> jax.Array:
    layout = plan_layout(x.size, n, config.minishards)
    flat = jnp.pad(x.reshape(-1), (0, layout.padded_elements - x.size))
    rotate = config.method == "int8" and config.blocks == "hadamard"
    if rotate:
        flat = hadamard.rotate(flat)
    buf = flat.reshape(n, layout.minishards, layout.tiles, *qz.TILE)
    rs_chains, ag_chains = ring.chains_for(config.variant, n, layout.minishards,
                                           config.pipelined)
    rs_codec, ag_codec = _codecs(config, x.dtype)
    y = ring.ring_reduce_scatter(buf, axis_name, rs_chains, rs_codec)
    out = ring.ring_all_gather(y, axis_name, n, ag_chains, ag_codec,
                               out_dtype=jnp.float32 if rotate else x.dtype)
    out = out.reshape(-1)
    if rotate:
        out = hadamard.unrotate(out)
    return out[: x.size].reshape(x.shape).astype(x.dtype)
