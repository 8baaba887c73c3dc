"""The token-local codecs (blocks="group"): rotated runs of `group_size` values of one row, one
scale per run (a byte, on a grid below an exponent byte per row), int8 / int4 / float8 payload.

Why this shape of block:
- A scale covers values of one token only (a run of consecutive columns of one row), so a
  token's quantization never depends on the other tokens of the batch (the paper's 8x128 tiles
  mix the values of many tokens at one tile position).
- Gemma's partial sums have outlier values that differ from token to token (a per-channel
  smoothing does not tame them, measured on the 270M's real partials: docs/quality.md). A
  randomized Hadamard rotation of each run spreads an outlier over its run, so the run's scale
  follows its bulk (QuaRot, THC). Runs of 32 halve the error of the paper-sized runs of 128 at
  the same rotation, and a 32x32 rotation is 32 multiply-adds per value.
- The scale is rounded up so that no value exceeds the code's range, onto a grid of 32 steps
  per octave below the row's own power of two (`scale_parts`): one byte per run of 32 and one
  per row (int8 then moves about 0.52x the bytes of bf16, where a bfloat16 scale per run made
  it 0.53x: the link time the default lost to the paper's tile codec). Every grid point is a
  bfloat16 value, and the step it sets is on average ~1% above the float32 one (a bfloat16
  scale: 0.2%), too little to move the model's KL measurably (docs/results.md). The row's
  exponent makes the scale a function of the row: still token-local.

Groups run along a row's columns (the last axis, a multiple of the group size); encoded pieces
are one int8 array so that one ppermute moves payload and scales.

NaN: a run holding a NaN or an Inf gets the step byte NOT_FINITE and decodes as NaN, whatever
its codes (they are unspecified). Every form of the codec (these XLA ops, the native CPU
kernels on each instruction set, the GPU kernels) promises the pure-JAX form's result with one
freedom: a NaN where it has a NaN, of any payload and sign; every other value bit for bit, the
sign of a zero included (tests/testkit.assert_same_bits checks exactly that). The NaN's own bits
are left free because XLA:CPU does not fix them either. Such a run's scale is the float32 NaN
0x7FC00000 and its products keep it; the conversion to bfloat16 then depends on where XLA:CPU
puts it: fused with the un-rotation's product-sum into a YNNPACK call, whose conversion YNNPACK
picks by processor (0x7FC0 with AVX512-BF16; on an AVX2 processor 0x7FC1, its portable
(bits >> 16) | 1, or 0x7FC0 for a message of a few thousand values), or in XLA's own loops
(sign | 0x7FC0). The native kernels keep the top bits and set the quiet bit (0x7FC0 on every
path); with fp8 codes a NaN code enters the sums too, and which NaN survives, so its sign,
follows the order of the operations (the plain loops' differs from the butterflies').
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from equarx import native_cpu

CODES = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}  # the largest code of each payload type
_ROUNDING_MAGIC = 12582912.0  # 1.5 * 2^23: see equarx.quantize


def _hadamard(g: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < g:
        h = np.block([[h, h], [h, -h]])
    return h


def rotation(g: int) -> np.ndarray:
    """M = D H (D fixed random signs, H the g x g Sylvester Hadamard matrix): M M^T = g I.
    Seeded, so every device and every program uses the same matrix."""
    signs = np.where(np.random.default_rng(0x5EED + g).random(g) < 0.5, -1.0, 1.0)
    return (signs[:, None] * _hadamard(g)).astype(np.float32)


def _times(v: jax.Array, m: np.ndarray, fence_out: bool = True,
           own_matrix: bool = False) -> jax.Array:
    """f32[n, g] times the g x g matrix m, as a kernel of its own.

    Written as a broadcast product summed over a fixed axis, not as a dot: XLA:CPU picks a
    different dot kernel (and summation order) for a few rows than for many, which would make a
    row's result depend on the message's length; the product and the reduce add in the same
    order whatever the row count. The barriers were put there to keep XLA from fusing it into
    the layout's slices and copies around it (fused, it once ran several times slower on CPU);
    rechecked with JAX 0.10.2's XLA:CPU and the native kernels around it, the collective built
    without them gave the same bits at the same speed, so they are a guard now, not a measured
    win. `fence_out=False`
    leaves the output open to its consumer: after the all-gather that is a slice and a cast,
    which then need no pass of their own (16 MiB message: 10 ms less, the same bits).

    `own_matrix=True` passes the matrix through the barrier with the values. A model runs
    several rotations of one shape, and XLA's CSE merges their broadcasts of the constant
    matrix into one shared [n, g, g] array that it writes out in full on every call (151 MB,
    ~70 ms per prefill call of a 1024-token, 2-layer 1B model, for each of the two matrices);
    with its own matrix each product fuses its broadcast. The forward rotation keeps the
    shared broadcast: given its own, its bits in a model program change (the reduce's
    summation order), which moved the tp=4 golden agreement of tests/models/test_parity.py by
    one position; the inverse's bits do not change.

    Off the CPU it is a float32 dot: on a GPU the summed form compiled for 86 s and ran at 5% of
    a copy's bandwidth, the dot at 89% (an H100, docs/results.md). Whether a dot's bits depend
    on the row count is up to the backend's kernel choice: on the H100 they did not (1 to 30000
    rows). Integer codes (`unrotate_codes`) sum exactly in any order either way."""
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


def signs(g: int) -> np.ndarray:
    """The diagonal of D in M = D H (`rotation`): M's first column."""
    return rotation(g)[:, 0].copy()


