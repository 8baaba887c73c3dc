"""Gemma 3 forward pass as pure functions over this device's shards (run inside `jax.shard_map`).

Every function sees local shapes (heads, FFN units and vocabulary rows divided by tp), so the
attention output and MLP down projections yield partial sums, each reduced by `equarx.all_reduce`.
Numerics follow the official implementation (gemma/gm/nn/_modules.py), cast for cast. The attention
over pages is ragged.py's."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from equarx import AllReduceConfig, all_reduce, native_cpu
from models.gemma3.config import Gemma3Config
from models.gemma3.quantization import QuantizedArray, expand_scale, tpu_grouped_matmul
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
        x = _take_rows(table, tokens)
    else:
        local = tokens - lax.axis_index(ctx.axes) * rows
        inside = (local >= 0) & (local < rows)
        x = _take_rows(table, jnp.where(inside, local, 0))
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


def matmul(spec: str, x: jax.Array, w) -> jax.Array:
    """einsum of activations x [rows, ...] with a weight (an array, or a `QuantizedArray`),
    float32 accumulation, x's dtype out.

    Why not a plain einsum: XLA:CPU runs bfloat16 matrix-vector products (decode at batch 1)
    through a slow path, ~10x slower than the same product with 2 rows, and a bfloat16-output
    dot is slower than a float32-output one. So one-row products get a duplicate row, and the
    dot accumulates and returns float32 before the cast (what XLA does inside a bf16 dot anyway).
    Quantized weights: `_quantized_product`, by the platform the program is compiled for.
    """
    if isinstance(w, QuantizedArray):
        return _quantized_product(spec, x, w).astype(x.dtype)
    return _dot(spec, x, w).astype(x.dtype)


def _dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """The float32 einsum, a one-row x given a duplicate row (`matmul`)."""
    single = x.shape[0] == 1 and int(np.prod(x.shape[1:-1])) == 1
    if single:
        x = jnp.concatenate([x, x], axis=0)
    out = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    return out[:1] if single else out


def _quantized_product(spec: str, x: jax.Array, w: QuantizedArray) -> jax.Array:
    """The float32 product of x with 8-bit codes and scales, by the platform compiled for
    (`lax.platform_dependent`). Per channel, int8: one integer dot on CPU and TPU (`_int8_product`,
    the MXU's int8 path), else codes converted beside the dot; the scale on the product. Grouped
    int8 (`_flat_groups`): native CPU and Pallas TPU kernels, else dequantized in the program."""
    if not _per_channel(spec, w.scale):
        def dequantized(x, codes, scale):
            return _dot(spec, x, QuantizedArray(codes, scale).dequantize(x.dtype))

        if not _flat_groups(spec, w):
            return dequantized(x, w.codes, w.scale)
        kernels = {"tpu": tpu_grouped_matmul}
        if native_cpu.in_use():  # built (the kernel has no slow one-row path)
            kernels["cpu"] = lambda x, codes, scale: native_cpu.grouped_matmul(
                x.astype(jnp.float32), codes, scale)
        flat = {p: functools.partial(_grouped_product, spec, kernel)
                for p, kernel in kernels.items()}
        return lax.platform_dependent(x, w.codes, w.scale, default=dequantized, **flat)

    def converted(x, codes):
        return _dot(spec, x, codes.astype(x.dtype))

    if w.codes.dtype == jnp.int8 and _leading(spec):
        int8 = functools.partial(_int8_product, spec)
        out = lax.platform_dependent(x, w.codes, default=converted, cpu=int8, tpu=int8)
    else:
        out = converted(x, w.codes)
    return out * _output_scale(spec, w.scale)


def _per_channel(spec: str, scale: jax.Array) -> bool:
    """Whether a quantized weight's scale has size 1 on every dim `spec` contracts."""
    inputs, out = spec.replace(" ", "").split("->")
    return all(n == 1 for d, n in zip(inputs.split(",")[1], scale.shape) if d not in out)


def _leading(spec: str) -> bool:
    """Whether `spec` contracts x's last dims with the weight's first ones, in order."""
    inputs, out = spec.replace(" ", "").split("->")
    x_dims, w_dims = inputs.split(",")
    shared = "".join(d for d in w_dims if d in x_dims and d not in out)
    return bool(shared) and w_dims.startswith(shared) and x_dims.endswith(shared)


def _flat_groups(spec: str, w: QuantizedArray) -> bool:
    """Whether a grouped product runs as x [R, C] times codes [C, N], scales [C / G, N] (the
    kernels' form): int8 codes, contracted dims leading, groups runs of the flattened C. The
    CPU kernel runs at every row count, so a token's product is the same in any step."""
    k = _contracted(spec)
    if w.codes.dtype != jnp.int8 or not _leading(spec):
        return False
    s, c = w.scale.shape, w.codes.shape
    return s[k:] == c[k:] and s[:k - 1] == c[:k - 1]


def _contracted(spec: str) -> int:
    inputs, out_dims = spec.replace(" ", "").split("->")
    x_dims, w_dims = inputs.split(",")
    return sum(1 for d in w_dims if d in x_dims and d not in out_dims)


def _grouped_product(spec: str, kernel, x: jax.Array, codes: jax.Array,
                     scale: jax.Array) -> jax.Array:
    """The float32 product of x with grouped int8 weights (`_flat_groups`) through `kernel`
    (x [R, C], codes [C, N], scales [C / G, N] -> float32 [R, N])."""
    k = _contracted(spec)
    c = int(np.prod(codes.shape[:k]))
    out = kernel(x.reshape(-1, c), codes.reshape(c, -1), scale.reshape(-1, codes.size // c))
    return out.reshape(*x.shape[:x.ndim - k], *codes.shape[k:])


# x's rows as integers of 15 bits, two int8 halves: q = 128 * hi + lo, |q| <= 127 * 128.
_ROW_CODE_MAX = 127.0 * 128.0


def _int8_product(spec: str, x: jax.Array, codes: jax.Array) -> jax.Array:
    """The float32 product of x with int8 codes as one int8 x int8 -> int32 dot (XLA:CPU
    converts a whole int8 weight to bfloat16 before a dot, every step, which made a decode
    step ~2x slower than with bfloat16 weights; its integer dots are about as fast as bfloat16
    ones). Each row of x (one token's values: no other token changes them) is scaled to 15-bit
    integers split into high and low int8 halves, exactly, which meet the codes as rows of one
    dot; the rounding to that grid, at most absmax / 32512 a value, is far below the weights'
    own quantization error. Integer sums are exact: a row's result is the same in any batch."""
    k = _contracted(spec)
    c = int(np.prod(codes.shape[:k]))
    x2 = x.reshape(-1, c).astype(jnp.float32)
    step = jnp.max(jnp.abs(x2), axis=-1, keepdims=True) / _ROW_CODE_MAX
    q = jnp.round(x2 / jnp.where(step > 0, step, 1.0))
    hi = jnp.round(q / 128.0)
    lo = q - 128.0 * hi  # |lo| <= 64
    w2 = codes.reshape(c, -1)
    dims = (((1,), (0,)), ((), ()))

    rows = x2.shape[0]
    # Both halves in one dot: the weight is read once.
    both = lax.dot_general(jnp.concatenate([hi, lo]).astype(jnp.int8), w2, dims,
                           preferred_element_type=jnp.int32).astype(jnp.float32)
    out = (both[:rows] * 128.0 + both[rows:]) * step
    return out.reshape(*x.shape[:x.ndim - k], *codes.shape[k:])


def _output_scale(spec: str, scale: jax.Array) -> jax.Array:
    """A quantized weight's keepdims scale as float32 over the product's trailing dims: in
    every spec used, the weight's dims that are not contracted end the output, in order."""
    inputs, out = spec.replace(" ", "").split("->")
    w_dims = inputs.split(",")[1]
    kept = "".join(d for d in w_dims if d in out)
    if not out.endswith(kept):
        raise ValueError(f"{spec}: the weight's output dims must end the result")
    shape = [n for d, n in zip(w_dims, scale.shape) if d in out]
    return scale.reshape(shape).astype(jnp.float32)


def _take_rows(table, ids: jax.Array) -> jax.Array:
    """table[ids] (rows of an embedding table, quantized or not) in the table's dtype."""
    if isinstance(table, QuantizedArray):
        codes = jnp.take(table.codes, ids, axis=0).astype(jnp.float32)
        scale = jnp.take(table.scale, ids, axis=0).astype(jnp.float32)
        return (codes * expand_scale(scale, codes.shape)).astype(table.dtype)
    return jnp.take(table, ids, axis=0)


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
    head = lax.axis_index(ctx.axes) // per_head
    if isinstance(kv, QuantizedArray):  # the scale [1 or D/G, 2, K, H] is per KV head too
        return QuantizedArray(codes=lax.dynamic_slice_in_dim(kv.codes, head, 1, axis=2),
                              scale=lax.dynamic_slice_in_dim(kv.scale, head, 1, axis=2))
    return lax.dynamic_slice_in_dim(kv, head, 1, axis=2)


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


def output_projection(enc: jax.Array, w_o: jax.Array) -> jax.Array:
    """[B, T, Nl, H] x [Nl, H, D] -> partial sums [B, T, D], as one 2-D matmul (heads and
    head_dim flattened together: a two-dim contraction made XLA copy w_o into another order)."""
    b, t, n, h = enc.shape
    d = w_o.shape[-1]
    if isinstance(w_o, QuantizedArray):  # scale [1, 1, D] or [Nl, H/G, D] -> [-1, D]
        w_o = QuantizedArray(codes=w_o.codes.reshape(n * h, d), scale=w_o.scale.reshape(-1, d))
    else:
        w_o = w_o.reshape(n * h, d)
    return matmul("btk,kd->btd", enc.reshape(b, t, n * h), w_o)


def mlp(x: jax.Array, w: LayerWeights) -> jax.Array:
    """gelu_tanh(gate) * up, then the (partial) down projection. [B, T, D] -> [B, T, D]."""
    gate = matmul("btd,dcf->btcf", x, w.gating)
    hidden = jax.nn.gelu(gate[..., 0, :], approximate=True) * gate[..., 1, :]
    return matmul("btf,fd->btd", hidden, w.linear)


# attn(x, w, layer, kind) -> (partial output, anything the caller keeps of the layer): `layer`
# is the layer's index, for its pages.
AttnFn = Callable[[jax.Array, LayerWeights, int, str], tuple[jax.Array, object]]


def block(x: jax.Array, w: LayerWeights, layer: int, kind: str, attn: AttnFn,
          ctx: Ctx) -> tuple[jax.Array, object]:
    """One transformer block: (pre-norm, attention, post-norm, residual) then the same for the MLP."""
    eps = ctx.config.norm_eps
    attn_out, new_kv = attn(rms_norm(x, w.pre_attn_norm, eps), w, layer, kind)
    x = rms_norm(_reduce(attn_out, ctx), w.post_attn_norm, eps) + x
    ffw_out = mlp(rms_norm(x, w.pre_ffw_norm, eps), w)
    return rms_norm(_reduce(ffw_out, ctx), w.post_ffw_norm, eps) + x, new_kv


def run_layers(x: jax.Array, weights: Weights, attn: AttnFn,
               ctx: Ctx) -> tuple[jax.Array, tuple]:
    """All blocks in order (a Python loop: one HLO copy per layer, see weights.py for why).
    Returns the activations and every layer's new keys and values."""
    new_kv = []
    for i, w in enumerate(weights.layers):
        x, kv = block(x, w, i, _layer_kind(ctx, i), attn, ctx)
        new_kv.append(kv)
    return x, tuple(new_kv)


def _layer_kind(ctx: Ctx, layer: int) -> str:
    return "global" if ctx.config.is_global(layer) else "local"
