"""The paged KV cache: two page pools (global layers, sliding-window layers), shared page ids.

A layer's pool is one array [num_pages, page_size, 2 * Kc, H], KV head i's keys at 2i and values at
2i + 1: the layout the Pallas TPU ragged paged attention kernel reads in place. All layers of a kind
share page ids, so a sequence has one block table per kind; page 0 is scratch (`SCRATCH`). See
docs/engine.md, "The paged engine"."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from models.gemma3.config import Gemma3Config
from models.gemma3.sharding import AXIS

Array = Any

SCRATCH = 0

# Logical axes of a layer's pool; only the combined heads are split (over tp).
PAGES_AXES = ("pages", "page_offset", "cache_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerPages:
    kv: Array  # [num_pages, page_size, 2 * Kc, H]: head i's keys at 2i, its values at 2i + 1

    @property
    def k(self) -> Array:
        """[num_pages, page_size, Kc, H] (a strided view: for inspection, not the hot path)."""
        return as_values(self.kv[:, :, 0::2])

    @property
    def v(self) -> Array:
        return as_values(self.kv[:, :, 1::2])

    @property
    def num_pages(self) -> int:
        return self.kv.shape[0]

    @property
    def page_size(self) -> int:
        return self.kv.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    """Every layer's pool, in layer order; `kinds[i]` ("global" or "local") says which pool
    layer i's pages belong to (static: part of the tree's structure)."""

    layers: tuple[LayerPages, ...]
    kinds: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))

    @property
    def page_size(self) -> int:
        return self.layers[0].page_size

    def num_pages(self, kind: str) -> int:
        """Pages of the `kind` pool ("global" or "local"), scratch page included; 0 when no
        layer is of that kind."""
        return next((p.num_pages for p, k in zip(self.layers, self.kinds) if k == kind), 0)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(self))


def pool_dtype(dtype, platform: str):
    """The dtype the pools are held in for activations of `dtype` on `platform`: the
    activation dtype, except bfloat16 on CPU, held as uint16 (its bits, `as_values`).

    XLA:CPU has no bfloat16 scatter: it converts a bfloat16 pool whole to float32 and back
    around every layer's store, and a float32 pool doubles the bytes every step gathers. uint16
    stores in place and gathers half the bytes; the bits are reinterpreted, never converted,
    so the numerics are a bfloat16 cache's."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and platform == "cpu":
        return jnp.dtype(jnp.uint16)
    return dtype


def as_values(x: jax.Array) -> jax.Array:
    """Pool contents as values: a uint16 pool's bits as the bfloat16 they are (`pool_dtype`)."""
    return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def as_stored(x: jax.Array, dtype) -> jax.Array:
    """Values as a pool of `dtype` holds them (rounded to bfloat16 for a uint16 pool)."""
    if jnp.dtype(dtype) == jnp.uint16:
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(dtype)


def layer_kinds(c: Gemma3Config) -> tuple[str, ...]:
    return tuple("global" if c.is_global(i) else "local" for i in range(c.num_layers))


def paged_shapes(c: Gemma3Config, num_global_pages: int, num_local_pages: int, page_size: int,
                 cache_heads: int, dtype) -> PagedKV:
    """Abstract pools (ShapeDtypeStruct leaves, global shapes); each needs its scratch page."""
    kinds = layer_kinds(c)
    for kind, n in (("global", num_global_pages), ("local", num_local_pages)):
        if kind in kinds and n < 2:
            raise ValueError(f"the {kind} pool needs at least 2 pages (page 0 is scratch), "
                             f"got {n}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    layers = tuple(LayerPages(kv=jax.ShapeDtypeStruct(
        (num_global_pages if kind == "global" else num_local_pages, page_size,
         2 * cache_heads, c.head_dim), dtype)) for kind in kinds)
    return PagedKV(layers=layers, kinds=kinds)


def paged_specs(c: Gemma3Config) -> PagedKV:
    """PartitionSpecs of the pools: the combined heads split over tp (whatever tp is: even
    replicated KV heads are cached one per device)."""
    spec = P(*(AXIS if a == "cache_heads" else None for a in PAGES_AXES))
    kinds = layer_kinds(c)
    return PagedKV(layers=tuple(LayerPages(kv=spec) for _ in kinds), kinds=kinds)


def store(pages: LayerPages, slots: jax.Array, k: jax.Array, v: jax.Array) -> LayerPages:
    """The pool with token t's key and value [T, Kl, H] at flat slot slots[t] = page *
    page_size + offset. A scatter into the pool viewed as [pages * page_size, 2 * Kl, H] (a
    reshape, no copy): in place when the pool is donated. Padding tokens all write the scratch
    page; which of them lands there does not matter (never read unmasked)."""
    n, size, heads, h = pages.kv.shape
    new = as_stored(jnp.stack([k, v], axis=2).reshape(k.shape[0], heads, h), pages.kv.dtype)
    flat = pages.kv.reshape(n * size, heads, h).at[slots].set(new, mode="promise_in_bounds")
    return LayerPages(kv=flat.reshape(n, size, heads, h))


def gather(pages: LayerPages, table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The pages of each row's block table table [S, Pn] as keys and values [S, Pn * page, Kl,
    H] (logical order: column j's page holds the row's j-th page of its table).

    Keys and values are each one gather of (position, head) pairs from the pool seen as
    [positions, 2 * Kl, H] (a free reshape): each comes out contiguous, in the layout the
    attention's dots read, and only the rows' own pages are read. Gathering pages whole and
    splitting them afterwards made XLA:CPU copy each half again; a strided view of the pool
    taken before the gather made it copy that view of the whole pool, every layer and step."""
    s, pn = table.shape
    n, size, heads, h = pages.kv.shape
    flat = pages.kv.reshape(n * size, heads, h)
    rows = (table[:, :, None] * size + jnp.arange(size, dtype=table.dtype)).reshape(s, pn * size)
    key_heads = jnp.arange(0, heads, 2, dtype=table.dtype)
    k = flat[rows[:, :, None], key_heads[None, None, :]]
    v = flat[rows[:, :, None], key_heads[None, None, :] + 1]
    return as_values(k), as_values(v)
