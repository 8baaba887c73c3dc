"""The group codec's encode and un-rotation as GPU kernels (Pallas, Triton lowering).

Written in XLA ops, `groups.encode` reads its input more than once on a GPU: the runs' absmax is
a reduction, the row's exponent a second one over its result, and the codes a third pass that
reads the values again and joins payload and scale bytes into one array (an H100: 28% of a
copy's bandwidth, docs/results.md). `encode` here reads a block of rows once, keeps it in
registers, and writes the codes, the runs' step bytes and the rows' exponent bytes straight
into their places in `groups.encode`'s wire: 4 bytes read and 1 + 1/g + 1/W written per float32
value, the least the codec can move.

`unrotate` is `groups.unrotate_codes` in one pass: codes, steps and exponents in, values out.
The inner products with the rotation's +-1 are a bfloat16 dot accumulated in float32 on the
tensor cores: exact, since codes and +-1 are bfloat16 values and their sums integers below 2^12.

Both give the bits of the XLA:CPU programs and of the native CPU kernels (equarx.native_cpu),
as `groups` defines them; two things differ in how, because a Triton kernel has no round
instruction and its float32 division may round the last bit otherwise:
- the codes are rounded by adding 1.5 * 2^23, with a max that changes no value between the
  product and the add, so that no compiler fuses them into one multiply-add (whose single
  rounding would round some ties of the float32 product the other way);
- 1 / scale comes from integer arithmetic on the scale's bits (`_reciprocal`), exact.
On an H100 the encode's codes equalled the CPU's on all of 64M values, where XLA's GPU program
of `groups.encode` differed on 25 (docs/results.md).

Rows of any width W (a multiple of g) and count: a block is a power of two of rows by W padded
to a power of two (Triton's block sizes), its edges masked. Each row is encoded from its own
values alone, so the bits are the same whatever rows come with it (token-local).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from equarx import groups

BLOCK_VALUES = 8192  # values a program holds (padded): 32 KiB of float32, in registers
NUM_WARPS = 8  # an H100: 8192 / 8 warps 93% of a copy's bandwidth, 8192 / 4 81% (results.md)
_MAX_INDEX = 1 << 31  # offsets are int32


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def in_use() -> bool:
    """Whether a CUDA backend is present (then programs traced include these kernels beside the
    XLA forms, `lax.platform_dependent` choosing by the platform they are compiled for)."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def supports(width: int, g: int, code: str) -> bool:
    """Whether the kernels take rows of `width` values in runs of g with this code: int8 or
    int4 (fp8 stays in XLA ops), g a power of two of at least 32 (the dot's smallest side is
    16, int4 splits a run in halves)."""
    return (code in ("int8", "int4") and g >= 32 and g & (g - 1) == 0 and width > 0
            and width % g == 0)


