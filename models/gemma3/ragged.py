"""One ragged forward step over the paged KV cache: the model's one forward pass.

A step is a flat batch of tokens from several sequences (`RaggedBatch`): matmuls run over the flat
tokens; per layer every token's keys and values are stored in the pool first, then each sequence
gathers its pages and attends with one mask rule (`visible_keys`). Numerics are the official
model's. See docs/engine.md, "The paged engine"."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models.gemma3 import model as forward
from models.gemma3.paged_kv import (LayerPages, PagedKV, checked_kv_cache_dtype, gather,
                                     kv_group, rotate_runs, rotates, store)
from models.gemma3.weights import Weights

Array = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """One step's tokens and tables (int32). T tokens, S sequence rows, Q query slots per row,
    Pg / Pl pages per row in the global / local table. Rows 0..n-1 are the step's sequences in
    the order of their runs of tokens (row s's run ends at last[s]); padding rows follow."""

    tokens: Array  # [T] token ids (padding tokens: 0)
    positions: Array  # [T] position of each token in its sequence
    # [T] the last key position each token may attend to: its position (causal), or, for a
    # token of a bidirectional span (an image's tokens), the span's last position.
    visible: Array
    seq: Array  # [T] the token's sequence row (padding: 0)
    col: Array  # [T] the token's index among its row's tokens in this step (padding: 0)
    write_global: Array  # [T] flat slot page * page_size + offset in the global pool
    write_local: Array  # [T] the same in the local pool (padding: slots of scratch page 0)
    queries: Array  # [S, Q] flat index of row s's j-th token (unused: 0, outputs discarded)
    global_table: Array  # [S, Pg] physical pages of logical pages 0..Pg-1 (unused: 0)
    local_table: Array  # [S, Pl] physical pages of logical pages local_first .. +Pl-1
    local_first: Array  # [S]
    last: Array  # [S] flat index of the token whose logits row s returns (unused rows: 0)


# The fields a step's program receives packed into one int32 array (`pack`), in this order;
# `tokens` travels apart, since the overlapped engine computes it on the device.
PACKED_FIELDS = tuple(f.name for f in dataclasses.fields(RaggedBatch) if f.name != "tokens")


def pack(batch) -> np.ndarray:
    """A batch's fields but its tokens (host arrays) as one int32 array: one transfer to the
    device instead of eleven (each costs ~0.1 ms of the host's time on a GPU)."""
    return np.concatenate([np.asarray(getattr(batch, n), np.int32).ravel()
                           for n in PACKED_FIELDS])


def unpack(tokens: jax.Array, packed: jax.Array, shape) -> RaggedBatch:
    """`pack`'s inverse on the device (static slices), for a batch of `shape` (a StepShape)."""
    t, s, q, pg, pl = (shape.tokens, shape.seqs, shape.queries, shape.global_pages,
                       shape.local_pages)
    sizes = {"queries": (s, q), "global_table": (s, pg), "local_table": (s, pl),
             "local_first": (s,), "last": (s,)}
    fields, at = {}, 0
    for name in PACKED_FIELDS:
        dims = sizes.get(name, (t,))
        n = int(np.prod(dims))
        fields[name] = packed[at:at + n].reshape(dims)
        at += n
    return RaggedBatch(tokens=tokens, **fields)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ImageRows:
    """The image features a step's soft tokens take: a separate argument (its own program
    variant, `Program.RAGGED_IMAGES`), so that a text-only step carries and computes nothing."""

    features: Array  # [F, D] projected image features (activation dtype; padding rows: 0)
    index: Array  # [T] int32: the features row of each token, -1 for a text token


def merge_image_rows(x: jax.Array, images: ImageRows) -> jax.Array:
    """x [1, T, D] (token embeddings, already scaled by sqrt(D)) with each soft token's row
    replaced by its feature row (not scaled: the features come out of the projector at the
    text's scale, as transformers and the official library merge them)."""
    index = images.index
    rows = jnp.take(images.features, jnp.maximum(index, 0), axis=0).astype(x.dtype)
    return jnp.where((index >= 0)[None, :, None], rows[None], x)


def visible_keys(key_pos: jax.Array, positions: jax.Array, visible: jax.Array,
                 window: int | None) -> jax.Array:
    """The one mask rule: a query at `positions` that may see up to `visible` attends to a key
    at logical position `key_pos` iff key_pos <= visible and, in a sliding-window layer,
    key_pos > position - W. Broadcasts (e.g. key_pos [S, 1, L] against [S, Q, 1])."""
    mask = key_pos <= visible
    if window is not None:
        mask = mask & (key_pos > positions - window)
    return mask


# -- attention over pages: the XLA form and the Pallas TPU kernel, chosen in one place ----------

def attention_impl(platform: str) -> str:
    """Which paged attention runs on `platform`: the Pallas kernel on TPU; on a GPU "gather"
    (every layer gathers its rows' tables whole: no loop or condition in the step, whose
    trip count or branch the GPU runtime would read back to the host, stalling the dispatch
    of the step until the device reached it); on a CPU "xla" (the global layers read their
    rows' pages a block at a time, as far as the rows hold keys)."""
    return {"tpu": "pallas", "gpu": "gather", "cuda": "gather", "rocm": "gather"}.get(platform, "xla")


def check_kv_cache_dtype(kv_cache_dtype: str, platform: str) -> None:
    """ValueError where the paged attention on `platform` cannot read pools of `kv_cache_dtype`:
    the Pallas TPU kernel reads bfloat16 / float32 pages only, not codes and scales."""
    checked_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype != "auto" and attention_impl(platform) == "pallas":
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} is not served on {platform}: its paged attention "
            f"(the Pallas ragged paged attention kernel) reads unquantized pages only; use "
            f"--kv-cache-dtype auto there (int8 and fp8 KV run on CPU and GPU)")