def to_f32(x: jax.Array) -> jax.Array:
    """x as float32. bfloat16 by its bits (the same values): a plain convert fuses into the
    rotation's reduce, which then ran 2-5x slower on XLA:CPU than on float32 input."""
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


# The scale grid below a row's exponent e: the float32 values with 5 mantissa bits (6
# significant: bfloat16 values, so the un-rotation's exactness argument holds), counted down
# from 2^e. Step k is the float whose bits are 2^e's minus k * 2^18 (32 steps an octave, 1.6-3.1%
# apart), for k = 0..254: 8 octaves deep.
NOT_FINITE = 255  # the step byte of a run holding a NaN or Inf (it decodes as NaN)
E_MIN, E_MAX = -100, 126  # a row's exponent: every scale and 1 / scale stays normal
_STEP_BITS = 18  # 23 mantissa bits less the 5 a scale keeps


def _scale_value(step: jax.Array, e: jax.Array) -> jax.Array:
    """A run's scale from its step byte and its row's exponent, NaN for NOT_FINITE."""
    s = lax.bitcast_convert_type(((e + 127) << 23) - (step << _STEP_BITS), jnp.float32)
    return jnp.where(step == NOT_FINITE, jnp.float32(jnp.nan), s)


def scale_parts(amax: jax.Array, code_max: float, axis: int = -1,
                row_max: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per-run absmax f32[..., G, ...] (the runs of one row along `axis`) -> (step int32 [like
    amax], row exponent int32 [keepdims along axis], scale f32 [like amax], 1/scale f32).

    A run's float32 scale (absmax / code_max) is rounded up to 5 mantissa bits, so no value
    leaves the code's range; the row's exponent e is the smallest power of two at or above its
    largest finite one, and each run's step counts its scale down from 2^e (`_scale_value`).
    That is 9 bits of scale per run where a bfloat16 scale takes 16 (one byte per run and one
    per row on the wire), for a step on average ~1% coarser than the exact one. A run more than
    8 octaves below its row's largest takes the grid's last scale (its error stays 2^-8 of the
    largest run's). A NaN or Inf makes a run's step NOT_FINITE (decoded as NaN), its 1/scale
    0, and leaves the row's other runs alone. `row_max` (the row's `largest_scale`, given when
    `amax` holds only some of a row's runs, as a GPU kernel's pieces of a row do) stands for
    the maximum over `axis`.

    After the float32 scale everything is integer arithmetic on its bits, the same in every
    program and in the native kernels (a product with 2^-e, say, XLA folds into the reciprocal
    when e is a constant, and then flushes it to zero)."""
    s = _run_scales(amax, code_max)
    finite = s < jnp.inf
    m = lax.bitcast_convert_type(_largest(s, axis) if row_max is None else row_max, jnp.int32)
    # ceil(log2 m) from the bits; 0 and subnormal maxima land below E_MIN.
    e = jnp.clip(((m >> 23) & 0xFF) - 127 + ((m & 0x7FFFFF) != 0), E_MIN, E_MAX)
    # Rounded up to 5 mantissa bits (a carry moves into the exponent, as it should); a zero or
    # subnormal scale lands far past the grid's end.
    unit = (1 << _STEP_BITS) - 1
    up = (lax.bitcast_convert_type(s, jnp.int32) + unit) & ~unit
    below = (((e + 127) << 23) - up) >> _STEP_BITS
    step = jnp.where(finite, jnp.minimum(below, NOT_FINITE - 1), NOT_FINITE)
    scale = _scale_value(step, e)
    inv = jnp.where(finite, 1.0 / jnp.where(finite, scale, 1.0), 0.0)
    return step, e, scale, inv


def _run_scales(amax: jax.Array, code_max: float) -> jax.Array:
    """The runs' float32 scales before rounding, Inf for a run holding a NaN or Inf."""
    amax = jnp.where(jnp.isnan(amax), jnp.inf, amax)
    # Times the float32 reciprocal, not divided: XLA:CPU turns a division by a constant into
    # that product in some fusions and not in others, which would move a scale with the program
    # around it.
    return amax * np.float32(1.0 / code_max)


def _largest(s: jax.Array, axis: int) -> jax.Array:
    """The largest finite run scale along `axis` (keepdims; 0 where none is finite)."""
    return jnp.max(jnp.where(s < jnp.inf, s, 0.0), axis=axis, keepdims=True)


def largest_scale(amax: jax.Array, code_max: float, axis: int = -1) -> jax.Array:
    """The largest finite run scale along `axis` (keepdims), as `scale_parts` takes it: the
    maximum of those of a row's parts is the row's."""
    return _largest(_run_scales(amax, code_max), axis)


def _as_bytes(v: jax.Array) -> jax.Array:
    """int32 values in [0, 255] -> int8 bytes (their low byte)."""
    return lax.bitcast_convert_type(v.astype(jnp.uint8), jnp.int8)


def _row_scales(steps: jax.Array, exponents: jax.Array) -> jax.Array:
    """Step bytes int8[..., G] and their rows' exponent bytes int8[..., 1] (biased by 127) ->
    the runs' scales f32[..., G]. Steps and exponents travel as separate arrays: interleaved
    per row ([..., G + 1]), XLA:CPU's fused decode recomputed the index of each value's two
    bytes with a division by G + 1, and ran 5x slower."""
    def unsigned(b):
        return lax.bitcast_convert_type(b, jnp.uint8).astype(jnp.int32)
    return _scale_value(unsigned(steps), unsigned(exponents) - 127)


def _absmax(v: jax.Array, axis: int) -> jax.Array:
    """max |v| over `axis`, Inf where a value is NaN (then the run's scale is Inf and it decodes
    as NaN). The NaN is mapped before the max-reduce: XLA:CPU's YNNPACK reduce drops a NaN from
    large float32 inputs (a [256, 512] message with one NaN decoded its run as finite values)."""
    mag = jnp.abs(v)
    return jnp.max(jnp.where(mag != mag, jnp.inf, mag), axis=axis)


def round_int8(v: jax.Array) -> jax.Array:
    """Round half to even into int8 for |v| <= 127: rounded, then 1.5 * 2^23 added (exact for
    an integer) to leave the two's complement in the low byte (see quantize). The explicit
    round keeps XLA:CPU from fusing the product that makes v and the add into one multiply-add,
    which it does in some fusions and not in others: a tie then rounded one way or the other
    with the program around it (and the native kernel could not match it)."""
    rounded = lax.round(v, lax.RoundingMethod.TO_NEAREST_EVEN)
    return lax.bitcast_convert_type(rounded + _ROUNDING_MAGIC, jnp.int32).astype(jnp.int8)


def _gpu_kernels(width: int, g: int, code: str):
    """equarx.triton_codecs if programs traced now include its GPU kernels for rows of `width`
    values (a CUDA backend is present and the kernels take the shape), else None."""
    from equarx import triton_codecs  # here, not at the top: it builds on this module
    return (triton_codecs if triton_codecs.in_use() and triton_codecs.supports(width, g, code)
            else None)


def encode(x: jax.Array, g: int, code: str) -> jax.Array:
    """f32[B, ..., R] (R a multiple of g) -> int8[B, N]: per leading index, the payload (the
    codes of each row of R values in turn), the runs' step bytes, then the rows' exponent bytes
    (`scale_parts`). Contiguous parts keep the join a few copies: a per-token join of payload
    and scales compiles to a per-element select on XLA:CPU and costs more than the
    quantization. On a CUDA GPU, int8 and int4 run as one kernel with the same bits
    (equarx.triton_codecs)."""
    kernels = _gpu_kernels(x.shape[-1], g, code) if x.ndim >= 2 else None
    if kernels is not None:
        return lax.platform_dependent(
            x, cuda=lambda x: kernels.encode(x, g, code),
            default=lambda x: _encode(x, g, code))
    return _encode(x, g, code)


def _encode(x: jax.Array, g: int, code: str) -> jax.Array:
    """`encode` in XLA ops."""
    b, r = x.shape[0], x.shape[-1]
    v = x.reshape(b, -1, r // g, g)
    # The absmax in the input's own dtype (exact: a maximum of its values), widened after: a
    # bfloat16 piece is then read as it is instead of as a float32 copy written out first.
    step, e, _, inv = scale_parts(_absmax(v, -1).astype(jnp.float32), CODES[code])
    scaled = v.astype(jnp.float32) * inv[..., None]
    if code == "fp8":
        payload = lax.bitcast_convert_type(scaled.astype(jnp.float8_e4m3fn), jnp.int8)
    else:
        q = round_int8(scaled)
        if code == "int4":  # two values per byte: the run's first half low, second half high
            half = g // 2
            q = (q[..., :half] & jnp.int8(0x0F)) | (q[..., half:] << 4)
        payload = q
    return jnp.concatenate([payload.reshape(b, -1), _as_bytes(step).reshape(b, -1),
                            _as_bytes(e + 127).reshape(b, -1)], axis=1)


def _codes_f32(payload: jax.Array, g: int, code: str) -> jax.Array:
    """The payload's codes as f32[n, g], one run per row (int4: a run's first half in the low
    nibbles, its second half in the high ones; arithmetic shifts sign-extend them)."""
    if code == "fp8":
        fp8 = lax.bitcast_convert_type(payload, jnp.float8_e4m3fn)
        return fp8.astype(jnp.float32).reshape(-1, g)
    if code == "int4":
        packed = payload.reshape(-1, g // 2)
        return jnp.concatenate([(packed << 4) >> 4, packed >> 4], axis=-1).astype(jnp.float32)
    return payload.reshape(-1, g).astype(jnp.float32)


def decode(wire: jax.Array, g: int, code: str, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of `encode`: int8[B, N] -> f32 of `shape`, the encoded one."""
    codes, steps, exponents = wire_parts(wire, (math.prod(shape[1:-1]), shape[-1]), g, code)
    s = _row_scales(steps, exponents)  # [B, rows, G]
    return (_codes_f32(codes, g, code).reshape(*s.shape, g) * s[..., None]).reshape(shape)


def wire_parts(wire: jax.Array, piece_shape: tuple[int, ...], g: int, code: str
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`encode`'s bytes int8[B, N] -> (codes int8[B, R, C], steps int8[B, R, W / g], exponents
    int8[B, R, 1]) for pieces of shape (R, W): C = W (int8, fp8) or W / 2 (int4), so all three
    keep one row per token and can be put in place as plain bytes."""
    b, (r, w) = wire.shape[0], piece_shape
    c = w // 2 if code == "int4" else w
    runs = r * (w // g)
    return (wire[:, :r * c].reshape(b, r, c), wire[:, r * c:r * c + runs].reshape(b, r, w // g),
            wire[:, r * c + runs:].reshape(b, r, 1))


def unrotate_codes(codes: jax.Array, steps: jax.Array, exponents: jax.Array, g: int, code: str,
                   out_dtype, native: bool = True) -> jax.Array:
    """The decoded values with the rotation undone, in `out_dtype`, from codes [..., C] and
    their runs' step bytes [..., W / g] and rows' exponent bytes [..., 1] (as `wire_parts`
    gives them, any leading shape): [..., W].
    Integer codes: `unrotate(decode(...))` bit for bit. fp8: that up to its rounding (closer).

    Why: a decoded run is q_j s (codes q_j, one bfloat16 scale s), so its inverse rotation is
    (sum_j M[i, j] q_j) s / g. With integer codes (|q_j| <= 127) the inner sum is an integer
    below 2^12, exact in float32 in any order, and its one product with s / g (a bfloat16 scale
    over a power of two) is exact too. e4m3 codes are multiples of 2^-9 below 2^9, so their sum
    is exact for groups of up to 64 (below 2^24 units of 2^-9) and the product with s / g rounds
    once, where decoding first rounds the scaled terms' partial sums. So the rotation runs on the
    codes themselves and the scale is applied once on the way out: no float32 message is decoded,
    copied into place and read back for the rotation (after the all-gather that was most of the
    default codec's compute).

    On the CPU backend, to bfloat16 or float32, this runs as a native kernel with the same bits
    (equarx.native_cpu; a NaN's own bits aside, see "NaN" above), unless `native=False` or it
    could not be built; on a CUDA GPU, int8 and int4 as one kernel with the same bits
    (equarx.triton_codecs), unless `native=False`."""
    def pure(codes, steps, exponents):
        s32 = _row_scales(steps, exponents).reshape(-1)
        sums = _times(_codes_f32(codes, g, code), rotation(g).T, fence_out=False,
                      own_matrix=True)
        return (sums * (s32 / g)[:, None]).astype(out_dtype).reshape(*codes.shape[:-1], -1)

    if not native or jnp.dtype(out_dtype) not in (jnp.bfloat16, jnp.float32):
        return pure(codes, steps, exponents)
    kernels = {}
    if native_cpu.in_use():
        def on_cpu(codes, steps, exponents):
            return native_cpu.unrotate(codes, steps, exponents, rotation(g).T, code, out_dtype)
        kernels["cpu"] = on_cpu
    gpu = _gpu_kernels(steps.shape[-1] * g, g, code)
    if gpu is not None:
        def on_gpu(codes, steps, exponents):
            return gpu.unrotate(codes, steps, exponents, g, code, out_dtype)
        kernels["cuda"] = on_gpu
    if not kernels:
        return pure(codes, steps, exponents)
    return lax.platform_dependent(codes, steps, exponents, default=pure, **kernels)


def wire_bytes_per_value(g: int, code: str, width: int | None = None) -> float:
    """Bytes on the wire per value: payload, a step byte per run of g and, for rows of `width`
    values in a piece, an exponent byte per row (None: rows long enough not to count)."""
    return (0.5 if code == "int4" else 1.0) + 1.0 / g + (1.0 / width if width else 0.0)
