"""The paged KV cache: two page pools (global layers, sliding-window layers), shared page ids.

A layer's pool is [num_pages, page_size, 2 * Kc, H] (head i's keys at 2i, values at 2i + 1: the
layout the Pallas TPU kernel reads); page 0 is scratch (`SCRATCH`). `--kv-cache-dtype int8|fp8`:
codes of the EQuARX group codec and a second array of their scales, a scale per run of
`KV_GROUP` values of one token's row, so a token's codes depend on that token alone. See
docs/engine.md, "The paged engine", and docs/deployment.md, "KV cache dtype"."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from equarx import codec_spec
from models.gemma3.config import Gemma3Config
from models.gemma3.sharding import AXIS

Array = Any

SCRATCH = 0

# Logical axes of a layer's pool; only the combined heads are split (over tp).
PAGES_AXES = ("pages", "page_offset", "cache_heads", "head_dim")

# vLLM's --kv-cache-dtype values: "auto" holds the activations' dtype (`pool_dtype`); the others
# hold codec codes: int8 as int8, fp8 as the bits of float8_e4m3fn codes in uint8 (a scatter of
# plain bytes on every backend; the bitcast back is free).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
CODE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.uint8)}
KV_GROUP = 32  # values of one row under one scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerPages:
    kv: Array  # [num_pages, page_size, 2 * Kc, H]: head i's keys at 2i, its values at 2i + 1
    # int8 / fp8 pools: [num_pages, page_size, 2 * Kc, H / kv_group(H)] the runs' scales
    # (bfloat16 values, held as `pool_dtype` holds bfloat16); None for "auto".
    scale: Array | None = None

    @property
    def k(self) -> Array:
        """[num_pages, page_size, Kc, H] (a strided view: for inspection, not the hot path;
        quantized pools dequantized to float32, exactly)."""
        return self._values(0)

    @property
    def v(self) -> Array:
        return self._values(1)

    def _values(self, half: int) -> Array:
        if self.scale is None:
            return as_values(self.kv[:, :, half::2])
        x = dequantize(self.kv[:, :, half::2], self.scale[:, :, half::2], jnp.float32)
        return rotate_runs(x, inverse=True) if rotates(self.kv_cache_dtype) else x

    @property
    def kv_cache_dtype(self) -> str:
        """"auto", "int8" or "fp8" (`KV_CACHE_DTYPES`), from the arrays' dtypes."""
        if self.scale is None:
            return "auto"
        return "int8" if jnp.dtype(self.kv.dtype) == CODE_DTYPES["int8"] else "fp8"

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
    def kv_cache_dtype(self) -> str:
        return self.layers[0].kv_cache_dtype

    @property
    def nbytes(self) -> int:
        """Bytes of every pool (codes and scales), arrays or ShapeDtypeStructs alike."""
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