def _block_rows(width: int, g: int, block_values: int) -> int:
    """Rows per block: a power of two, so that the padded block holds about `block_values`
    values and its runs fill a dot's 16 rows."""
    wp = _pow2_at_least(width)
    return max(1, block_values // wp, 16 * g // wp)


def _reciprocal(scale: jax.Array, step: jax.Array) -> jax.Array:
    """1 / scale rounded to nearest, as a float32 division rounds it, from integer arithmetic.
    A scale is 2^k (32 + m) / 32 (5 mantissa bits m, `groups.scale_parts`), so its reciprocal
    is 2^-k for m = 0 and 2^(-k-1) times 2^29 / (32 + m) units of 2^-23 otherwise (never a
    tie). 0 for a NOT_FINITE run."""
    bits = lax.bitcast_convert_type(scale, jnp.int32)
    ef, m = (bits >> 23) & 0xFF, (bits >> 18) & 31
    q = ((1 << 29) + (32 + m) // 2) // (32 + m)
    inv = jnp.where(m == 0, (254 - ef) << 23, ((253 - ef) << 23) + q - (1 << 23))
    return jnp.where(step == groups.NOT_FINITE, 0.0, lax.bitcast_convert_type(inv, jnp.float32))


def _out(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel's result type: inside shard_map it varies over the mesh axes `like` varies over
    (as the XLA form's would), which a pallas_call's result must state."""
    manual = getattr(jax.typeof(like), "manual_axis_type", None)
    if manual is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


def _grid(i, br: int, wp: int, total: int, width: int):
    """A block's global row indices [br, 1] and [br], its columns [1, wp], and the mask of
    real values [br, wp]."""
    rows = i * br + lax.broadcasted_iota(jnp.int32, (br, 1), 0)
    cols = lax.broadcasted_iota(jnp.int32, (1, wp), 1)
    return rows, rows.reshape(br), cols, (rows < total) & (cols < width)


def encode(x: jax.Array, g: int, code: str, interpret: bool = False,
           block_values: int = BLOCK_VALUES, num_warps: int = NUM_WARPS) -> jax.Array:
    """f32/bf16[B, ..., W] -> int8[B, N]: `groups.encode`'s wire, bit for bit."""
    b, w = x.shape[0], x.shape[-1]
    if len(x.shape) < 2 or not supports(w, g, code):
        raise ValueError(f"triton_codecs.encode takes int8/int4 rows of a multiple of {g} "
                         f"values, got {x.shape} {code}")
    rows = math.prod(x.shape[1:-1])
    total, runs = b * rows, w // g
    payload = w // 2 if code == "int4" else w
    n = rows * (payload + runs + 1)  # one piece's wire bytes
    if max(total * w, b * n) >= _MAX_INDEX:
        raise ValueError(f"triton_codecs.encode takes fewer than 2^31 values, got {x.shape}")
    wp = _pow2_at_least(w)
    br = _block_rows(w, g, block_values)
    code_max = groups.CODES[code]

    def kernel(x_ref, o_ref):
        rows2, rows1, cols, valid = _grid(pl.program_id(0), br, wp, total, w)
        v = plgpu.load(x_ref.at[rows2 * w + cols], mask=valid, other=0).astype(jnp.float32)
        v = v.reshape(br, wp // g, g)
        mag = jnp.abs(v)
        amax = jnp.max(jnp.where(mag != mag, jnp.inf, mag), axis=-1)
        step, e, scale, _ = groups.scale_parts(amax, code_max)
        # A max that changes no value (|scaled| <= code_max) between the product and the
        # rounding add: no compiler may then fuse the two into one multiply-add.
        scaled = jnp.maximum(v * _reciprocal(scale, step)[..., None], -2.0 * code_max)
        bits = lax.bitcast_convert_type(scaled + groups._ROUNDING_MAGIC, jnp.int32)
        if code == "int4":  # a run's first half in the low nibbles, its second half high
            q = bits.reshape(br, wp // g, 2, g // 2)
            second = lax.broadcasted_iota(jnp.int32, q.shape, 2) == 1
            bits = ((jnp.sum(jnp.where(second, 0, q), axis=2) & 0x0F)
                    | (jnp.sum(jnp.where(second, q, 0), axis=2) << 4))
        piece, row = rows2 // rows, rows2 % rows
        pp = wp // 2 if code == "int4" else wp
        pcols = lax.broadcasted_iota(jnp.int32, (1, pp), 1)
        plgpu.store(o_ref.at[piece * n + row * payload + pcols],
                    bits.reshape(br, pp).astype(jnp.int8),
                    mask=(rows2 < total) & (pcols < payload))
        run = lax.broadcasted_iota(jnp.int32, (1, wp // g), 1)
        plgpu.store(o_ref.at[piece * n + rows * payload + row * runs + run],
                    step.astype(jnp.int8), mask=(rows2 < total) & (run < runs))
        piece1, row1 = rows1 // rows, rows1 % rows
        plgpu.store(o_ref.at[piece1 * n + rows * (payload + runs) + row1],
                    (e.reshape(br) + 127).astype(jnp.int8), mask=rows1 < total)

    out = pl.pallas_call(
        kernel,
        out_shape=_out((b * n,), jnp.int8, x),
        grid=(-(-total // br),),
        in_specs=[pl.no_block_spec],
        out_specs=pl.no_block_spec,
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps),
    )(x.reshape(-1))
    return out.reshape(b, n)


def unrotate(codes: jax.Array, steps: jax.Array, exponents: jax.Array, g: int, code: str,
             out_dtype, interpret: bool = False, block_values: int = BLOCK_VALUES,
             num_warps: int = NUM_WARPS) -> jax.Array:
    """`groups.unrotate_codes` (codes [..., C], steps [..., W / g], exponents [..., 1]) ->
    out_dtype[..., W], bit for bit."""
    w = steps.shape[-1] * g
    if not supports(w, g, code):
        raise ValueError(f"triton_codecs.unrotate takes int8/int4 codes, got {code} runs of {g}")
    lead = codes.shape[:-1]
    total = math.prod(lead)
    c, runs = codes.shape[-1], w // g
    if total * w >= _MAX_INDEX:
        raise ValueError(f"triton_codecs.unrotate takes fewer than 2^31 values, got {lead}")
    wp = _pow2_at_least(w)
    br = _block_rows(w, g, block_values)
    rp = wp // g  # runs of a padded row
    half = g // 2
    mt = jnp.asarray(groups.rotation(g).T, jnp.bfloat16)
    mats = (mt[:half], mt[half:]) if code == "int4" else (mt,)

    def kernel(codes_ref, steps_ref, exps_ref, *refs):
        *mat_refs, o_ref = refs
        rows2, rows1, cols, valid = _grid(pl.program_id(0), br, wp, total, w)
        run = lax.broadcasted_iota(jnp.int32, (1, rp), 1)
        st = plgpu.load(steps_ref.at[rows2 * runs + run], mask=(rows2 < total) & (run < runs),
                        other=0)
        ex = plgpu.load(exps_ref.at[rows1], mask=rows1 < total, other=0)
        s = groups._row_scales(st, ex.reshape(br, 1)) / g  # [br, rp]
        if code == "int4":
            pcols = lax.broadcasted_iota(jnp.int32, (1, wp // 2), 1)
            packed = plgpu.load(codes_ref.at[rows2 * c + pcols],
                                mask=(rows2 < total) & (pcols < c), other=0)
            low = ((packed << 4) >> 4).astype(jnp.bfloat16).reshape(br * rp, half)
            high = (packed >> 4).astype(jnp.bfloat16).reshape(br * rp, half)
            sums = (jnp.dot(low, mat_refs[0][...], preferred_element_type=jnp.float32)
                    + jnp.dot(high, mat_refs[1][...], preferred_element_type=jnp.float32))
        else:
            q = plgpu.load(codes_ref.at[rows2 * c + cols], mask=valid, other=0)
            sums = jnp.dot(q.astype(jnp.bfloat16).reshape(br * rp, g), mat_refs[0][...],
                           preferred_element_type=jnp.float32)
        out = (sums * s.reshape(br * rp, 1)).astype(out_dtype).reshape(br, wp)
        plgpu.store(o_ref.at[rows2 * w + cols], out, mask=valid)

    out = pl.pallas_call(
        kernel,
        out_shape=_out((total * w,), out_dtype, codes),
        grid=(-(-total // br),),
        in_specs=[pl.no_block_spec] * (3 + len(mats)),
        out_specs=pl.no_block_spec,
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps),
    )(codes.reshape(-1), steps.reshape(-1), exponents.reshape(-1), *mats)
    return out.reshape(*lead, w)
