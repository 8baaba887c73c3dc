"""A randomized Hadamard rotation of 128-element groups (H D: Walsh-Hadamard times fixed random
signs), which spreads an outlier's energy over its group so that block scales fit the bulk of the
data (QuaRot, THC).

Linear, so a device rotates its partial once before the reduce-scatter and un-rotates once after the
all-gather. H = H8 (x) H16 as two small matmuls at HIGHEST precision; unnormalized, so `unrotate`
divides by 128. See docs/algorithm.md, "The Hadamard rotation"."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 128
# Fixed signs, the same on every device and in every program (seeded, not a run-time RNG).
_SIGNS = np.where(np.random.default_rng(0x5EED).random(GROUP) < 0.5, -1.0, 1.0).astype(np.float32)


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


_H8, _H16 = _sylvester(8), _sylvester(16)  # H128 = H8 (x) H16 (Sylvester ordering)


def _hadamard(v: jax.Array) -> jax.Array:
    """H128 applied to each row of f32[g, 128] (H symmetric: row- and column-wise agree)."""
    hi = jax.lax.Precision.HIGHEST
    v = v.reshape(-1, 8, 16)
    v = jnp.einsum("ac,ncb->nab", jnp.asarray(_H8), v, precision=hi)
    v = jnp.einsum("ncd,bd->ncb", v, jnp.asarray(_H16), precision=hi)
    return v.reshape(-1, GROUP)


def rotate(flat: jax.Array) -> jax.Array:
    """f[n] (n a multiple of 128) -> float32 H D x per group of 128 (scaled by sqrt(128))."""
    v = flat.astype(jnp.float32).reshape(-1, GROUP) * _SIGNS
    return _hadamard(v).reshape(flat.shape)


def unrotate(flat: jax.Array) -> jax.Array:
    """Inverse of `rotate`: D H y / 128."""
    v = _hadamard(flat.astype(jnp.float32).reshape(-1, GROUP))
    return (v * (_SIGNS / GROUP)).reshape(flat.shape)
