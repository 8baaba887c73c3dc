"""The token-local group codec (blocks="group") in XLA ops: what TPU programs and every fallback
run.

The codec itself is specified in equarx.codec_spec; this module applies the rotation to messages and
sends each operation to the backend equarx.backends picks. Every backend gives these values bit for
bit, a NaN's own payload and sign aside (docs/algorithm.md, "Version 2")."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from equarx import backends, native_cpu, triton_codecs
from equarx.codec_spec import codes_f32, rotation
from equarx.codec_spec import encode as _encode
from equarx.codec_spec import row_scales as _row_scales


def _times(v: jax.Array, m: np.ndarray, fence_out: bool = True,
           own_matrix: bool = False) -> jax.Array:
    """f32[n, g] times the g x g matrix m, as a kernel of its own (what each choice below once
    cost or saved: docs/results.md, "Why the rotation's product is written as it is").

    On the CPU a broadcast product summed over a fixed axis, not a dot: XLA:CPU picks its dot
    kernel, and so its summation order, by the row count, which would make a row's result
    depend on the message's length. The barriers keep XLA from fusing it into the layout's
    slices and copies around it. `fence_out=False` leaves the output open to its
    consumer (after the all-gather a slice and a cast, which then need no pass of their own).
    `own_matrix=True` passes the matrix through the barrier with the values, so that XLA's CSE
    does not merge several rotations' broadcasts of it into one array written out on every
    call; the forward rotation keeps the shared broadcast, because its own would change its
    bits in a model program (the reduce's order). Off the CPU a float32 dot (the summed form
    is slow on a GPU); integer codes (`unrotate_codes`) sum exactly in any order either way."""
    if own_matrix:
        v, mat = lax.optimization_barrier((v, jnp.asarray(m)))
    else:
        v, mat = lax.optimization_barrier(v), jnp.asarray(m)

    def summed(v, mat):
        return jnp.sum(v[:, :, None] * mat[None], axis=1)

    def dot(v, mat):
        return jnp.dot(v, mat, precision=lax.Precision.HIGHEST)

    out = lax.platform_dependent(v, mat, cpu=summed, default=dot)
    return lax.optimization_barrier(out) if fence_out else out


def butterflies(v: jax.Array) -> jax.Array:
    """f32[n, g] times the g x g Sylvester Hadamard matrix H, as log2(g) stages of sums and
    differences of pairs: elementwise, so a row's bits never depend on the row count on any
    backend (a dot's kernel, and so its summation order, may change with the number of rows).
    M = D H, so v M = butterflies(v * signs) and v M^T = butterflies(v) * signs."""
    n, g = v.shape
    h = g // 2
    while h >= 1:
        pairs = v.reshape(n, g // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        v = jnp.stack([a + b, a - b], axis=2).reshape(n, g)
        h //= 2
    return v


def to_f32(x: jax.Array) -> jax.Array:
    """x as float32. bfloat16 by its bits (the same values): a plain convert fuses into the
    rotation's reduce, which XLA:CPU then runs 2-5x slower than on float32 input."""
    if x.dtype == jnp.bfloat16:
        bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
        return lax.bitcast_convert_type(bits, jnp.float32)
    return x.astype(jnp.float32)


def rotate(x: jax.Array, g: int) -> jax.Array:
    """f[..., R] -> f32[..., R]: each run of g values times M (unnormalized: |.| grows by
    sqrt(g))."""
    return _times(to_f32(x).reshape(-1, g), rotation(g)).reshape(x.shape)


def unrotate(y: jax.Array, g: int) -> jax.Array:
    """Inverse of `rotate`: each run times M^T / g (g a power of two: the division is exact)."""
    return _times(y.astype(jnp.float32).reshape(-1, g), rotation(g).T / g,
                  fence_out=False, own_matrix=True).reshape(y.shape)


def fold_rotation(w: jax.Array, g: int) -> jax.Array:
    """A weight w[..., D] whose products x @ w are partial sums to reduce, with the rotation
    folded in: each run of g output columns times M (so x @ fold_rotation(w) = rotate(x @ w)
    up to rounding), in w's dtype. `all_reduce(..., rotated=True)` then skips its forward
    rotation: one g x g product per value less at every call, paid once per weight here
    (Gemma's attention output and MLP down projections, see models/gemma3/programs.py)."""
    if w.shape[-1] % g:
        raise ValueError(f"fold_rotation needs a last axis that is a multiple of {g}, "
                         f"got {w.shape}")
    runs = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // g, g)
    out = jnp.einsum("...i,ij->...j", runs, jnp.asarray(rotation(g)),
                     precision=lax.Precision.HIGHEST)
    return out.reshape(w.shape).astype(w.dtype)


def rotate_rows(x: jax.Array, g: int) -> jax.Array:
    """A message's rows (its last axis), zero-padded to a multiple of g, rotated:
    f[..., D] -> f32[T, ceil(D / g) g]."""
    d = x.shape[-1] if x.ndim else 1
    rows = x.reshape(-1, d)
    rows = jnp.pad(rows, ((0, 0), (0, -d % g)))
    return rotate(rows, g)


def message_rows(x: jax.Array, g: int, rotated: bool) -> jax.Array:
    """The rows a schedule splits, rotated: `rotate_rows(x, g)`, or, for a message whose rows
    already carry the rotation (`all_reduce(..., rotated=True)`), x's rows as float32."""
    return to_f32(x).reshape(-1, x.shape[-1]) if rotated else rotate_rows(x, g)


def unrotate_rows(rows: jax.Array, g: int, shape: tuple[int, ...]) -> jax.Array:
    """f32[T, >= ceil(D / g) g] -> f32 of `shape` (D = shape[-1]): the inverse of rotate_rows."""
    d = shape[-1] if shape else 1
    width = d + (-d % g)
    return unrotate(rows[:, :width], g)[:, :d].reshape(shape)


def encode(x: jax.Array, g: int, code: str) -> jax.Array:
    """`codec_spec.encode` (f32/bf16[B, ..., R] -> int8[B, N], the wire), by the backend
    equarx.backends picks: on a CUDA GPU int8 and int4 as one Triton kernel."""
    kernels = (backends.kernels("encode", x.shape[-1], g, code, x.dtype) if x.ndim >= 2
               else {})
    if "cuda" in kernels:
        return lax.platform_dependent(
            x, cuda=lambda x: triton_codecs.encode(x, g, code),
            default=lambda x: _encode(x, g, code))
    return _encode(x, g, code)


def unrotate_codes(codes: jax.Array, steps: jax.Array, exponents: jax.Array, g: int, code: str,
                   out_dtype, native: bool = True) -> jax.Array:
    """`codec_spec.unrotate_codes` (codes [..., C], steps [..., W / g], exponents [..., 1] as
    `wire_parts` gives them -> out_dtype[..., W]), by the backend equarx.backends picks (none
    with `native=False`): the rotation runs on the codes themselves and the scale is applied
    once on the way out, so no float32 message is decoded, copied into place and read back for
    the rotation (a pass that would be most of the default codec's compute). The XLA
    form sums in `_times`' fixed order (the specification's dot, exact in any order for integer
    codes and e4m3 runs of up to 64)."""
    def pure(codes, steps, exponents):
        s32 = _row_scales(steps, exponents).reshape(-1)
        sums = _times(codes_f32(codes, g, code), rotation(g).T, fence_out=False,
                      own_matrix=True)
        return (sums * (s32 / g)[:, None]).astype(out_dtype).reshape(*codes.shape[:-1], -1)

    chosen = (backends.kernels("unrotate", steps.shape[-1] * g, g, code, out_dtype)
              if native else {})
    impls = {"native_cpu": lambda c, s, e: native_cpu.unrotate(c, s, e, rotation(g).T, code,
                                                               out_dtype),
             "triton": lambda c, s, e: triton_codecs.unrotate(c, s, e, g, code, out_dtype)}
    if not chosen:
        return pure(codes, steps, exponents)
    return lax.platform_dependent(codes, steps, exponents, default=pure,
                                  **{platform: impls[b] for platform, b in chosen.items()})
