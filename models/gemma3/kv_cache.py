"""The KV cache: full-length rows for global layers, sliding-window ring buffers for local ones.

Stacked like the weights (see weights.py): local [G, 5, slots, W, Kc, H], global_
[G, slots, max_seq_len, Kc, H], tail [R, slots, W, Kc, H], for keys and values alike.
A local layer only ever attends to the last W = sliding_window positions, so position p lives at
ring index p % W; 5 of every 6 layers thus cost W instead of max_seq_len positions.
Kc is the number of cached KV heads over all devices: num_kv_heads, or tp when KV heads are
replicated (each device then caches the one head its query heads use).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.gemma3.config import Gemma3Config
from models.gemma3.weights import part_prefixes

Array = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    k: Array  # [*L, slots, len, Kc, H], keys after QK-norm and RoPE
    v: Array  # [*L, slots, len, Kc, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    local: LayerCache | None
    global_: LayerCache | None
    tail: LayerCache | None

    @property
    def num_slots(self) -> int:
        return next(iter(jax.tree.leaves(self))).shape[-4]

    @property
    def max_seq_len(self) -> int:
        """Positions a slot can hold (the global layers' length)."""
        if self.global_ is None:  # fewer than 6 layers: only ring buffers
            return 2 ** 31 - 1
        return self.global_.k.shape[-3]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(self))


def cache_part_prefixes(c: Gemma3Config) -> dict[str, tuple[int, ...] | None]:
    return part_prefixes(c)


def cache_shapes(c: Gemma3Config, num_slots: int, max_seq_len: int, cache_heads: int,
                 dtype) -> KVCache:
    """Abstract cache (ShapeDtypeStruct leaves, global shapes)."""
    if num_slots < 1 or max_seq_len < 1:
        raise ValueError(f"num_slots and max_seq_len must be >= 1, got {num_slots}, {max_seq_len}")
    parts = {}
    for part, prefix in cache_part_prefixes(c).items():
        length = max_seq_len if part == "global_" else c.sliding_window
        shape = (num_slots, length, cache_heads, c.head_dim)
        parts[part] = None if prefix is None else LayerCache(
            k=jax.ShapeDtypeStruct(prefix + shape, dtype), v=jax.ShapeDtypeStruct(prefix + shape, dtype))
    return KVCache(**parts)


def bytes_per_sequence(c: Gemma3Config, seq_len: int, dtype=jnp.bfloat16, *,
                       ring: bool = True) -> int:
    """KV cache bytes one sequence of `seq_len` tokens needs (no replication counted).

    ring=False is the cost of a cache whose local layers keep every position too.
    """
    per_position = 2 * c.num_kv_heads * c.head_dim * np.dtype(dtype).itemsize
    local_len = min(c.sliding_window, seq_len) if ring else seq_len
    return per_position * (c.num_global_layers * seq_len + c.num_local_layers * local_len)
