"""Gemma 3 forward pass as pure functions over this device's shards (run inside `jax.shard_map`).

Every function here sees local shapes: Nl = N / tp query heads, Kl local KV heads, Fl = F / tp
FFN units and Vl = V / tp vocabulary rows. The attention output projection and the MLP down
projection therefore yield partial sums; each goes through `equarx.all_reduce` (2 per layer).
The only other collective is the exact reduction of the vocab-parallel embedding lookup.

Numerics follow the official implementation (gemma/gm/nn/_modules.py), cast for cast: matmuls
(float32 accumulation), norms, softmax and residuals round to the activation dtype; RoPE's sin/cos
run in float32. Weights and caches may be *stored* wider than the activation dtype (float32
holding bfloat16 values on CPU, see loading.storage_dtype): every product is then still exact
and every result rounded as before, so the numerics do not change.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from equarx import AllReduceConfig, all_reduce
from models.gemma3.config import Gemma3Config
from models.gemma3.kv_cache import KVCache, LayerCache
from models.gemma3.sharding import AXIS, kv_sharded
from models.gemma3.weights import LayerWeights, Weights

K_MASK = -2.3819763e38  # the official masked-logit value (finite, so no NaN on empty rows)


@dataclasses.dataclass(frozen=True)
class Ctx:
    """Static facts a traced forward pass needs (hashable: part of the jit cache key)."""

    config: Gemma3Config
    tp: int
    allreduce: AllReduceConfig
    unroll: bool = False  # unroll the layer scans (one HLO copy per layer) instead of looping


# ---------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * (1 + scale), over the last axis."""
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * lax.rsqrt(var + eps) * (1 + scale.astype(x.dtype))


def apply_rope(x: jax.Array, positions: jax.Array, base: float, scale: float) -> jax.Array:
    """Half-rotation RoPE. x [B, T, n, H], positions [B, T]; positions divided by `scale`."""
    head_dim = x.shape[-1]
    exponents = (2.0 / head_dim) * jnp.arange(head_dim // 2, dtype=jnp.float32)
    timescale = base ** exponents
    angles = (positions[..., None] / timescale[None, None, :])[..., None, :] / scale
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)


def embed_tokens(table: jax.Array, tokens: jax.Array, ctx: Ctx) -> jax.Array:
    """tokens [B, T] -> [B, T, D] from this device's vocabulary rows table [Vl, D].

    Each token's row lives on exactly one device, so the psum of the masked local lookups adds
    zeros to one value: exact in any dtype, and deliberately not a (quantizable) equarx call.
    """
    rows = table.shape[0]
    if ctx.tp == 1:
        x = jnp.take(table, tokens, axis=0)
    else:
        local = tokens - lax.axis_index(AXIS) * rows
        inside = (local >= 0) & (local < rows)
        x = jnp.take(table, jnp.where(inside, local, 0), axis=0)
        x = lax.psum(jnp.where(inside[..., None], x, jnp.zeros((), x.dtype)), AXIS)
        # The residual stream is typed device-varying from here on: a ring AllReduce returns
        # varying values, and scan carries must keep one type across layers.
        x = lax.pcast(x, AXIS, to="varying")
    return x * jnp.sqrt(ctx.config.d_model).astype(x.dtype)


def output_logits(x: jax.Array, table: jax.Array) -> jax.Array:
    """[..., D] -> float32 logits [..., Vl] over this device's vocabulary rows (tied weights)."""
    # The official model rounds logits to the activation dtype; so do we, then widen.
    return matmul("...d,vd->...v", x, table).astype(jnp.float32)


def matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum of activations x [rows, ...] with a weight, float32 accumulation, x's dtype out.

    Why not a plain einsum: XLA:CPU runs bfloat16 matrix-vector products (decode at batch 1)
    through a slow path, ~10x slower than the same product with 2 rows, and a bfloat16-output
    dot is slower than a float32-output one. So one-row products get a duplicate row, and the
    dot accumulates and returns float32 before the cast (what XLA does inside a bf16 dot anyway).
    """
    single = x.shape[0] == 1 and int(np.prod(x.shape[1:-1])) == 1
    if single:
        x = jnp.concatenate([x, x], axis=0)
    out = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    return (out[:1] if single else out).astype(x.dtype)


def _reduce(x: jax.Array, ctx: Ctx) -> jax.Array:
    """Sum this layer's tensor-parallel partial sums through EQuARX."""
    return x if ctx.tp == 1 else all_reduce(x, AXIS, ctx.allreduce)


