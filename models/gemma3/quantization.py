"""Weight-only quantization (`--quantization int8|fp8`, vLLM's flag): the linear layers' weights
stored as 8-bit codes with one scale per output channel, dequantized inside the matmuls.

A `QuantizedArray` holds codes (int8, or float8_e4m3fn) in the weight's own shape and layout and
a scale in the weight's dtype, of the weight's shape with its contracted dims set to 1
("keepdims" form): q [D, N, H] -> [1, N, H], kv [D, 2, K, H] -> [1, 2, K, H], o [N, H, D] ->
[1, 1, D], gating [D, 2, F] -> [1, 2, F], linear [F, D] -> [1, D]; an embedding [V, D] would
take [V, 1] (a row's scale serves the lookup and, vocabulary rows being the logits' output
channels, the tied output projection). So a product reads 8-bit codes, converts them to the activations' dtype
(exact: int8 and e4m3 values are bfloat16 values), accumulates in float32 and multiplies by the
output channel's scale once (`model.matmul`). Norms, the embedding and the vision tower stay
unquantized (`QUANTIZED_FIELDS`).

Symmetric scales: absmax / 127 with the codec's round-half-even (`equarx.codec_spec`) for int8,
absmax / 448 and e4m3's own rounding for fp8. The scale is rounded to the weight's dtype first
and the codes are of the stored scale, so dequantizing gives exactly codes * scale.
"""
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


def check_quantization(quantization: str) -> str:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                         f"{quantization!r}")
    return quantization


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """codes * scale: codes int8 or float8_e4m3fn in the weight's shape, scale in the weight's
    dtype with size 1 on the contracted dims (module docstring)."""

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

    def dequantize(self) -> jax.Array:
        return (self.codes.astype(jnp.float32) * self.scale.astype(jnp.float32)).astype(self.dtype)


def _nbytes(x) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def scale_shape(shape: tuple[int, ...], contracted: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in contracted else n for i, n in enumerate(shape))


def quantize(w: jax.Array, quantization: str, contracted: tuple[int, ...]) -> QuantizedArray:
    """w as codes of `quantization` ("int8" or "fp8") with one symmetric scale per output
    channel (the absmax over the `contracted` dims)."""
    code_max = CODES[quantization]
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=contracted, keepdims=True)
    scale = (amax / code_max).astype(w.dtype)
    s32 = scale.astype(jnp.float32)
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


def quantized_specs(specs: Weights, quantization: str) -> Weights:
    """The PartitionSpecs of quantized weights from the unquantized ones: codes as the weight,
    the scale as the weight but unsharded on its size-1 (contracted) dims."""
    if quantization == "none":
        return specs

    def spec(name, s: P):
        scale = P(*(None if i in CONTRACTED[name] else a for i, a in enumerate(s)))
        return QuantizedArray(codes=s, scale=scale)

    return map_quantized(specs, spec)


def quantized_shapes(shapes: Weights, quantization: str) -> Weights:
    """ShapeDtypeStructs (shardings kept where given, scales' as `quantized_specs`) of
    quantized weights from the unquantized ones'."""
    if quantization == "none":
        return shapes
    code = CODE_DTYPES[quantization]

    def shape(name, s: jax.ShapeDtypeStruct):
        sharding = getattr(s, "sharding", None)
        scale_sharding = None
        if sharding is not None:
            scale_sharding = NamedSharding(sharding.mesh, P(*(
                None if i in CONTRACTED[name] else a for i, a in enumerate(sharding.spec))))
        return QuantizedArray(
            codes=jax.ShapeDtypeStruct(s.shape, code, sharding=sharding),
            scale=jax.ShapeDtypeStruct(scale_shape(s.shape, CONTRACTED[name]), s.dtype,
                                       sharding=scale_sharding))

    return map_quantized(shapes, shape)


def weights_summary(weights: Weights, quantization: str) -> dict:
    """What /health reports of a model's weights: their bytes on the devices (all shards of
    one copy), the dtype of the linear layers' values, and the quantization."""
    total = sum(_nbytes(x) for x in jax.tree.leaves(weights))
    dtype = (CODE_DTYPES[quantization] if quantization != "none"
             else jnp.dtype(weights.final_norm.dtype))
    return {"bytes": int(total), "dtype": dtype.name, "quantization": quantization}