def checked_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """`kv_cache_dtype` if it is one of KV_CACHE_DTYPES, else ValueError."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    return kv_cache_dtype


def kv_group(head_dim: int) -> int:
    """Values under one scale: KV_GROUP, or fewer for a head_dim it does not divide (tiny test
    models; every Gemma 3 size has head_dim 128 or 256)."""
    return math.gcd(head_dim, KV_GROUP)


def paged_shapes(c: Gemma3Config, num_global_pages: int, num_local_pages: int, page_size: int,
                 cache_heads: int, dtype, kv_cache_dtype: str = "auto",
                 platform: str = "cpu") -> PagedKV:
    """Abstract pools (ShapeDtypeStruct leaves, global shapes); each needs its scratch page.
    `dtype`: an "auto" pool's (`pool_dtype`); quantized pools hold codes and scales, the scales
    as bfloat16 is held on `platform`."""
    kinds = layer_kinds(c)
    for kind, n in (("global", num_global_pages), ("local", num_local_pages)):
        if kind in kinds and n < 2:
            raise ValueError(f"the {kind} pool needs at least 2 pages (page 0 is scratch), "
                             f"got {n}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    checked_kv_cache_dtype(kv_cache_dtype)

    def pool(kind):
        rows = (num_global_pages if kind == "global" else num_local_pages, page_size,
                2 * cache_heads)
        if kv_cache_dtype == "auto":
            return LayerPages(kv=jax.ShapeDtypeStruct((*rows, c.head_dim), dtype))
        return LayerPages(
            kv=jax.ShapeDtypeStruct((*rows, c.head_dim), CODE_DTYPES[kv_cache_dtype]),
            scale=jax.ShapeDtypeStruct((*rows, c.head_dim // kv_group(c.head_dim)),
                                       pool_dtype(jnp.bfloat16, platform)))

    return PagedKV(layers=tuple(pool(kind) for kind in kinds), kinds=kinds)


def paged_specs(c: Gemma3Config, kv_cache_dtype: str = "auto") -> PagedKV:
    """PartitionSpecs of the pools: the combined heads split over tp (whatever tp is: even
    replicated KV heads are cached one per device); scales as their codes."""
    spec = P(*(AXIS if a == "cache_heads" else None for a in PAGES_AXES))
    scale = None if checked_kv_cache_dtype(kv_cache_dtype) == "auto" else spec
    kinds = layer_kinds(c)
    return PagedKV(layers=tuple(LayerPages(kv=spec, scale=scale) for _ in kinds), kinds=kinds)


def rotates(kv_cache_dtype: str) -> bool:
    """Whether a pool's runs are stored rotated (`rotate_runs`): int8's, as the AllReduce's int8
    codec rotates them (a run's outliers spread over it: a third of the KL of unrotated runs
    in the real 270M, docs/deployment.md); e4m3 codes, whose error follows each value, do
    better unrotated."""
    return kv_cache_dtype == "int8"


def rotate_runs(x: jax.Array, inverse: bool = False, dtype=None) -> jax.Array:
    """x [..., H] with each run of g = `kv_group(H)` values times the codec's rotation M
    (equarx.codec_spec.rotation: M M^T = g I), or with inverse=True times M^T / g (which
    undoes it); float32 products, in `dtype` (default x's)."""
    h = x.shape[-1]
    g = kv_group(h)
    m = codec_spec.rotation(g)
    m = m.T / g if inverse else m
    runs = x.reshape(*x.shape[:-1], h // g, g).astype(jnp.float32)
    out = jnp.dot(runs, jnp.asarray(m), precision=lax.Precision.HIGHEST)
    return out.reshape(x.shape).astype(dtype or x.dtype)


def quantize(x: jax.Array, kv_cache_dtype: str) -> tuple[jax.Array, jax.Array]:
    """Rows x [..., H] -> (codes [..., H] as the pool holds them, scales float32 [..., H / g],
    each a bfloat16 value): the group codec's grid and rounding (equarx.codec_spec.encode's),
    a run of g = `kv_group(H)` values per scale, no rotation. A run holding a NaN or Inf: its
    scale is NaN (it reads back as NaN), its codes 0."""
    code_max = codec_spec.CODES[kv_cache_dtype]
    g = kv_group(x.shape[-1])
    runs = x.reshape(*x.shape[:-1], x.shape[-1] // g, g)
    _, _, scale, inv = codec_spec.scale_parts(
        codec_spec.absmax(runs, -1).astype(jnp.float32), code_max)
    scaled = runs.astype(jnp.float32) * inv[..., None]
    if kv_cache_dtype == "fp8":
        codes = lax.bitcast_convert_type(scaled.astype(jnp.float8_e4m3fn), jnp.uint8)
    else:
        codes = codec_spec.round_int8(scaled)
    return codes.reshape(x.shape), scale


def code_values(codes: jax.Array, dtype) -> jax.Array:
    """Stored codes as values of `dtype` (exact: int8 and e4m3 values are bfloat16 values)."""
    if codes.dtype == CODE_DTYPES["fp8"]:
        codes = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    return codes.astype(dtype)


def dequantize(codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`quantize`'s codes [..., H] and (stored) scales [..., H / g] -> values [..., H] in
    `dtype`: the float32 product of a code and a scale (exact), rounded once to `dtype`. The
    scales are widened to [..., H] before the product (not broadcast over runs of codes):
    XLA:CPU then runs the gathered pages' dequantization at about twice the speed."""
    wide = jnp.repeat(as_values(scale).astype(jnp.float32), codes.shape[-1] // scale.shape[-1],
                      axis=-1)
    return (code_values(codes, jnp.float32) * wide).astype(dtype)


def store(pages: LayerPages, slots: jax.Array, k: jax.Array, v: jax.Array) -> LayerPages:
    """The pool with token t's key and value [T, Kl, H] at flat slot slots[t] = page *
    page_size + offset. A scatter into the pool viewed as [pages * page_size, 2 * Kl, H] (a
    reshape, no copy): in place when the pool is donated. Padding tokens all write the scratch
    page; which of them lands there does not matter (never read unmasked). A quantized pool
    gets each row's codes and, in its scale pool, their scales (`quantize`: of that row alone),
    of its runs rotated where the pool `rotates` them."""
    n, size, heads, h = pages.kv.shape
    rows = jnp.stack([k, v], axis=2).reshape(k.shape[0], heads, h)

    def put(pool, new):
        width = pool.shape[-1]
        flat = pool.reshape(n * size, heads, width).at[slots].set(new, mode="promise_in_bounds")
        return flat.reshape(n, size, heads, width)

    if pages.scale is None:
        return LayerPages(kv=put(pages.kv, as_stored(rows, pages.kv.dtype)))
    kind = pages.kv_cache_dtype
    codes, scale = quantize(rotate_runs(rows, dtype=jnp.float32) if rotates(kind) else rows, kind)
    return LayerPages(kv=put(pages.kv, codes), scale=put(pages.scale,
                                                         as_stored(scale, pages.scale.dtype)))


def gather(pages: LayerPages, table: jax.Array, dtype=None) -> tuple[jax.Array, jax.Array]:
    """The pages of each row's block table table [S, Pn] as keys and values [S, Pn * page, Kl,
    H] (logical order: column j's page holds the row's j-th page of its table); a quantized
    pool's dequantized to `dtype` (the activations') after the gather, which then reads the
    codes and scales alone. Runs stored rotated (`rotates`) come out rotated: the attention
    rotates its queries instead (`ragged.paged_attention`).

    Keys and values are each one gather of (position, head) pairs from the pool seen as
    [positions, 2 * Kl, H] (a free reshape): each comes out contiguous, in the layout the
    attention's dots read, and only the rows' own pages are read. Gathering pages whole and
    splitting them afterwards made XLA:CPU copy each half again; a strided view of the pool
    taken before the gather made it copy that view of the whole pool, every layer and step."""
    s, pn = table.shape
    n, size, heads, h = pages.kv.shape
    rows = (table[:, :, None] * size + jnp.arange(size, dtype=table.dtype)).reshape(s, pn * size)
    key_heads = jnp.arange(0, heads, 2, dtype=table.dtype)

    def take(pool, half):
        flat = pool.reshape(n * size, heads, pool.shape[-1])
        return flat[rows[:, :, None], key_heads[None, None, :] + half]

    if pages.scale is None:
        return as_values(take(pages.kv, 0)), as_values(take(pages.kv, 1))
    if dtype is None:
        raise ValueError("gathering a quantized pool needs the dtype to dequantize to")
    return tuple(dequantize(take(pages.kv, half), take(pages.scale, half), dtype)
                 for half in (0, 1))
