"""Gemma 3 forward pass as pure functions over this device's shards (run inside `jax.shard_map`).

Every function here sees local shapes: Nl = N / tp query heads, Kl local KV heads, Fl = F / tp
FFN units and Vl = V / tp vocabulary rows. The attention output projection and the MLP down
projection therefore yield partial sums; each goes through `equarx.all_reduce` (2 per layer).
The only other collective is the exact reduction of the vocab-parallel embedding lookup.

Numerics follow the official implementation (gemma/gm/nn/_modules.py), cast for cast: matmuls
(float32 accumulation), norms, softmax and residuals round to the activation dtype; RoPE's sin/cos
run in float32. The KV cache may be *held* wider than the activation dtype (float32 holding
bfloat16 values on CPU, see loading.cache_dtype): products with it are still exact and every
result is rounded as before, so the numerics do not change.
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


# A tensor-parallel reduction: this device's partial sum and the mesh axis (or the tuple of a
# multi-axis TP mesh's axes) -> the sum.
Reduction = Callable[[jax.Array, "str | tuple[str, ...]"], jax.Array]


@dataclasses.dataclass(frozen=True)
class Ctx:
    """Static facts a traced forward pass needs (hashable: part of the jit cache key)."""

    config: Gemma3Config
    tp: int
    allreduce: AllReduceConfig
    # Replaces `equarx.all_reduce(x, axis, allreduce)` at every layer's two reductions when set
    # (eval's strawman comparison plugs in here); None is EQuARX.
    reduction: Reduction | None = None
    # The mesh axes tensor parallelism runs over: "tp" (1-D), or a TP mesh's tuple of axes
    # (e.g. ("x", "y")), over whose product heads, FFN and vocabulary are split; every
    # collective then runs over the tuple (equarx: the multi-axis schedule).
    axes: str | tuple[str, ...] = AXIS
    # The o and linear weights carry the AllReduce codec's rotation (ModelPrograms folds it in
    # at load, groups.fold_rotation): their partial sums reach `all_reduce` already rotated.
    rotated_partials: bool = False


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
    It sums the values' bit patterns as integers of their width, which is as exact (one
    non-zero term) and moves 16 bits a value for bfloat16 where XLA:CPU widens a bfloat16 psum
    to float32 (the prefill of a 2-layer model sent a third of its bytes there).
    """
    rows = table.shape[0]
    if ctx.tp == 1:
        x = jnp.take(table, tokens, axis=0)
    else:
        local = tokens - lax.axis_index(ctx.axes) * rows
        inside = (local >= 0) & (local < rows)
        x = jnp.take(table, jnp.where(inside, local, 0), axis=0)
        x = jnp.where(inside[..., None], x, jnp.zeros((), x.dtype))
        bits = jnp.dtype(f"int{8 * x.dtype.itemsize}")
        x = lax.bitcast_convert_type(
            lax.psum(lax.bitcast_convert_type(x, bits), ctx.axes), x.dtype)
        # The residual stream is typed device-varying from here on: a ring AllReduce returns
        # varying values, and scan carries must keep one type across layers.
        x = lax.pcast(x, ctx.axes, to="varying")
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
    """Sum this layer's tensor-parallel partial sums through EQuARX (or ctx.reduction)."""
    if ctx.tp == 1:
        return x
    if ctx.reduction is not None:
        return ctx.reduction(x, ctx.axes)
    return all_reduce(x, ctx.axes, ctx.allreduce, rotated=ctx.rotated_partials)


