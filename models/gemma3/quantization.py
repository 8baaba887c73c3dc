"""Weight-only quantization (`--quantization int8|fp8`, vLLM's flag): each linear layer's weight
as a `QuantizedArray`, 8-bit codes (int8 or float8_e4m3fn) in the weight's own shape and a scale
in the weight's dtype whose shape divides the codes': per output channel (group size 0: the
contracted dims set to 1, e.g. q [D, N, H] -> [1, N, H]) or per G values along the innermost
contracted dim (`--quantization-group-size`, e.g. q [D/G, N, H]). Symmetric: absmax / 127 with
the codec's round-half-even (`equarx.codec_spec`), or absmax / 448 and e4m3's rounding; the
scale is rounded to the weight's dtype first, so dequantizing gives exactly codes * scale.
`model.matmul` runs the products; norms, the embedding and the vision tower stay unquantized
(`QUANTIZED_FIELDS`). See docs/deployment.md, "Quantized weights"."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from equarx.codec_spec import CODES, round_int8
from models.gemma3.weights import Weights

Array = Any

QUANTIZATIONS = ("none", "int8", "fp8")
CODE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}

# Each quantized tensor's contracted dims (its scale has size 1 there).
CONTRACTED: dict[str, tuple[int, ...]] = {
    "q": (0,), "kv": (0,), "o": (0, 1), "gating": (0,), "linear": (0,), "embed": (1,)}
# The tensors quantized: every linear layer. The tied embedding / logits matrix can be (its
# QuantizedArray serves the lookup and the logits), but stays unquantized, as vLLM's fp8 keeps
# its embedding and lm_head: on the 270M it doubled the KL to the unquantized model and XLA:CPU
# would convert the whole table every step (docs/deployment.md, "Quantized weights").
QUANTIZED_FIELDS = ("q", "kv", "o", "gating", "linear")


def check_quantization(quantization: str, group_size: int = 0) -> str:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                         f"{quantization!r}")
    if group_size < 0 or group_size & (group_size - 1) or (group_size and quantization == "none"):
        raise ValueError(f"quantization_group_size must be 0 (a scale per output channel) or a "
                         f"power of two with int8 or fp8 weights, got {group_size} with "
                         f"quantization={quantization}")
    return quantization


def check_group_size(shapes: Weights, specs: Weights, tp: int, group_size: int) -> None:
    """ValueError unless `group_size` divides each quantized weight's innermost contracted dim
    on every shard (`shapes` global, `specs` their PartitionSpecs at `tp`)."""
    if not group_size:
        return
    for name in QUANTIZED_FIELDS:
        shape, spec = getattr(shapes.layers[0], name).shape, getattr(specs.layers[0], name)
        g = max(CONTRACTED[name])
        local = shape[g] // (tp if g < len(spec) and spec[g] is not None else 1)
        if local % group_size:
            raise ValueError(f"quantization_group_size {group_size} does not divide the {name} "
                             f"weight's contracted dim {g} (shape {tuple(shape)}: {local} values "
                             f"a shard at tp={tp})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """codes * scale: codes int8 or float8_e4m3fn in the weight's shape, scale in the weight's
    dtype, each dim of it 1, the codes' or a divisor of it (groups: module docstring)."""

    codes: Array
    scale: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def dtype(self):
        """The dtype it dequantizes to (the unquantized weight's)."""
        return self.scale.dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes) + _nbytes(self.scale)

    def dequantize(self, dtype=None) -> jax.Array:
        """codes * scale in float32, rounded to `dtype` (default: the weight's)."""
        scale = expand_scale(self.scale.astype(jnp.float32), self.codes.shape)
        return (self.codes.astype(jnp.float32) * scale).astype(dtype or self.dtype)