def paged_attention(q: jax.Array, pages: LayerPages, table: jax.Array, first: jax.Array,
                    batch: RaggedBatch, window: int | None, impl: str = "xla") -> jax.Array:
    """Every token's attention over its row's pages: q [T, Nl, H] (flat, as projected) ->
    [T, Nl, H]. table [S, Pn]: physical pages holding the row's logical pages first[s] ..
    first[s] + Pn - 1. The step's own keys/values are already stored.

    impl "pallas" runs the TPU kernel for causal steps and the XLA form for a step with a
    bidirectional span (`visible` beyond `positions` somewhere), which the kernel's mask cannot
    express: `lax.cond` picks one per step on the device.
    """
    if pages.scale is not None and rotates(pages.kv_cache_dtype):
        # Keys and values stored as runs times M (M M^T = g I): q.k = (q M / g).(k M), and the
        # weighted sum of rotated values, times M^T / g, is the sum of the values. So the
        # queries and outputs of this step are rotated, not the gathered pages.
        qr = rotate_runs(q, dtype=jnp.float32) / kv_group(q.shape[-1])
        out = _paged_attention(qr.astype(q.dtype), pages, table, first, batch, window, impl)
        return rotate_runs(out, inverse=True)
    return _paged_attention(q, pages, table, first, batch, window, impl)


def _paged_attention(q, pages, table, first, batch, window, impl):
    if impl == "gather":
        return _xla_attention(q, pages, table, first, batch, window)
    if impl == "xla":
        if window is None and table.shape[1] % BLOCK_PAGES == 0:
            return _xla_blocked_attention(q, pages, table, batch)
        return _xla_attention(q, pages, table, first, batch, window)
    if impl != "pallas":
        raise ValueError(f"paged attention impl must be 'xla', 'gather' or 'pallas', got {impl!r}")
    causal = jnp.all(batch.visible == batch.positions)
    return lax.cond(causal,
                    lambda: _pallas_attention(q, pages, table, first, batch, window),
                    lambda: _xla_attention(q, pages, table, first, batch, window))


def _xla_attention(q, pages, table, first, batch, window):
    """Gather each row's pages whole and its queries into [S, Q], dense masked attention
    (`attend_gathered`), then back to the flat tokens. Unused table entries point at the
    scratch page, at logical positions the rule rejects (the engine's guarantee)."""
    k, v = gather(pages, table, q.dtype)  # [S, L, Kl, H]
    s, length = k.shape[:2]
    size = pages.page_size
    key_pos = first[:, None] * size + jnp.arange(length, dtype=first.dtype)[None, :]  # [S, L]
    qpos, qvis = batch.positions[batch.queries], batch.visible[batch.queries]  # [S, Q]
    mask = visible_keys(key_pos[:, None, :], qpos[:, :, None], qvis[:, :, None], window)
    out = attend_gathered(q[batch.queries], k, v, mask)  # [S, Q, Nl, H]
    return out[batch.seq, batch.col]


# A global layer's rows read their pages this many at a time (`_xla_blocked_attention`).
BLOCK_PAGES = 8