def _local_kv_weight(kv: jax.Array, ctx: Ctx) -> jax.Array:
    """[D, 2, Kl, H]: the KV projection of the heads this device's query heads attend with.

    When KV heads are replicated (tp > K), device d's query heads all share KV head
    d // (tp / K), so compute just that one instead of all K.
    """
    if kv_sharded(ctx.config, ctx.tp):
        return kv
    per_head = ctx.tp // ctx.config.num_kv_heads
    return lax.dynamic_slice_in_dim(kv, lax.axis_index(ctx.axes) // per_head, 1, axis=2)


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


def attend(q: jax.Array, k_t: jax.Array, v: jax.Array, mask: jax.Array,
           new_k_t: jax.Array | None = None, new_v: jax.Array | None = None,
           new_mask: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention. q [B, T, Nl, H]; keys k_t [B, Kl, H, S] (transposed, as cached),
    values v [B, Kl, S, H]; mask [B, T, S] (True = attend) -> [B, T, Nl, H]. Local query head i
    uses local KV head i // (Nl / Kl). new_k_t [B, Kl, H, N] / new_v [B, Kl, N, H]: N more
    keys/values kept out of the cache read (decode's own token, N = 1, which every query attends
    to; or a prefill chunk's own tokens, with new_mask [B, T, N] saying which).

    The cache layouts are the ones batched matmuls read directly: with keys cached [S, H] XLA
    transposed every layer's whole key cache on every decode step.
    """
    b, t, n, h = q.shape
    kv_heads = k_t.shape[1]
    g = n // kv_heads
    q = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4)  # [B, Kl, G, T, H]
    # float32-output dots rounded to the activation dtype: the official numerics, without
    # XLA:CPU's slow bfloat16-output dot path.
    logits = jnp.einsum("bkgth,bkhs->bkgts", q, k_t, preferred_element_type=jnp.float32)
    logits = jnp.where(mask[:, None, None], logits.astype(q.dtype), K_MASK)
    if new_k_t is not None:
        own = jnp.einsum("bkgth,bkhs->bkgts", q, new_k_t,
                         preferred_element_type=jnp.float32).astype(q.dtype)
        if new_mask is not None:
            own = jnp.where(new_mask[:, None, None], own, K_MASK)
        logits = jnp.concatenate([logits, own], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    s = k_t.shape[-1]
    out = jnp.einsum("bkgts,bksh->bkgth", probs[..., :s], v, preferred_element_type=jnp.float32)
    if new_v is not None:
        out = out + jnp.einsum("bkgts,bksh->bkgth", probs[..., s:], new_v,
                               preferred_element_type=jnp.float32)
    return out.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def output_projection(enc: jax.Array, w_o: jax.Array) -> jax.Array:
    """[B, T, Nl, H] x [Nl, H, D] -> partial sums [B, T, D], as one 2-D matmul (heads and
    head_dim flattened together: a two-dim contraction made XLA copy w_o into another order)."""
    b, t, n, h = enc.shape
    return matmul("btk,kd->btd", enc.reshape(b, t, n * h), w_o.reshape(n * h, w_o.shape[-1]))


def mlp(x: jax.Array, w: LayerWeights) -> jax.Array:
    """gelu_tanh(gate) * up, then the (partial) down projection. [B, T, D] -> [B, T, D]."""
    gate = matmul("btd,dcf->btcf", x, w.gating)
    hidden = jax.nn.gelu(gate[..., 0, :], approximate=True) * gate[..., 1, :]
    return matmul("btf,fd->btd", hidden, w.linear)


# attn(x, w, layer, kind) -> (partial output, this layer's new keys and values): `layer` is the
# layer's index, for reading its cache.
AttnFn = Callable[[jax.Array, LayerWeights, int, str], tuple[jax.Array, "LayerCache"]]


def block(x: jax.Array, w: LayerWeights, layer: int, kind: str, attn: AttnFn,
          ctx: Ctx) -> tuple[jax.Array, LayerCache]:
    """One transformer block: (pre-norm, attention, post-norm, residual) then the same for the MLP."""
    eps = ctx.config.norm_eps
    attn_out, new_kv = attn(rms_norm(x, w.pre_attn_norm, eps), w, layer, kind)
    x = rms_norm(_reduce(attn_out, ctx), w.post_attn_norm, eps) + x
    ffw_out = mlp(rms_norm(x, w.pre_ffw_norm, eps), w)
    return rms_norm(_reduce(ffw_out, ctx), w.post_ffw_norm, eps) + x, new_kv


def run_layers(x: jax.Array, weights: Weights, attn: AttnFn,
               ctx: Ctx) -> tuple[jax.Array, tuple[LayerCache, ...]]:
    """All blocks in order (a Python loop: one HLO copy per layer, see weights.py for why).
    Returns the activations and every layer's new keys and values."""
    new_kv = []
    for i, w in enumerate(weights.layers):
        x, kv = block(x, w, i, _layer_kind(ctx, i), attn, ctx)
        new_kv.append(kv)
    return x, tuple(new_kv)


def _layer_kind(ctx: Ctx, layer: int) -> str:
    return "global" if ctx.config.is_global(layer) else "local"


# ---------------------------------------------------------------------------------------------
# Cache writes. XLA:CPU copies a buffer that one program both reads and updates in place (every
# layer's cache, twice, on every decode step). So decode_step only reads the cache and returns
# the new keys/values, and write_token stores them in a second, write-only program. Prefill does
# not read the cache and stores its keys/values in the same program.


# Prompts longer than this attend in query chunks of this size, so the attention logits stay
# [chunk, T] per head instead of [T, T] (32k tokens: 4 GiB per head and layer in float32).
PROMPT_CHUNK = 1024


def _sequence_mask(queries: jax.Array, t: int, window: int | None) -> jax.Array:
    """[Q, T] mask for query positions `queries`: causal, and keys in (q - window, q] when
    window is given."""
    q = queries[:, None]
    kpos = jnp.arange(t)[None, :]
    mask = kpos <= q
    return mask if window is None else mask & (kpos > q - window)


def attend_prompt(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None) -> jax.Array:
    """Causal (and sliding-window) self-attention of a prompt at positions 0..T-1.
    q [B, T, Nl, H]; k, v [B, T, Kl, H] -> [B, T, Nl, H]."""
    b, t, n, h = q.shape
    k_t, v = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    if t <= PROMPT_CHUNK or t % PROMPT_CHUNK:
        return attend(q, k_t, v, _sequence_mask(jnp.arange(t), t, window)[None])

    def chunk(i):
        rows = lax.dynamic_slice_in_dim(q, i * PROMPT_CHUNK, PROMPT_CHUNK, axis=1)
        queries = i * PROMPT_CHUNK + jnp.arange(PROMPT_CHUNK)
        return attend(rows, k_t, v, _sequence_mask(queries, t, window)[None])

    out = lax.map(chunk, jnp.arange(t // PROMPT_CHUNK))  # [C, B, chunk, Nl, H]
    return out.transpose(1, 0, 2, 3, 4).reshape(b, t, n, h)


def write_prompt(cache: KVCache, new_kv: tuple[LayerCache, ...], lengths: jax.Array,
                 slots: jax.Array, *, ctx: Ctx) -> KVCache:
    """Store prompts' keys/values (per layer [B, T, Kl, H], positions 0..T-1) into cache rows
    `slots`.

    Global rows take positions 0..T-1 as they are. A local ring row of W entries keeps, at index
    s, the latest real position p < length with p % W == s: the last W positions of the prompt,
    and never a padding position that would alias a real one.
    """
    layers = []
    for i, (c, kv) in enumerate(zip(cache.layers, new_kv)):
        k, v = kv.k.astype(c.k.dtype), kv.v.astype(c.v.dtype)
        t, length = k.shape[1], c.v.shape[2]
        if _layer_kind(ctx, i) == "global":
            n = min(t, length)
            k, v = k[:, :n], v[:, :n]
        else:
            s = jnp.arange(length)
            src = s[None, :] + length * jnp.floor_divide(lengths[:, None] - 1 - s[None, :], length)
            src = jnp.clip(src, 0, t - 1)[:, :, None, None]  # [B, W, 1, 1]; unfilled: junk
            k, v = jnp.take_along_axis(k, src, axis=1), jnp.take_along_axis(v, src, axis=1)
            n = length
        layers.append(LayerCache(k=c.k.at[slots, :, :, :n].set(k.transpose(0, 2, 3, 1)),
                                 v=c.v.at[slots, :, :n].set(v.transpose(0, 2, 1, 3))))
    return KVCache(layers=tuple(layers))


def write_token(cache: KVCache, new_kv: tuple[LayerCache, ...], positions: jax.Array, *,
                ctx: Ctx) -> KVCache:
    """Store one token per slot (per layer keys/values [S, Kl, H]) at global index `position`
    and ring index position % W. Start indices are clamped into bounds, so a position past the
    global length overwrites its own row's last entry and never another slot's row."""
    ring = _ring_index(positions, ctx)
    layers = []
    for i, (c, kv) in enumerate(zip(cache.layers, new_kv)):
        where = positions if _layer_kind(ctx, i) == "global" else ring
        ck, cv = c.k, c.v
        k, v = kv.k.astype(ck.dtype), kv.v.astype(cv.dtype)
        # One in-place dynamic_update_slice per slot: XLA lowered the equivalent scatter to a
        # select over the whole cache.
        for b in range(k.shape[0]):
            ck = lax.dynamic_update_slice(ck, k[b][None, :, :, None], (b, 0, 0, where[b]))
            cv = lax.dynamic_update_slice(cv, v[b][None, :, None, :], (b, 0, where[b], 0))
        layers.append(LayerCache(k=ck, v=cv))
    return KVCache(layers=tuple(layers))


def write_chunk(cache: KVCache, new_kv: tuple[LayerCache, ...], start: jax.Array,
                length: jax.Array, slot: jax.Array, *, ctx: Ctx) -> KVCache:
    """Store one prefill chunk's keys/values (per layer [1, T, Kl, H], positions start..start+T-1,
    the first `length` of them real) into cache row `slot` ([1]-shaped start, length, slot).

    Only that row's window is read and written back (in place), never the whole cache. A global
    row takes positions start..start+length-1; its window is T entries from start, moved back to
    end at the row's last entry when it would run past it (the entries before `start` then keep
    their old values). A local ring row keeps, at index s, the latest real position p <= start +
    length - 1 with p % W == s if p >= start, else its old entry, so that a chunk longer than the
    window, or one that wraps around the ring, leaves the ring as one prefill of the whole prompt
    would. Positions past `length` (the chunk's padding) are never stored in a ring; in a global
    row they lie beyond the sequence, where nothing reads before a later write.
    """
    start, length, slot = start[0], length[0], slot[0]
    layers = []
    for i, (c, kv) in enumerate(zip(cache.layers, new_kv)):
        k, v = kv.k[0].astype(c.k.dtype), kv.v[0].astype(c.v.dtype)  # [T, Kl, H]
        t, n = k.shape[0], c.v.shape[2]
        if _layer_kind(ctx, i) == "global":
            first = jnp.minimum(start, n - t)
            pos = first + jnp.arange(t)
        else:
            first = jnp.zeros((), start.dtype)
            s = jnp.arange(n)
            last = start + length - 1
            pos = s + n * jnp.floor_divide(last - s, n)  # latest position <= last at index s
            t = n
        rel = pos - start
        take = (rel >= 0) & (rel < length)
        src = jnp.clip(rel, 0, k.shape[0] - 1)
        new_k = jnp.take(k, src, axis=0).transpose(1, 2, 0)[None]  # [1, Kl, H, t]
        new_v = jnp.take(v, src, axis=0).transpose(1, 0, 2)[None]  # [1, Kl, t, H]
        kl, h = c.k.shape[1], c.k.shape[2]
        old_k = lax.dynamic_slice(c.k, (slot, 0, 0, first), (1, kl, h, t))
        old_v = lax.dynamic_slice(c.v, (slot, 0, first, 0), (1, kl, t, h))
        ck = lax.dynamic_update_slice(c.k, jnp.where(take[None, None, None, :], new_k, old_k),
                                      (slot, 0, 0, first))
        cv = lax.dynamic_update_slice(c.v, jnp.where(take[None, None, :, None], new_v, old_v),
                                      (slot, 0, first, 0))
        layers.append(LayerCache(k=ck, v=cv))
    return KVCache(layers=tuple(layers))


def _ring_index(positions: jax.Array, ctx: Ctx) -> jax.Array:
    # Positions are >= 0, so the C-style remainder is the ring index (a Python-style modulo
    # fuses a sign fix-up into the cache updates, which XLA then does not do in place).
    return lax.rem(positions, ctx.config.sliding_window)


# ---------------------------------------------------------------------------------------------
# Forward passes (local shards in, local shards out)


def prefill(weights: Weights, cache: KVCache | None, tokens: jax.Array, lengths: jax.Array,
            slots: jax.Array | None, *, ctx: Ctx,
            return_all: bool) -> tuple[jax.Array, KVCache | None]:
    """Prompts tokens [B, T] (right-padded; real lengths [B]) at positions 0..T-1, their keys
    and values stored into cache rows `slots` (no cache: scoring only).

    Returns float32 logits over local vocabulary rows ([B, Vl] at each prompt's last real token,
    or [B, T, Vl] with return_all) and the updated cache. Prefill never reads the cache, so one
    program can compute and store (see the note above write_prompt).
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def attn(x, w, layer, kind):
        q, k, v = project_qkv(x, w, positions, kind, ctx)
        enc = attend_prompt(q, k, v, None if kind == "global" else ctx.config.sliding_window)
        return output_projection(enc, w.o), LayerCache(k=k, v=v)

    x = embed_tokens(weights.embed, tokens, ctx)
    x, new_kv = run_layers(x, weights, attn, ctx)
    if not return_all:
        x = x[jnp.arange(b), lengths - 1]
    x = rms_norm(x, weights.final_norm, ctx.config.norm_eps)
    if cache is not None:
        cache = write_prompt(cache, new_kv, lengths, slots, ctx=ctx)
    return output_logits(x, weights.embed), cache


def decode_step(weights: Weights, cache: KVCache, tokens: jax.Array, positions: jax.Array, *,
                ctx: Ctx) -> tuple[jax.Array, tuple[LayerCache, ...]]:
    """One token per cache slot: tokens, positions [S] -> float32 logits [S, Vl] and every
    layer's new keys/values [S, Kl, H] for write_token.

    Each slot attends to its own new key/value plus the cached positions still in view: global
    entries j < position; ring entry s holds position p - 1 - ((p - 1 - s) mod W), in view when
    >= 0 and s != p mod W (that entry holds p - W, just out of the window).

    With fewer tokens than cache slots (R < S), only the first R slots decode: the step then
    reads R rows of the cache, so a lone sequence does not pay for a full batch.
    """
    rows = tokens.shape[0]
    if rows < cache.num_slots:
        cache = KVCache(tuple(LayerCache(k=c.k[:rows], v=c.v[:rows]) for c in cache.layers))
    pos = positions[:, None]  # [S, 1]
    ring = _ring_index(positions, ctx)

    def attn(x, w, layer, kind):
        q, k, v = project_qkv(x, w, pos, kind, ctx)  # k, v [S, 1, Kl, H]
        c = cache.layers[layer]
        idx = jnp.arange(c.v.shape[2])[None, :]
        if kind == "global":
            in_view = idx < pos
        else:
            window = c.v.shape[2]
            in_view = (pos - 1 - jnp.mod(pos - 1 - idx, window) >= 0) & (idx != ring[:, None])
        enc = attend(q, c.k, c.v, in_view[:, None, :],
                     new_k_t=k.transpose(0, 2, 3, 1), new_v=v.transpose(0, 2, 1, 3))
        return output_projection(enc, w.o), LayerCache(k=k[:, 0], v=v[:, 0])

    x = embed_tokens(weights.embed, tokens[:, None], ctx)
    x, new_kv = run_layers(x, weights, attn, ctx)
    x = rms_norm(x[:, 0], weights.final_norm, ctx.config.norm_eps)
    return output_logits(x, weights.embed), new_kv


def prefill_chunk(weights: Weights, cache: KVCache, tokens: jax.Array, start: jax.Array,
                  length: jax.Array, slot: jax.Array, *, ctx: Ctx,
                  logits: bool = True) -> tuple[jax.Array, tuple[LayerCache, ...]]:
    """One chunk of a prompt: tokens [1, T] at positions start..start+T-1 (the first `length`
    real, the rest padding) of the sequence in cache row `slot`, whose positions before `start`
    are in the cache ([1]-shaped start, length, slot).

    Returns float32 logits [1, Vl] at the chunk's last real token and every layer's keys/values
    of the chunk [1, T, Kl, H] in the cache's dtype, for `write_chunk` (a second program, as
    for decode: the cache is only read here). Each query attends to the cached positions still
    in its view (global: < start; ring entry s holds start - 1 - ((start - 1 - s) mod W), in view
    when >= 0 and within the window) and causally to the chunk's own keys (within the window).
    The ring is read before the chunk's own positions are written, so it needs W entries
    whatever the chunk length. logits=False (a chunk before the prompt's last) returns only the
    keys/values: the logits read the whole embedding table, which on a CPU costs more than a
    16-token chunk's layers.

    A chunk's result depends on its request alone (its tokens, start, length and the cache row
    it reads): chunk boundaries at 0, C, 2C, ... make a prompt's cache and logits a function of
    the prompt, and a chunk-aligned prefix bitwise what any other prompt with that prefix holds.
    """
    t = tokens.shape[1]
    qpos = start[0] + jnp.arange(t, dtype=jnp.int32)  # [T]
    positions = qpos[None, :]
    rows = tuple(LayerCache(k=lax.dynamic_slice_in_dim(c.k, slot[0], 1, axis=0),
                            v=lax.dynamic_slice_in_dim(c.v, slot[0], 1, axis=0))
                 for c in cache.layers)

    def attn(x, w, layer, kind):
        q, k, v = project_qkv(x, w, positions, kind, ctx)  # k, v [1, T, Kl, H]
        c = rows[layer]
        n = c.v.shape[2]
        idx = jnp.arange(n)
        window = None if kind == "global" else ctx.config.sliding_window
        if kind == "global":
            cached = idx
            valid = idx < start[0]
        else:
            cached = start[0] - 1 - jnp.mod(start[0] - 1 - idx, n)
            valid = cached >= 0
        mask = valid[None, :] & (cached[None, :] <= qpos[:, None])
        if window is not None:
            mask = mask & (cached[None, :] > qpos[:, None] - window)
        own = _sequence_mask(jnp.arange(t), t, window)
        enc = attend(q, c.k, c.v, mask[None], new_k_t=k.transpose(0, 2, 3, 1),
                     new_v=v.transpose(0, 2, 1, 3), new_mask=own[None])
        kv = LayerCache(k=k.astype(c.k.dtype), v=v.astype(c.v.dtype))
        return output_projection(enc, w.o), kv

    x = embed_tokens(weights.embed, tokens, ctx)
    x, new_kv = run_layers(x, weights, attn, ctx)
    if not logits:
        return new_kv
    x = x[jnp.arange(1), length - 1]
    x = rms_norm(x, weights.final_norm, ctx.config.norm_eps)
    return output_logits(x, weights.embed), new_kv
