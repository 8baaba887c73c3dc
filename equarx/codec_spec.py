"""The group codec (blocks="group") specified once: the scale grid, the rounding, the rotation
and the wire layout, as the pure-JAX functions every backend is held to.

The backends (XLA ops in equarx.groups, C++ in equarx.native_cpu, Triton in
equarx.triton_codecs; chosen by equarx.backends) must give `encode`'s bytes and `decode`'s and
`unrotate_codes`' values bit for bit, a NaN's own bits aside (`NOT_FINITE`);
tests/equarx/test_codec_conformance.py holds each to that. Why a scale covers a rotated run of
one token's values: docs/algorithm.md ("Version 2").
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CODES = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}  # the largest code of each payload type
CODE_IDS = {"int8": 0, "int4": 1, "fp8": 2}  # the native kernels' `code` attribute

# The step byte of a run holding a NaN or Inf: it decodes as NaN, whatever its codes. A
# backend may give that NaN any payload and sign (XLA:CPU does not fix them: equarx.groups);
# every other value, a zero's sign included, bit for bit (tests/testkit.assert_same_bits).
NOT_FINITE = 255
E_MIN, E_MAX = -100, 126  # a row's exponent: every scale and 1 / scale stays normal
EXPONENT_BIAS = 127  # an exponent byte is e + 127 (float32's own bias is 127 too)
STEP_BITS = 18  # 23 mantissa bits less the 5 a scale keeps
ROUNDING_MAGIC = 12582912.0  # 1.5 * 2^23


def cpp_defines() -> list[str]:
    """The compiler flags that give the C++ kernels (equarx/csrc/group_codec.h) this module's
    constants, so that they are written here only."""
    values = {"NOT_FINITE": NOT_FINITE, "E_MIN": E_MIN, "E_MAX": E_MAX, "STEP_BITS": STEP_BITS,
              "EXPONENT_BIAS": EXPONENT_BIAS, "ROUNDING_MAGIC": f"{ROUNDING_MAGIC!r}f",
              **{f"CODE_MAX_{k.upper()}": f"{v!r}f" for k, v in CODES.items()},
              **{f"CODE_ID_{k.upper()}": v for k, v in CODE_IDS.items()}}
    return [f"-DEQUARX_{k}={v}" for k, v in values.items()]


# ---- rounding ----

def round_half_even(v: jax.Array, fence: str = "round") -> jax.Array:
    """int32 bits whose low byte is v rounded half to even, as int8 two's complement, for
    |v| <= 127 (the one rounding of every backend's codes). `fence` keeps the product that made
    v from fusing with the add into one multiply-add, as XLA:CPU does in some fusions and not in
    others: "round" rounds first (then the add is exact; XLA and Mosaic), "max" puts a max that
    changes no value between them (a Triton kernel has no round instruction)."""
    if fence == "round":
        v = lax.round(v, lax.RoundingMethod.TO_NEAREST_EVEN)
    elif fence == "max":
        v = jnp.maximum(v, -2.0 * CODES["int8"])
    else:
        raise ValueError(f"fence is 'round' or 'max', not {fence!r}")
    return lax.bitcast_convert_type(v + ROUNDING_MAGIC, jnp.int32)


def round_int8(v: jax.Array) -> jax.Array:
    """v rounded half to even into int8, for |v| <= 127 (`round_half_even`)."""
    return round_half_even(v).astype(jnp.int8)


# ---- rotation ----

def hadamard(g: int) -> np.ndarray:
    """The g x g Sylvester Hadamard matrix H (g a power of two)."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < g:
        h = np.block([[h, h], [h, -h]])
    return h


def rotation(g: int) -> np.ndarray:
    """M = D H (D fixed random signs, H the g x g Sylvester Hadamard matrix): M M^T = g I.
    Seeded, so every device and every program uses the same matrix. A run x is sent as x M
    (unnormalized: |.| grows by sqrt(g)) and recovered as y M^T / g (exact: g a power of two)."""
    signs = np.where(np.random.default_rng(0x5EED + g).random(g) < 0.5, -1.0, 1.0)
    return (signs[:, None] * hadamard(g)).astype(np.float32)


def signs(g: int) -> np.ndarray:
    """The diagonal of D in M = D H (`rotation`): M's first column."""
    return rotation(g)[:, 0].copy()


# ---- the scale grid ----

def scale_value(step: jax.Array, e: jax.Array) -> jax.Array:
    """A run's scale from its step byte and its row's exponent, NaN for NOT_FINITE."""
    s = lax.bitcast_convert_type(((e + 127) << 23) - (step << STEP_BITS), jnp.float32)
    return jnp.where(step == NOT_FINITE, jnp.float32(jnp.nan), s)


def absmax(v: jax.Array, axis: int) -> jax.Array:
    """max |v| over `axis`, Inf where a value is NaN (then the run's scale is Inf and it decodes
    as NaN). The NaN is mapped before the max-reduce: XLA:CPU's YNNPACK reduce drops a NaN from
    large float32 inputs."""
    mag = jnp.abs(v)
    return jnp.max(jnp.where(mag != mag, jnp.inf, mag), axis=axis)


def run_scales(amax: jax.Array, code_max: float) -> jax.Array:
    """The runs' float32 scales before rounding, Inf for a run holding a NaN or Inf. Times the
    float32 reciprocal, not divided: XLA:CPU turns a division by a constant into that product
    in some fusions and not in others."""
    amax = jnp.where(jnp.isnan(amax), jnp.inf, amax)
    return amax * np.float32(1.0 / code_max)


def _largest(s: jax.Array, axis: int) -> jax.Array:
    """The largest finite run scale along `axis` (keepdims; 0 where none is finite)."""
    return jnp.max(jnp.where(s < jnp.inf, s, 0.0), axis=axis, keepdims=True)


def largest_scale(amax: jax.Array, code_max: float, axis: int = -1) -> jax.Array:
    """The largest finite run scale along `axis` (keepdims), as `scale_parts` takes it: the
    maximum of those of a row's parts is the row's."""
    return _largest(run_scales(amax, code_max), axis)


def scale_parts(amax: jax.Array, code_max: float, axis: int = -1,
                row_max: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per-run absmax f32[..., G, ...] (the runs of one row along `axis`) -> (step int32 [like
    amax], row exponent int32 [keepdims along axis], scale f32 [like amax], 1/scale f32) on
    the grid below. A run more than 8 octaves below its row's largest takes
    the grid's last scale. A NaN or Inf makes a run's step NOT_FINITE, its 1/scale 0, and
    leaves the row's other runs alone. `row_max` (the row's `largest_scale`, given when `amax`
    holds only some of a row's runs, as a GPU kernel's pieces of a row do) stands for the
    maximum over `axis`.

    The grid: a run's float32 scale is rounded up to 5 mantissa bits (no value leaves the
    code's range); the row's exponent e is the smallest power of two at or above its largest
    finite run scale, clipped to [E_MIN, E_MAX]; the run's step byte k counts its scale down
    from 2^e in units of 2^STEP_BITS of the float's bits (32 steps an octave, k = 0..254).
    Every grid point is a bfloat16 value; past the float32 scale it is integer arithmetic."""
    s = run_scales(amax, code_max)
    finite = s < jnp.inf
    m = lax.bitcast_convert_type(_largest(s, axis) if row_max is None else row_max, jnp.int32)
    # ceil(log2 m) from the bits; 0 and subnormal maxima land below E_MIN.
    e = jnp.clip(((m >> 23) & 0xFF) - 127 + ((m & 0x7FFFFF) != 0), E_MIN, E_MAX)
    # Rounded up to 5 mantissa bits (a carry moves into the exponent, as it should); a zero or
    # subnormal scale lands far past the grid's end.
    unit = (1 << STEP_BITS) - 1
    up = (lax.bitcast_convert_type(s, jnp.int32) + unit) & ~unit
    below = (((e + 127) << 23) - up) >> STEP_BITS
    step = jnp.where(finite, jnp.minimum(below, NOT_FINITE - 1), NOT_FINITE)
    scale = scale_value(step, e)
    inv = jnp.where(finite, 1.0 / jnp.where(finite, scale, 1.0), 0.0)
    return step, e, scale, inv


def row_scales(steps: jax.Array, exponents: jax.Array) -> jax.Array:
    """Step bytes int8[..., G] and their rows' exponent bytes int8[..., 1] -> the runs' scales
    f32[..., G]."""
    def unsigned(b):
        return lax.bitcast_convert_type(b, jnp.uint8).astype(jnp.int32)
    return scale_value(unsigned(steps), unsigned(exponents) - EXPONENT_BIAS)


# ---- the wire ----

def as_bytes(v: jax.Array) -> jax.Array:
    """int32 values in [0, 255] -> int8 bytes (their low byte)."""
    return lax.bitcast_convert_type(v.astype(jnp.uint8), jnp.int8)


def payload_width(width: int, code: str) -> int:
    """Payload bytes of a row of `width` values."""
    return width // 2 if code == "int4" else width


def wire_parts(wire: jax.Array, piece_shape: tuple[int, ...], g: int, code: str
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`encode`'s bytes int8[B, N] -> (codes int8[B, R, C], steps int8[B, R, W / g], exponents
    int8[B, R, 1]) for pieces of shape (R, W): C = `payload_width(W)`, so all three keep one
    row per token and can be put in place as plain bytes."""
    b, (r, w) = wire.shape[0], piece_shape
    c = payload_width(w, code)
    runs = r * (w // g)
    return (wire[:, :r * c].reshape(b, r, c), wire[:, r * c:r * c + runs].reshape(b, r, w // g),
            wire[:, r * c + runs:].reshape(b, r, 1))


def wire_bytes_per_value(g: int, code: str, width: int | None = None,
                         scale: str = "byte") -> float:
    """Bytes on the wire per value: payload, a step byte per run of g and, for rows of `width`
    values in a piece, an exponent byte per row (None: rows long enough not to count).
    scale="bf16": the Pallas kernel's wire, a bfloat16 scale per run and no exponent byte."""
    if scale == "bf16":
        return (0.5 if code == "int4" else 1.0) + 2.0 / g
    return (0.5 if code == "int4" else 1.0) + 1.0 / g + (1.0 / width if width else 0.0)


# ---- the codec, as pure JAX (the reference every backend is held to) ----

def codes_f32(payload: jax.Array, g: int, code: str) -> jax.Array:
    """The payload's codes as f32[n, g], one run per row (int4: arithmetic shifts sign-extend
    the nibbles)."""
    if code == "fp8":
        fp8 = lax.bitcast_convert_type(payload, jnp.float8_e4m3fn)
        return fp8.astype(jnp.float32).reshape(-1, g)
    if code == "int4":
        packed = payload.reshape(-1, g // 2)
        return jnp.concatenate([(packed << 4) >> 4, packed >> 4], axis=-1).astype(jnp.float32)
    return payload.reshape(-1, g).astype(jnp.float32)


def encode(x: jax.Array, g: int, code: str) -> jax.Array:
    """f32/bf16[B, ..., R] (R a multiple of g; the runs already rotated) -> int8[B, N]: per
    leading index the payload (each row's codes in turn; int4 two a byte, a run's first half in
    the low nibbles), then every run's step byte, then every row's exponent byte (e + 127).
    Steps and exponents are apart so that XLA:CPU's decode indexes them without a division."""
    b, r = x.shape[0], x.shape[-1]
    v = x.reshape(b, -1, r // g, g)
    # The absmax in the input's own dtype (exact: a maximum of its values), widened after: a
    # bfloat16 piece is then read as it is instead of as a float32 copy written out first.
    step, e, _, inv = scale_parts(absmax(v, -1).astype(jnp.float32), CODES[code])
    scaled = v.astype(jnp.float32) * inv[..., None]
    if code == "fp8":
        payload = lax.bitcast_convert_type(scaled.astype(jnp.float8_e4m3fn), jnp.int8)
    else:
        q = round_int8(scaled)
        if code == "int4":  # two values per byte: the run's first half low, second half high
            half = g // 2
            q = (q[..., :half] & jnp.int8(0x0F)) | (q[..., half:] << 4)
        payload = q
    return jnp.concatenate([payload.reshape(b, -1), as_bytes(step).reshape(b, -1),
                            as_bytes(e + EXPONENT_BIAS).reshape(b, -1)], axis=1)


def decode(wire: jax.Array, g: int, code: str, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of `encode`: int8[B, N] -> f32 of `shape`, the encoded one (still rotated)."""
    codes, steps, exponents = wire_parts(wire, (math.prod(shape[1:-1]), shape[-1]), g, code)
    s = row_scales(steps, exponents)  # [B, rows, G]
    return (codes_f32(codes, g, code).reshape(*s.shape, g) * s[..., None]).reshape(shape)


def unrotate_codes(codes: jax.Array, steps: jax.Array, exponents: jax.Array, g: int, code: str,
                   out_dtype) -> jax.Array:
    """The decoded values with the rotation undone, in `out_dtype`, from `wire_parts`' arrays
    (any leading shape) -> [..., W]: per run (sum_j M^T[j, i] q_j) * (s / g), the sum over the
    codes first, the scale applied once. Integer codes: `decode` then the inverse rotation, bit
    for bit (the sum is an integer below 2^12, exact in any order, and s / g a bfloat16 value
    over a power of two). e4m3 codes: their sum is exact for runs of up to 64, so one rounding
    where decoding first rounds each term (closer)."""
    s = row_scales(steps, exponents).reshape(-1)
    sums = jnp.dot(codes_f32(codes, g, code), jnp.asarray(rotation(g).T),
                   precision=lax.Precision.HIGHEST)
    return (sums * (s / g)[:, None]).astype(out_dtype).reshape(*codes.shape[:-1], -1)