def _xla_blocked_attention(q, pages, table, batch):
    """A global layer's attention: each row's pages a block of BLOCK_PAGES at a time, in a loop
    that stops after the block holding the farthest key any query sees, with a running softmax
    (max, sum and output rescaled per block, float32). So a step reads the pages its rows
    hold, not every page of the table: one table width (the whole `--max-seq-len`) serves
    every context, and needs one program. A block past a query's last key is masked whole for
    it and changes nothing of it, bit for bit (its weights are exp(K_MASK - max) = 0, the
    rescale exp(0) = 1; the first block holds position 0, which every query sees): so a
    query's result depends on its own keys only, whatever the other rows' lengths or the
    table's width. Unused table entries point at the scratch page (finite values)."""
    s, pn = table.shape
    size = pages.page_size
    span = BLOCK_PAGES * size
    qpos, qvis = batch.positions[batch.queries], batch.visible[batch.queries]  # [S, Q]
    nq = batch.queries.shape[1]
    n, h = q.shape[1:]
    kv_heads = pages.kv.shape[2] // 2
    g = n // kv_heads
    qr = q[batch.queries].reshape(s, nq, kv_heads, g, h)
    blocks = jnp.minimum(jnp.max(qvis) // span + 1, pn // BLOCK_PAGES)

    def body(j, carry):
        top, total, acc = carry  # [S, Kl, G, Q], [S, Kl, G, Q], [S, Kl, G, Q, H]: float32
        k, v = gather(pages, lax.dynamic_slice_in_dim(table, j * BLOCK_PAGES, BLOCK_PAGES, 1),
                      q.dtype)
        key_pos = j * span + jnp.arange(span, dtype=qvis.dtype)
        logits = jnp.einsum("sqkgh,slkh->skgql", qr, k, preferred_element_type=jnp.float32)
        mask = visible_keys(key_pos[None, None, :], qpos[..., None], qvis[..., None], None)
        logits = jnp.where(mask[:, None, None], logits.astype(q.dtype),
                           forward.K_MASK).astype(jnp.float32)  # [S, Kl, G, Q, L]
        new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
        weights = jnp.exp(logits - new_top[..., None])
        rescale = jnp.exp(top - new_top)
        part = jnp.einsum("skgql,slkh->skgqh", weights.astype(q.dtype), v,
                          preferred_element_type=jnp.float32)
        return (new_top, total * rescale + jnp.sum(weights, axis=-1),
                acc * rescale[..., None] + part)

    start = (jnp.full((s, kv_heads, g, nq), forward.K_MASK, jnp.float32),
             jnp.zeros((s, kv_heads, g, nq), jnp.float32),
             jnp.zeros((s, kv_heads, g, nq, h), jnp.float32))
    # The first block outside the loop: its carry then has the loop's types (in a shard_map,
    # values varying over the mesh axis like the pages they come from).
    _, total, acc = lax.fori_loop(1, blocks, body, body(0, start))
    out = (acc / total[..., None]).astype(q.dtype)  # [S, Kl, G, Q, H]
    out = out.transpose(0, 3, 1, 2, 4).reshape(s, nq, n, h)
    return out[batch.seq, batch.col]


def attend_gathered(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention over keys and values as gathered: q [S, Q, Nl, H], k, v
    [S, L, Kl, H], mask [S, Q, L] -> [S, Q, Nl, H]. The dots take the gathered arrays as they
    lie and leave the layout to XLA: transposing them first costs XLA:CPU extra copies of
    every row's pages."""
    s, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(s, t, kv_heads, n // kv_heads, h)
    logits = jnp.einsum("stkgh,slkh->skgtl", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask[:, None, None], logits.astype(q.dtype), forward.K_MASK)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    out = jnp.einsum("skgtl,slkh->stkgh", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(s, t, n, h)


def kernel_metadata(batch: RaggedBatch, first: jax.Array, page_size: int):
    """Our batch as the kernel's metadata: (kv_lens [S], cu_q_lens [S + 1], num_seqs [1]).

    The kernel takes row s's queries as tokens cu_q_lens[s]..cu_q_lens[s+1]-1 at the last
    positions of its kv_len keys, numbered from the table's first page: so kv_len is the
    row's last position + 1 - first * page_size (a local table starts at local_first; the
    window rule is relative, so the shift keeps it). Needs rows in the order of their runs
    and each row's positions consecutive (true of every piece), and causal visibility."""
    num_seqs = jnp.max(batch.seq, keepdims=True) + 1
    ends = batch.last + 1
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends])
    kv_lens = batch.positions[batch.last] + 1 - first * page_size
    rows = jnp.arange(ends.shape[0])
    # Rows past num_seqs are ignored by the kernel; keep them harmless all the same.
    return jnp.where(rows < num_seqs, kv_lens, 0), cu_q_lens, num_seqs.astype(jnp.int32)


def _pallas_attention(q, pages, table, first, batch, window):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    kv_lens, cu_q_lens, num_seqs = kernel_metadata(batch, first, pages.page_size)
    pn = table.shape[1]
    out = ragged_paged_attention(
        q, pages.kv, kv_lens, table, cu_q_lens, num_seqs, sm_scale=1.0,
        sliding_window=window, mask_value=forward.K_MASK,
        # Given, so that the kernel does not look up a tuned size from the device kind.
        num_kv_pages_per_block=min(pn, 8), num_queries_per_block=min(q.shape[0], 32))
    # Tokens past the last row are no query of the kernel's: their output block is never
    # written. Zero them, so that padding stays finite (it is stored in the scratch page).
    real = jnp.arange(q.shape[0]) < cu_q_lens[num_seqs[0]]
    return jnp.where(real[:, None, None], out, jnp.zeros((), out.dtype))


# -- the step -----------------------------------------------------------------------------------

def ragged_step(weights: Weights, kv: PagedKV, batch: RaggedBatch, images: ImageRows | None = None,
                *, ctx: forward.Ctx, logits: bool = True, attention: str = "xla",
                every_token: bool = False):
    """The step (module docstring), on this device's shards. `images`: the features of the
    step's image soft tokens (their `visible` reaches their image's last soft token). Returns float32 logits [S, Vl]
    over this device's vocabulary rows at each row's `last` token (None with logits=False: a
    step of prompt pieces that sample nothing skips reading the embedding table) and the
    updated pages. `attention`: `attention_impl` of the platform. every_token=True (prompt
    logprobs) returns (logits [S, Vl], logits [T, Vl] at every token, pages): the row logits
    are computed exactly as without it, so the step's sampling does not change."""
    b = batch
    positions = b.positions[None, :]  # [1, T]
    origin = jnp.zeros_like(b.local_first)
    layers = list(kv.layers)

    def attn(x, w, layer, kind):
        q, k, v = forward.project_qkv(x, w, positions, kind, ctx)  # [1, T, *, H]
        glob = kind == "global"
        pages = store(layers[layer], b.write_global if glob else b.write_local, k[0], v[0])
        layers[layer] = pages
        enc = paged_attention(q[0], pages, b.global_table if glob else b.local_table,
                              origin if glob else b.local_first, b,
                              None if glob else ctx.config.sliding_window, attention)
        return forward.output_projection(enc[None], w.o), None

    x = forward.embed_tokens(weights.embed, b.tokens[None, :], ctx)
    if images is not None:
        x = merge_image_rows(x, images)
    x, _ = forward.run_layers(x, weights, attn, ctx)
    out = None
    if logits:
        last = forward.rms_norm(x[0][b.last], weights.final_norm, ctx.config.norm_eps)
        out = forward.output_logits(last, weights.embed)
    pages = PagedKV(layers=tuple(layers), kinds=kv.kinds)
    if every_token:
        every = forward.rms_norm(x[0], weights.final_norm, ctx.config.norm_eps)
        return out, forward.output_logits(every, weights.embed), pages
    return out, pages


# -- an image span a layer at a time ---------------------------------------------------------------
# An image's soft tokens attend to each other both ways, so at every layer a span token's query
# needs the keys of the span tokens after it. Computing the span in query pieces across steps is
# right only if those keys are already stored, and a layer's keys depend on the layer before's
# attention over the whole span: so the span moves through the layers together, one layer at a
# time (all its keys stored, then its rows in blocks), in programs small enough to run between
# steps (serving/image_spans.py). Same functions as `ragged_step`, on fewer rows.

def span_kv(w, pages: LayerPages, x: jax.Array, positions: jax.Array, write: jax.Array, *,
            kind: str, ctx: forward.Ctx) -> LayerPages:
    """Stores one layer's keys and values of a span's rows: x [N, D] the rows' residual
    stream entering the layer, positions [N], write [N] their flat slots in this layer's pool
    (padding rows: the scratch page)."""
    h = forward.rms_norm(x[None], w.pre_attn_norm, ctx.config.norm_eps)
    _, k, v = forward.project_qkv(h, w, positions[None], kind, ctx)
    return store(pages, write, k[0], v[0])


def span_rows(w, pages: LayerPages, x: jax.Array, batch: RaggedBatch, start: jax.Array, *,
              kind: str, ctx: forward.Ctx) -> jax.Array:
    """x [N, D] with rows start..start+R-1 (R: batch's tokens, one sequence row whose queries
    are those rows) moved through the layer, their queries attending to the keys `span_kv`
    stored (`visible`: the span's last position). The rest of the block is `model.block`'s."""
    rows = batch.tokens.shape[0]
    glob = kind == "global"

    def attn(h, w, layer, kind):
        q, _, _ = forward.project_qkv(h, w, batch.positions[None], kind, ctx)
        enc = paged_attention(q[0], pages, batch.global_table if glob else batch.local_table,
                              jnp.zeros_like(batch.local_first) if glob else batch.local_first,
                              batch, None if glob else ctx.config.sliding_window, "xla")
        return forward.output_projection(enc[None], w.o), None

    xr = lax.dynamic_slice_in_dim(x, start, rows, 0)[None]
    out, _ = forward.block(xr, w, -1, kind, attn, ctx)
    return lax.dynamic_update_slice_in_dim(x, out[0].astype(x.dtype), start, 0)
