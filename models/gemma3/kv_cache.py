"""The KV cache: full-length rows for global layers, sliding-window ring buffers for local ones.

One LayerCache per layer: keys [slots, Kc, H, len] and values [slots, Kc, len, H] (the layouts
attention's batched matmuls read in place), len = max_seq_len for global layers and
W = sliding_window for local ones. A local layer only ever attends to the last W positions, so
position p lives at ring index p % W; 5 of every 6 layers (in the published sizes) thus cost W
instead of max_seq_len positions. Kc is the number of cached KV heads over all devices:
num_kv_heads, or tp when KV heads are replicated (each device then caches the one head its
query heads use).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.gemma3.config import Gemma3Config

Array = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    k: Array  # [slots, Kc, H, len], keys after QK-norm and RoPE
    v: Array  # [slots, Kc, len, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    layers: tuple[LayerCache, ...]

    @property
    def num_slots(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def max_seq_len(self) -> int:
        """Positions per slot: the global layers' length (the window if there are none), which
        `cache_shapes` rebuilds this cache from. Not the longest layer: a cache shorter than the
        sliding window has local layers longer than its global ones. Read without the config's
        layer pattern: layer 0 is local unless every layer is global, so a length other than
        layer 0's is a global layer's."""
        first = self.layers[0].v.shape[2]
        return next((n for n in (layer.v.shape[2] for layer in self.layers) if n != first), first)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(self))


def cache_shapes(c: Gemma3Config, num_slots: int, max_seq_len: int, cache_heads: int,
                 dtype) -> KVCache:
    """Abstract cache (ShapeDtypeStruct leaves, global shapes)."""
    if num_slots < 1 or max_seq_len < 1:
        raise ValueError(f"num_slots and max_seq_len must be >= 1, got {num_slots}, {max_seq_len}")
    layers = []
    for i in range(c.num_layers):
        length = max_seq_len if c.is_global(i) else c.sliding_window
        layers.append(LayerCache(
            k=jax.ShapeDtypeStruct((num_slots, cache_heads, c.head_dim, length), dtype),
            v=jax.ShapeDtypeStruct((num_slots, cache_heads, length, c.head_dim), dtype)))
    return KVCache(layers=tuple(layers))


def bytes_per_sequence(c: Gemma3Config, seq_len: int, dtype=jnp.bfloat16, *,
                       ring: bool = True) -> int:
    """KV cache bytes one sequence of `seq_len` tokens needs (no replication counted).

    ring=False is the cost of a cache whose local layers keep every position too.
    """
    per_position = 2 * c.num_kv_heads * c.head_dim * np.dtype(dtype).itemsize
    local_len = min(c.sliding_window, seq_len) if ring else seq_len
    return per_position * (c.num_global_layers * seq_len + c.num_local_layers * local_len)
