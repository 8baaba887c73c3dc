"""A randomized Hadamard rotation of 128-element groups: spreads outliers before quantizing.

Transformer activations carry a few channels (and a few tokens, e.g. the attention-sink BOS)
that are orders of magnitude larger than the rest. A block whose absmax is set by one outlier
quantizes every other element of the block to a handful of levels. Rotating each group of 128
consecutive elements by H D (H the 128x128 Walsh-Hadamard matrix, D a fixed diagonal of random
signs) spreads an outlier's energy over its group, so block scales fit the bulk of the data
(QuaRot, THC). The rotation is linear, so the sum of rotated partials is the rotated sum: each
device rotates its partial once before the reduce-scatter and un-rotates once after the
all-gather; every hop in between moves rotated values.

The transform is 7 butterfly stages of additions (no matmul), exact up to float32 rounding and
computed identically on every device, so replicas stay bitwise identical. The forward pass is
unnormalized (H H = 128 I); `unrotate` divides by 128, a power of two. A NaN or Inf spreads to
its whole group of 128, which stays non-finite.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 128
_STAGES = 7  # 2**7 == GROUP
# Fixed signs, the same on every device and in every program (seeded, not a run-time RNG).
_SIGNS = np.where(np.random.default_rng(0x5EED).random(GROUP) < 0.5, -1.0, 1.0).astype(np.float32)


def _walsh_hadamard(v: jax.Array) -> jax.Array:
    """Unnormalized fast Walsh-Hadamard transform of the last axis (length 128)."""
    lead = v.shape[:-1]
    for stage in range(_STAGES):
        half = 1 << stage
        pairs = v.reshape(*lead, GROUP // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, GROUP)
    return v


def rotate(flat: jax.Array) -> jax.Array:
    """f[n] (n a multiple of 128) -> float32 H D x per group of 128 (scaled by sqrt(128))."""
    v = flat.astype(jnp.float32).reshape(-1, GROUP) * _SIGNS
    return _walsh_hadamard(v).reshape(flat.shape)


def unrotate(flat: jax.Array) -> jax.Array:
    """Inverse of `rotate`: D H y / 128."""
    v = _walsh_hadamard(flat.astype(jnp.float32).reshape(-1, GROUP))
    return (v * (_SIGNS / GROUP)).reshape(flat.shape)
