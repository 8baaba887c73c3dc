"""The strawman: a naive per-tensor int8 AllReduce, for comparison with EQuARX.

Each device quantizes its whole partial sum with ONE absmax scale, the int8 values and the scale
are all-gathered, and every device dequantizes the N partials and sums them in float32. One
outlier anywhere in the tensor sets the step size for every element, which is what block-wise
scales avoid. (The paper's strawman is a naive fp8 AllReduce; per-tensor int8 is the same idea
with this project's wire type.)

It has the signature of the model's reduction hook, so a model runs it at every
tensor-parallel reduction with `Gemma3Model(..., reduction=naive_all_reduce)`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

QMAX = 127.0


def naive_all_reduce(x: jax.Array, axis_name: str) -> jax.Array:
    """Per-tensor int8 AllReduce of this device's partial `x` over `axis_name` (inside shard_map).
    Returns x's shape and dtype; every device computes the same sum in the same order."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf))
    scale = amax / QMAX
    inv = jnp.where(amax > 0, QMAX / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.clip(jnp.round(xf * inv), -QMAX, QMAX).astype(jnp.int8)
    qs = lax.all_gather(q, axis_name)           # [N, ...]
    scales = lax.all_gather(scale, axis_name)   # [N]
    parts = qs.astype(jnp.float32) * scales.reshape((-1,) + (1,) * x.ndim)
    return jnp.sum(parts, axis=0).astype(x.dtype)
