"""Gemma 3 forward pass as pure functions over this device's shards (run inside `jax.shard_map`).

Every function here sees local shapes: Nl = N / tp query heads, Kl local KV heads, Fl = F / tp
FFN units and Vl = V / tp vocabulary rows. The attention output projection and the MLP down
projection therefore yield partial sums; each goes through `equarx.all_reduce` (2 per layer).
The only other collective is the exact reduction of the vocab-parallel embedding lookup.

Numerics follow the official implementation (gemma/gm/nn/_modules.py), cast for cast: matmuls,
norms, softmax and residuals run in the activation dtype; RoPE's sin/cos in float32.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
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
    return x * lax.rsqrt(var + eps) * (1 + scale)


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
    if ctx.tp == 1:
        x = jnp.take(table, tokens, axis=0)
    else:
        rows = table.shape[0]
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
    return jnp.einsum("...d,vd->...v", x, table).astype(jnp.float32)


def _reduce(x: jax.Array, ctx: Ctx) -> jax.Array:
    """Sum this layer's tensor-parallel partial sums through EQuARX."""
    return x if ctx.tp == 1 else all_reduce(x, AXIS, ctx.allreduce)


def _local_kv_weight(kv: jax.Array, ctx: Ctx) -> jax.Array:
    """[2, Kl, D, H]: the KV projection of the heads this device's query heads attend with.

    When KV heads are replicated (tp > K), device d's query heads all share KV head
    d // (tp / K), so compute just that one instead of all K.
    """
    if kv_sharded(ctx.config, ctx.tp):
        return kv
    per_head = ctx.tp // ctx.config.num_kv_heads
    return lax.dynamic_slice_in_dim(kv, lax.axis_index(AXIS) // per_head, 1, axis=1)


def _rope_params(ctx: Ctx, kind: str) -> tuple[float, float]:
    c = ctx.config
    if kind == "global":
        return c.rope_global_base, c.rope_global_scale
    return c.rope_local_base, 1.0


def project_qkv(x: jax.Array, w: LayerWeights, positions: jax.Array, kind: str, ctx: Ctx):
    """x [B, T, D] -> q [B, T, Nl, H] (scaled), k, v [B, T, Kl, H]; QK-norm then RoPE."""
    eps = ctx.config.norm_eps
    q = jnp.einsum("btd,ndh->btnh", x, w.q)
    k, v = jnp.einsum("btd,ckdh->cbtkh", x, _local_kv_weight(w.kv, ctx))
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
    logits = jnp.einsum("btkgh,bskh->btkgs", q, k)
    logits = jnp.where(mask[:, :, None, None, :], logits, K_MASK)
    probs = jax.nn.softmax(logits, axis=-1).astype(k.dtype)
    return jnp.einsum("btkgs,bskh->btkgh", probs, v).reshape(b, t, n, h)


def mlp(x: jax.Array, w: LayerWeights) -> jax.Array:
    """gelu_tanh(gate) * up, then the (partial) down projection. [B, T, D] -> [B, T, D]."""
    gate = jnp.einsum("btd,cfd->btcf", x, w.gating)
    hidden = jax.nn.gelu(gate[..., 0, :], approximate=True) * gate[..., 1, :]
    return jnp.einsum("btf,fd->btd", hidden, w.linear)


AttnFn = Callable[[jax.Array, LayerWeights, "LayerCache | None", str],
                  tuple[jax.Array, "LayerCache | None"]]


def block(x: jax.Array, w: LayerWeights, cache: LayerCache | None, kind: str, attn: AttnFn,
          ctx: Ctx) -> tuple[jax.Array, LayerCache | None]:
    """One transformer block: (pre-norm, attention, post-norm, residual) then the same for the MLP."""
    eps = ctx.config.norm_eps
    attn_out, cache = attn(rms_norm(x, w.pre_attn_norm, eps), w, cache, kind)
    x = rms_norm(_reduce(attn_out, ctx), w.post_attn_norm, eps) + x
    ffw_out = mlp(rms_norm(x, w.pre_ffw_norm, eps), w)
    return rms_norm(_reduce(ffw_out, ctx), w.post_ffw_norm, eps) + x, cache


def run_layers(x: jax.Array, weights: Weights, cache: KVCache | None, attn: AttnFn,
               ctx: Ctx) -> tuple[jax.Array, KVCache | None]:
    """All blocks in order: scan over (5 local + 1 global) groups, then the tail layers.

    Scanning compiles one group body instead of one body per layer (18 to 62 layers, each with
    its unrolled AllReduce schedules), which keeps cold-start compile time flat in depth.
    """
    unroll = ctx.unroll or 1

    def layer(kind):
        def step(x, xs):
            w, c = xs
            return block(x, w, c, kind, attn, ctx)
        return step

    def part(name):
        return None if cache is None else getattr(cache, name)

    new = {"local": None, "global_": None, "tail": None}
    if weights.local is not None:
        def group(x, xs):
            w_local, w_global, c_local, c_global = xs
            x, c_local = lax.scan(layer("local"), x, (w_local, c_local), unroll=unroll)
            x, c_global = layer("global")(x, (w_global, c_global))
            return x, (c_local, c_global)

        x, (new["local"], new["global_"]) = lax.scan(
            group, x, (weights.local, weights.global_, part("local"), part("global_")),
            unroll=unroll)
    if weights.tail is not None:
        x, new["tail"] = lax.scan(layer("local"), x, (weights.tail, part("tail")), unroll=unroll)
    return x, (None if cache is None else KVCache(**new))


# ---------------------------------------------------------------------------------------------
# Cache writes


def _write_prompt(c: LayerCache, k: jax.Array, v: jax.Array, kind: str, lengths: jax.Array,
                  slots: jax.Array) -> LayerCache:
    """Store a prompt's keys/values [B, T, Kl, H] (positions 0..T-1) into cache rows `slots`.

    Global rows take positions 0..T-1 as they are. A local ring row of W entries keeps, at index
    s, the latest real position p < length with p % W == s: the last W positions of the prompt,
    and never a padding position that would alias a real one.
    """
    t = k.shape[1]
    if kind == "global":
        n = min(t, c.k.shape[1])
        return LayerCache(k=c.k.at[slots, :n].set(k[:, :n]), v=c.v.at[slots, :n].set(v[:, :n]))
    window = c.k.shape[1]
    s = jnp.arange(window)
    src = s[None, :] + window * jnp.floor_divide(lengths[:, None] - 1 - s[None, :], window)
    src = jnp.clip(src, 0, t - 1)[:, :, None, None]  # [B, W, 1, 1]; never-filled entries: junk
    return LayerCache(k=c.k.at[slots].set(jnp.take_along_axis(k, src, axis=1)),
                      v=c.v.at[slots].set(jnp.take_along_axis(v, src, axis=1)))


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

    def attn(x, w, c, kind):
        q, k, v = project_qkv(x, w, positions, kind, ctx)
        out = jnp.einsum("btnh,nhd->btd", attend(q, k, v, masks[kind]), w.o)
        return out, (None if c is None else _write_prompt(c, k, v, kind, lengths, slots))

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

    def attn(x, w, c, kind):
        q, k, v = project_qkv(x, w, pos, kind, ctx)
        length = c.k.shape[1]
        idx = jnp.arange(length)[None, :]
        if kind == "global":
            where, valid = positions, idx <= pos
        else:
            where, valid = positions % length, pos - jnp.mod(pos - idx, length) >= 0
        c = LayerCache(k=c.k.at[rows, where].set(k[:, 0], mode="drop"),
                       v=c.v.at[rows, where].set(v[:, 0], mode="drop"))
        out = jnp.einsum("btnh,nhd->btd", attend(q, c.k, c.v, valid[:, None, :]), w.o)
        return out, c

    x = embed_tokens(weights.embed, tokens[:, None], ctx)
    x, cache = run_layers(x, weights, cache, attn, ctx)
    x = rms_norm(x[:, 0], weights.final_norm, ctx.config.norm_eps)
    return output_logits(x, weights.embed), cache