def expand_scale(scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A scale broadcastable to `shape`: each entry repeated over its group's values."""
    for i, (s, n) in enumerate(zip(scale.shape, shape)):
        if s not in (1, n):
            scale = jnp.repeat(scale, n // s, axis=i)
    return scale


def _nbytes(x) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def scale_shape(shape: tuple[int, ...], contracted: tuple[int, ...],
                group_size: int = 0) -> tuple[int, ...]:
    if group_size:  # groups along the innermost contracted dim
        return tuple(n // group_size if i == max(contracted) else n for i, n in enumerate(shape))
    return tuple(1 if i in contracted else n for i, n in enumerate(shape))


def quantize(w: jax.Array, quantization: str, contracted: tuple[int, ...],
             group_size: int = 0) -> QuantizedArray:
    """w as codes of `quantization` ("int8" or "fp8") with one symmetric scale per output
    channel (the absmax over the `contracted` dims), or with a group size, per `group_size`
    consecutive values along the innermost contracted dim."""
    code_max = CODES[quantization]
    w32 = w.astype(jnp.float32)
    if group_size:
        g = max(contracted)
        split = w32.reshape(*w.shape[:g], w.shape[g] // group_size, group_size, *w.shape[g + 1:])
        amax = jnp.max(jnp.abs(split), axis=g + 1)
    else:
        amax = jnp.max(jnp.abs(w32), axis=contracted, keepdims=True)
    scale = (amax / code_max).astype(w.dtype)
    s32 = expand_scale(scale.astype(jnp.float32), w.shape)
    # A rounded-down scale may put the absmax a fraction past the largest code: clipped.
    v = jnp.clip(w32 / jnp.where(s32 > 0, s32, 1.0), -code_max, code_max)
    codes = round_int8(v) if quantization == "int8" else v.astype(CODE_DTYPES["fp8"])
    return QuantizedArray(codes=codes, scale=scale)


def map_quantized(weights: Weights, fn: Callable[[str, Any], Any],
                  fields: tuple[str, ...] = QUANTIZED_FIELDS) -> Weights:
    """`weights` with fn(name, leaf) in place of each of the quantized `fields`' leaves."""
    layer_fields = [f for f in fields if f != "embed"]
    layers = tuple(dataclasses.replace(lw, **{f: fn(f, getattr(lw, f)) for f in layer_fields})
                   for lw in weights.layers)
    embed = fn("embed", weights.embed) if "embed" in fields else weights.embed
    return dataclasses.replace(weights, embed=embed, layers=layers)


def _scale_spec(name: str, s: P, group_size: int) -> P:
    """A scale's PartitionSpec: the weight's, but unsharded on per-channel size-1 dims."""
    if group_size:
        return s
    return P(*(None if i in CONTRACTED[name] else a for i, a in enumerate(s)))


def quantized_specs(specs: Weights, quantization: str, group_size: int = 0) -> Weights:
    """The PartitionSpecs of quantized weights from the unquantized ones: codes as the weight,
    the scale too, but unsharded on its size-1 (contracted) dims when per channel."""
    if quantization == "none":
        return specs
    return map_quantized(specs, lambda name, s: QuantizedArray(
        codes=s, scale=_scale_spec(name, s, group_size)))


def quantized_shapes(shapes: Weights, quantization: str, group_size: int = 0) -> Weights:
    """ShapeDtypeStructs (shardings kept where given, scales' as `quantized_specs`) of
    quantized weights from the unquantized ones'."""
    if quantization == "none":
        return shapes
    code = CODE_DTYPES[quantization]

    def shape(name, s: jax.ShapeDtypeStruct):
        sharding = getattr(s, "sharding", None)
        scale_sharding = None
        if sharding is not None:
            scale_sharding = NamedSharding(sharding.mesh,
                                           _scale_spec(name, sharding.spec, group_size))
        return QuantizedArray(
            codes=jax.ShapeDtypeStruct(s.shape, code, sharding=sharding),
            scale=jax.ShapeDtypeStruct(scale_shape(s.shape, CONTRACTED[name], group_size),
                                       s.dtype, sharding=scale_sharding))

    return map_quantized(shapes, shape)


def weights_summary(weights: Weights, quantization: str, group_size: int = 0) -> dict:
    """What /health reports of a model's weights: their bytes on the devices (all shards of
    one copy, scales included), the dtype of the linear layers' values, the quantization and
    its group size (0: a scale per output channel)."""
    total = sum(_nbytes(x) for x in jax.tree.leaves(weights))
    dtype = (CODE_DTYPES[quantization] if quantization != "none"
             else jnp.dtype(weights.final_norm.dtype))
    return {"bytes": int(total), "dtype": dtype.name, "quantization": quantization,
            "group_size": group_size}


TPU_GROUPED_MAX_C = 16384  # widest C the kernel takes (wider outgrows a TPU v4's VMEM)


def tpu_grouped_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array,
                       interpret: bool = False) -> jax.Array:
    """x [R, C] times grouped int8 codes [C, N] (scales [C / G, N]) -> float32 [R, N], a Pallas
    TPU kernel: a column block of codes read as int8, dequantized in VMEM once (as
    `QuantizedArray.dequantize`), meets every block of x's rows on the MXU. XLA's form (kept for
    C over TPU_GROUPED_MAX_C) writes and reads a dequantized copy of the weight in HBM each step."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    (r, c), n, g = x.shape, codes.shape[1], x.shape[1] // scale.shape[0]
    if c > TPU_GROUPED_MAX_C:
        w = QuantizedArray(codes, scale).dequantize(x.dtype)
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    fits = [d for d in range(128, n + 1, 128) if n % d == 0 and c * d <= 1 << 20]
    bn = max(fits) if fits else (128 if n % 128 == 0 else n)  # codes a block: ~1M values
    bm = min(256, max(16, (1 << 19) // c // 16 * 16), -(-r // 16) * 16)  # x a block: ~512K
    rows = -(-r // bm) * bm
    # Rows dequantized at once: all, or (large C) runs of whole 16-row tiles of scales.
    chunk = c if c * bn <= 1 << 20 else max(
        [d for d in range(16 * g, c, 16 * g) if c % d == 0 and d * bn <= 1 << 20] or [c])

    def kernel(x_ref, codes_ref, scale_ref, out_ref, w_ref):
        @pl.when(pl.program_id(1) == 0)  # the column block's weights, dequantized once
        def _():
            def part(k, carry):
                runs = codes_ref[pl.ds(k * chunk, chunk), :].astype(jnp.float32)
                scales = scale_ref[pl.ds(k * (chunk // g), chunk // g), :].astype(jnp.float32)
                w = runs.reshape(chunk // g, g, bn) * scales[:, None, :]
                w_ref[pl.ds(k * chunk, chunk), :] = w.reshape(chunk, bn).astype(w_ref.dtype)
                return carry

            jax.lax.fori_loop(0, c // chunk, part, 0)
        out_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    # Inside shard_map: operands and result vary over the same mesh axes (their union).
    axes = [set(getattr(getattr(jax.typeof(a), "manual_axis_type", None), "varying", ()))
            for a in (x, codes, scale)]
    missing = [tuple(sorted(set().union(*axes) - v)) for v in axes]
    x, codes, scale = (jax.lax.pcast(a, m, to="varying") if m else a
                       for a, m in zip((x, codes, scale), missing))
    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(
        (rows, n), jnp.float32, manual_axis_type=getattr(jax.typeof(x), "manual_axis_type", None)),
        grid=(n // bn, rows // bm),
        in_specs=[pl.BlockSpec((bm, c), lambda j, i: (i, 0)),
                  pl.BlockSpec((c, bn), lambda j, i: (0, j)),
                  pl.BlockSpec((c // g, bn), lambda j, i: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda j, i: (i, j)),
        scratch_shapes=[pltpu.VMEM((c, bn), x.dtype)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=32 << 20),
        cost_estimate=pl.CostEstimate(flops=2 * rows * c * n, transcendentals=0, bytes_accessed=(
            x.nbytes + codes.nbytes + scale.nbytes + 4 * rows * n)),
        interpret=interpret,
    )(jnp.pad(x, ((0, rows - r), (0, 0))), codes, scale)
    return out[:r]