def _local_kv_weight(kv: jax.Array, ctx: Ctx) -> jax.Array:
    """[D, 2, Kl, H]: the KV projection of the heads this device's query heads attend with.

    When KV heads are replicated (tp > K), device d's query heads all share KV head
    d // (tp / K), so compute just that one instead of all K.
    """
    if kv_sharded(ctx.config, ctx.tp):
        return kv
    per_head = ctx.tp // ctx.config.num_kv_heads
    return lax.dynamic_slice_in_dim(kv, lax.axis_index(AXIS) // per_head, 1, axis=2)


def _rope_params(ctx: Ctx, kind: str) -> tuple[float, float]:
    c = ctx.config
    if kind == "global":
        return c.rope_global_base, c.rope_global_scale
    return c.rope_local_base, 1.0


def project_qkv(x: jax.Array, w: LayerWeights, positions: jax.Array, kind: str, ctx: Ctx):
    """x [B, T, D] -> q [B, T, Nl, H] (scaled), k, v [B, T, Kl, H]; QK-norm then RoPE."""
    eps = ctx.config.norm_eps
    q = matmul("btd,dnh->btnh", x, w.q)
    k, v = jnp.moveaxis(matmul("btd,dckh->btckh", x, _local_kv_weight(w.kv, ctx)), 2, 0)
    q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    base, scale = _rope_params(ctx, kind)
    q = apply_rope(q, positions, base, scale) * ctx.config.query_scale
    k = apply_rope(k, positions, base, scale)
    return q, k, v


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention. q [B, T, Nl, H]; k, v [B, S, Kl, H]; mask [B, T, S] (True =
    attend) -> [B, T, Nl, H]. Local query head i uses local KV head i // (Nl / Kl)."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    # float32-output dots rounded to the activation dtype: the official numerics, without
    # XLA:CPU's slow bfloat16-output dot path.
    logits = jnp.einsum("btkgh,bskh->btkgs", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask[:, :, None, None, :], logits.astype(q.dtype), K_MASK)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    out = jnp.einsum("btkgs,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(b, t, n, h)


def mlp(x: jax.Array, w: LayerWeights) -> jax.Array:
    """gelu_tanh(gate) * up, then the (partial) down projection. [B, T, D] -> [B, T, D]."""
    gate = matmul("btd,dcf->btcf", x, w.gating)
    hidden = jax.nn.gelu(gate[..., 0, :], approximate=True) * gate[..., 1, :]
    return matmul("btf,fd->btd", hidden, w.linear)


# attn(x, w, stack, index, kind) -> (partial output, stack): `stack` is the part of the KV cache
# holding this layer (None without a cache) and `index` the layer's position in its stacking dims.
AttnFn = Callable[[jax.Array, LayerWeights, "LayerCache | None", tuple, str],
                  tuple[jax.Array, "LayerCache | None"]]


def block(x: jax.Array, w: LayerWeights, stack: LayerCache | None, index: tuple, kind: str,
          attn: AttnFn, ctx: Ctx) -> tuple[jax.Array, LayerCache | None]:
    """One transformer block: (pre-norm, attention, post-norm, residual) then the same for the MLP."""
    eps = ctx.config.norm_eps
    attn_out, stack = attn(rms_norm(x, w.pre_attn_norm, eps), w, stack, index, kind)
    x = rms_norm(_reduce(attn_out, ctx), w.post_attn_norm, eps) + x
    ffw_out = mlp(rms_norm(x, w.pre_ffw_norm, eps), w)
    return rms_norm(_reduce(ffw_out, ctx), w.post_ffw_norm, eps) + x, stack


def run_layers(x: jax.Array, weights: Weights, cache: KVCache | None, attn: AttnFn,
               ctx: Ctx) -> tuple[jax.Array, KVCache | None]:
    """All blocks in order: scan over (5 local + 1 global) groups, then the tail layers.

    Scanning compiles one group body instead of one body per layer (18 to 62 layers, each with
    its unrolled AllReduce schedules), which keeps cold-start compile time flat in depth. The
    cache stacks ride in the scan carry and each layer updates its own entries in place: as
    scanned-over inputs and outputs they were copied whole on every call.
    """
    unroll = ctx.unroll or 1

    def local_layers(x, stack, w_stack, lead: tuple):
        def step(carry, xs):
            x, stack = carry
            w, j = xs
            return block(x, w, stack, lead + (j,), "local", attn, ctx), None

        n = jax.tree.leaves(w_stack)[0].shape[0]
        return lax.scan(step, (x, stack), (w_stack, jnp.arange(n)), unroll=unroll)[0]

    local, global_, tail = (None, None, None) if cache is None else \
        (cache.local, cache.global_, cache.tail)
    if weights.local is not None:
        def group(carry, xs):
            x, local, global_ = carry
            w_local, w_global, g = xs
            x, local = local_layers(x, local, w_local, (g,))
            x, global_ = block(x, w_global, global_, (g,), "global", attn, ctx)
            return (x, local, global_), None

        groups = jnp.arange(ctx.config.num_groups)
        x, local, global_ = lax.scan(group, (x, local, global_),
                                     (weights.local, weights.global_, groups), unroll=unroll)[0]
    if weights.tail is not None:
        x, tail = local_layers(x, tail, weights.tail, ())
    return x, (None if cache is None else KVCache(local=local, global_=global_, tail=tail))


# ---------------------------------------------------------------------------------------------
# Cache writes


def _write_prompt(stack: LayerCache, index: tuple, k: jax.Array, v: jax.Array, kind: str,
                  lengths: jax.Array, slots: jax.Array) -> LayerCache:
    """Store a prompt's keys/values [B, T, Kl, H] (positions 0..T-1) into rows `slots` of the
    layer at `index` of a cache stack.

    Global rows take positions 0..T-1 as they are. A local ring row of W entries keeps, at index
    s, the latest real position p < length with p % W == s: the last W positions of the prompt,
    and never a padding position that would alias a real one.
    """
    t, length = k.shape[1], stack.k.shape[-3]
    k, v = k.astype(stack.k.dtype), v.astype(stack.v.dtype)
    if kind == "global":
        n = min(t, length)
        rows = (*index, slots, slice(0, n))
        return LayerCache(k=stack.k.at[rows].set(k[:, :n]), v=stack.v.at[rows].set(v[:, :n]))
    s = jnp.arange(length)
    src = s[None, :] + length * jnp.floor_divide(lengths[:, None] - 1 - s[None, :], length)
    src = jnp.clip(src, 0, t - 1)[:, :, None, None]  # [B, W, 1, 1]; never-filled entries: junk
    rows = (*index, slots)
    return LayerCache(k=stack.k.at[rows].set(jnp.take_along_axis(k, src, axis=1)),
                      v=stack.v.at[rows].set(jnp.take_along_axis(v, src, axis=1)))


def _sequence_mask(t: int, window: int | None) -> jax.Array:
    """[T, T] causal mask, limited to keys in (q - window, q] when window is given."""
    q = jnp.arange(t)[:, None]
    kpos = jnp.arange(t)[None, :]
    mask = kpos <= q
    return mask if window is None else mask & (kpos > q - window)


# ---------------------------------------------------------------------------------------------
# Entry points (local shards in, local shards out)


def prefill(weights: Weights, cache: KVCache | None, tokens: jax.Array, lengths: jax.Array,
            slots: jax.Array, *, ctx: Ctx, return_all: bool) -> tuple[jax.Array, KVCache | None]:
    """Prompts tokens [B, T] (right-padded; real lengths [B]) at positions 0..T-1.

    Writes each prompt's KV into cache row slots[b] (cache None: no cache, e.g. scoring).
    Returns float32 logits over local vocabulary rows: [B, Vl] at each prompt's last real token,
    or [B, T, Vl] with return_all.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    masks = {"global": _sequence_mask(t, None)[None],
             "local": _sequence_mask(t, ctx.config.sliding_window)[None]}

    def attn(x, w, stack, index, kind):
        q, k, v = project_qkv(x, w, positions, kind, ctx)
        out = matmul("btnh,nhd->btd", attend(q, k, v, masks[kind]), w.o)
        if stack is not None:
            stack = _write_prompt(stack, index, k, v, kind, lengths, slots)
        return out, stack

    x = embed_tokens(weights.embed, tokens, ctx)
    x, cache = run_layers(x, weights, cache, attn, ctx)
    if not return_all:
        x = x[jnp.arange(b), lengths - 1]
    x = rms_norm(x, weights.final_norm, ctx.config.norm_eps)
    return output_logits(x, weights.embed), cache


def decode_step(weights: Weights, cache: KVCache, tokens: jax.Array, positions: jax.Array, *,
                ctx: Ctx) -> tuple[jax.Array, KVCache]:
    """One token per cache slot: tokens, positions [S] -> float32 logits [S, Vl].

    The new key/value is written first (global row index = position, ring index = position % W),
    then each slot attends to its valid cached positions: global indices <= position; ring entry
    s holds position p - ((p - s) mod W), valid when >= 0. Writes past the global length are
    dropped, so a slot never touches another slot's row.
    """
    s = tokens.shape[0]
    rows = jnp.arange(s)
    pos = positions[:, None]  # [S, 1]

    def attn(x, w, stack, index, kind):
        q, k, v = project_qkv(x, w, pos, kind, ctx)
        length = stack.k.shape[-3]
        idx = jnp.arange(length)[None, :]
        if kind == "global":
            where, valid = positions, idx <= pos
        else:
            where, valid = positions % length, pos - jnp.mod(pos - idx, length) >= 0
        at = (*index, rows, where)
        stack = LayerCache(k=stack.k.at[at].set(k[:, 0].astype(stack.k.dtype), mode="drop"),
                           v=stack.v.at[at].set(v[:, 0].astype(stack.v.dtype), mode="drop"))
        keys, values = stack.k[index], stack.v[index]
        out = matmul("btnh,nhd->btd", attend(q, keys, values, valid[:, None, :]), w.o)
        return out, stack

    x = embed_tokens(weights.embed, tokens[:, None], ctx)
    x, cache = run_layers(x, weights, cache, attn, ctx)
    x = rms_norm(x[:, 0], weights.final_norm, ctx.config.norm_eps)
    return output_logits(x, weights.embed), cache
