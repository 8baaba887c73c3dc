"""The group codec's encode, reduce-scatter hop (`codecs.encode_sum`) and un-rotation as GPU kernels
(Pallas, Triton lowering), chosen on a CUDA backend.

Each reads a block of rows once, in registers, and gives the CPU programs' bits: the rounding is
kept apart from the product, and 1 / scale comes from integer arithmetic on the scale's bits. Every
row is encoded from its own values (token-local). See docs/algorithm.md, "Version 2", and
docs/results.md, "The codec on a GPU"."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from equarx import codec_spec

# Values a program holds (padded; 16 KiB of float32, in registers) and its warps: the fastest
# of the sizes tried on an H100 (docs/results.md, "Figures moved from code comments").
BLOCK_VALUES = 4096
NUM_WARPS = 4
_MAX_INDEX = 1 << 31  # offsets are int32


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def _chunks(width: int, g: int, chunked: bool) -> tuple[tuple[int, int], ...]:
    """A row's columns as the (offset, size) pieces a kernel loads, each a power of two (a
    Triton block's sides must be): one at or above the width, its end masked, or (`chunked`)
    the width's binary decomposition into runs, largest first, with no lane wasted (a row of
    640 as 512 + 128, of 160 as 128 + 32, where padding leaves 37.5% of the lanes idle)."""
    if not chunked:
        return ((0, _pow2_at_least(width)),)
    runs, out, off = width // g, [], 0
    for bit in reversed(range(runs.bit_length())):
        if runs >> bit & 1:
            out.append((off, g << bit))
            off += g << bit
    return tuple(out)


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


def _block_rows(chunks, g: int, block_values: int) -> int:
    """Rows per block: a power of two, so that the block holds about `block_values` values
    (padding counted: it takes registers too) and each piece's runs fill a dot's 16 rows."""
    per_row = sum(size for _, size in chunks)
    smallest = min(size for _, size in chunks)
    return max(_pow2_at_most(max(1, block_values // per_row)), 16 * g // smallest, 1)


def _reciprocal(scale: jax.Array, step: jax.Array) -> jax.Array:
    """1 / scale rounded to nearest, as a float32 division rounds it, from integer arithmetic.
    A scale is 2^k (32 + m) / 32 (5 mantissa bits m, `codec_spec.scale_parts`), so its reciprocal
    is 2^-k for m = 0 and 2^(-k-1) times 2^29 / (32 + m) units of 2^-23 otherwise (never a
    tie). 0 for a NOT_FINITE run."""
    bits = lax.bitcast_convert_type(scale, jnp.int32)
    ef, m = (bits >> 23) & 0xFF, (bits >> 18) & 31
    q = ((1 << 29) + (32 + m) // 2) // (32 + m)
    inv = jnp.where(m == 0, (254 - ef) << 23, ((253 - ef) << 23) + q - (1 << 23))
    return jnp.where(step == codec_spec.NOT_FINITE, 0.0, lax.bitcast_convert_type(inv, jnp.float32))


def _out(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel's result type: inside shard_map it varies over the mesh axes `like` varies over
    (as the XLA form's would), which a pallas_call's result must state."""
    manual = getattr(jax.typeof(like), "manual_axis_type", None)
    if manual is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


def _rows(i, br: int):
    """A block's global row indices, [br, 1] and [br]."""
    rows = i * br + lax.broadcasted_iota(jnp.int32, (br, 1), 0)
    return rows, rows.reshape(br)


def _cols(off: int, size: int):
    """The global columns [1, size] of the piece of a row at `off`."""
    return off + lax.broadcasted_iota(jnp.int32, (1, size), 1)


class _Wire:
    """Where a block's bytes lie in a wire int8[B, n] of pieces of `rows` rows of `width`
    values (`groups.encode`'s layout), flattened: codes, then step bytes, then exponent bytes."""

    def __init__(self, rows: int, width: int, g: int, code: str):
        self.rows, self.g, self.code = rows, g, code
        self.runs = width // g
        self.payload = width // 2 if code == "int4" else width
        self.n = rows * (self.payload + self.runs + 1)

    def steps_at(self, rows2, run):
        piece, row = rows2 // self.rows, rows2 % self.rows
        return piece * self.n + self.rows * self.payload + row * self.runs + run

    def exponents_at(self, rows1):
        piece, row = rows1 // self.rows, rows1 % self.rows
        return piece * self.n + self.rows * (self.payload + self.runs) + row

    def codes_at(self, rows2, pcols):
        return (rows2 // self.rows) * self.n + (rows2 % self.rows) * self.payload + pcols


def _store_encoded(o_ref, parts, wire: _Wire, rows2, rows1, total: int):
    """Encode a block of rows, given as its pieces [(offset, f32[br, size / g, g])] (zeros past
    a row's end), into `o_ref`, the flat wire, as `groups.encode` would (the module's docstring
    says how the rounding is kept)."""
    code_max = codec_spec.CODES[wire.code]
    amaxes = [codec_spec.absmax(v, -1) for _, v in parts]
    row_max = None  # one piece: scale_parts takes the row's maximum itself
    if len(parts) > 1:
        row_max = functools.reduce(jnp.maximum,
                                   [codec_spec.largest_scale(a, code_max) for a in amaxes])
    live = rows2 < total
    for (off, v), amax in zip(parts, amaxes):
        br, rp, g = v.shape
        step, e, scale, _ = codec_spec.scale_parts(amax, code_max, row_max=row_max)
        # Fenced with a max (no round instruction here): codec_spec.round_half_even.
        bits = codec_spec.round_half_even(v * _reciprocal(scale, step)[..., None], fence="max")
        if wire.code == "int4":  # a run's first half in the low nibbles, its second half high
            q = bits.reshape(br, rp, 2, g // 2)
            second = lax.broadcasted_iota(jnp.int32, q.shape, 2) == 1
            bits = ((jnp.sum(jnp.where(second, 0, q), axis=2) & 0x0F)
                    | (jnp.sum(jnp.where(second, q, 0), axis=2) << 4))
            pcols = _cols(off // 2, rp * g // 2)
        else:
            pcols = _cols(off, rp * g)
        plgpu.store(o_ref.at[wire.codes_at(rows2, pcols)],
                    bits.reshape(br, pcols.shape[1]).astype(jnp.int8),
                    mask=live & (pcols < wire.payload))
        run = _cols(off // g, rp)
        plgpu.store(o_ref.at[wire.steps_at(rows2, run)], step.astype(jnp.int8),
                    mask=live & (run < wire.runs))
    plgpu.store(o_ref.at[wire.exponents_at(rows1)], (e.reshape(br) + 127).astype(jnp.int8),
                mask=rows1 < total)


def _load_decoded(w_ref, wire: _Wire, rows2, rows1, chunks, total: int):
    """`groups.decode` of a block of rows of the flat wire in `w_ref`, as its pieces: a list of
    f32[br, size / g, g], one per chunk (zeros past the rows' ends). A code times its scale is
    exact (7 and 6 significant bits), so a multiply-add a compiler may form with what it is
    added to rounds as the sum does."""
    br, g = rows2.shape[0], wire.g
    live = rows2 < total
    ex = plgpu.load(w_ref.at[wire.exponents_at(rows1)], mask=rows1 < total, other=0)
    out = []
    for off, size in chunks:
        cols = _cols(off, size)
        if wire.code == "int4":  # column j of a run: byte j mod g/2 of its half, high nibble past it
            half = g // 2
            at = wire.codes_at(rows2, (cols // g) * half + cols % half)
            b = plgpu.load(w_ref.at[at], mask=live & (cols < wire.runs * g), other=0)
            q = jnp.where(cols % g >= half, b >> 4, (b << 4) >> 4)
        else:
            q = plgpu.load(w_ref.at[wire.codes_at(rows2, cols)],
                           mask=live & (cols < wire.payload), other=0)
        run = _cols(off // g, size // g)
        st = plgpu.load(w_ref.at[wire.steps_at(rows2, run)], mask=live & (run < wire.runs),
                        other=0)
        s = codec_spec.row_scales(st, ex.reshape(br, 1))
        out.append(q.astype(jnp.float32).reshape(br, size // g, g) * s[..., None])
    return out


def _params(interpret: bool, num_warps: int):
    return None if interpret else plgpu.CompilerParams(num_warps=num_warps)


def encode(x: jax.Array, g: int, code: str, interpret: bool = False,
           block_values: int = BLOCK_VALUES, num_warps: int = NUM_WARPS,
           chunked: bool = False) -> jax.Array:
    """f32/bf16[B, ..., W] -> int8[B, N]: `groups.encode`'s wire, bit for bit. `chunked`: a
    row's columns in power-of-two pieces instead of one padded block (`_chunks`)."""
    b, w = x.shape[0], x.shape[-1]
    if len(x.shape) < 2 or not supports(w, g, code):
        raise ValueError(f"triton_codecs.encode takes int8/int4 rows of a multiple of {g} "
                         f"values, got {x.shape} {code}")
    rows = math.prod(x.shape[1:-1])
    total, wire = b * rows, _Wire(rows, w, g, code)
    if max(total * w, b * wire.n) >= _MAX_INDEX:
        raise ValueError(f"triton_codecs.encode takes fewer than 2^31 values, got {x.shape}")
    chunks = _chunks(w, g, chunked)
    br = _block_rows(chunks, g, block_values)

    def kernel(x_ref, o_ref):
        rows2, rows1 = _rows(pl.program_id(0), br)
        parts = []
        for off, size in chunks:
            cols = _cols(off, size)
            v = plgpu.load(x_ref.at[rows2 * w + cols], mask=(rows2 < total) & (cols < w),
                           other=0).astype(jnp.float32)
            parts.append((off, v.reshape(br, size // g, g)))
        _store_encoded(o_ref, parts, wire, rows2, rows1, total)

    out = pl.pallas_call(
        kernel, out_shape=_out((b * wire.n,), jnp.int8, x), grid=(-(-total // br),),
        in_specs=[pl.no_block_spec], out_specs=pl.no_block_spec, interpret=interpret,
        compiler_params=_params(interpret, num_warps),
    )(x.reshape(-1))
    return out.reshape(b, wire.n)


def encode_sum(buf: jax.Array, shard: jax.Array, arrivals, geometry: dict, g: int, code: str,
               interpret: bool = False, block_values: int = BLOCK_VALUES,
               num_warps: int = NUM_WARPS, chunked: bool = False) -> jax.Array:
    """`codecs.encode_sum` of the group codec as one kernel, bit for bit: the piece of the
    token layout's buffer `buf` (bfloat16 or float32) at `shard` that `geometry` places
    (`TokenLayout.piece_geometry`), read in place, plus each arrival (wire bytes int8[pieces,
    n] of that piece) decoded, added in float32 in order, encoded -> int8[pieces, n]. One
    reduce-scatter hop: 2 or 4 bytes read a value, plus 1 + 1/g + 1/W an arrival, 1 + 1/g + 1/W
    written (XLA's form writes the float32 sum out and reads it back)."""
    pieces, rows, w = geometry["pieces"], geometry["rows"], geometry["width"]
    if not supports(w, g, code):
        raise ValueError(f"triton_codecs.encode_sum takes int8/int4 rows of a multiple of {g} "
                         f"values, got {w} {code}")
    total, wire = pieces * rows, _Wire(rows, w, g, code)
    if max(buf.size, pieces * wire.n) >= _MAX_INDEX:
        raise ValueError(f"triton_codecs.encode_sum takes fewer than 2^31 values, got {buf.shape}")
    chunks = _chunks(w, g, chunked)
    br = _block_rows(chunks, g, block_values)
    base, row_stride = geometry["base"], geometry["row_stride"]
    shard_stride = geometry["shard_stride"]

    def kernel(buf_ref, shard_ref, *refs):
        *arrival_refs, o_ref = refs
        rows2, rows1 = _rows(pl.program_id(0), br)
        start = base + shard_ref[0] * shard_stride + rows2 * row_stride
        parts = []
        for off, size in chunks:
            cols = _cols(off, size)
            v = plgpu.load(buf_ref.at[start + cols], mask=(rows2 < total) & (cols < w),
                           other=0).astype(jnp.float32)
            parts.append(v.reshape(br, size // g, g))
        for a_ref in arrival_refs:
            decoded = _load_decoded(a_ref, wire, rows2, rows1, chunks, total)
            parts = [v + d for v, d in zip(parts, decoded)]
        _store_encoded(o_ref, [(off, v) for (off, _), v in zip(chunks, parts)], wire, rows2,
                       rows1, total)

    out = pl.pallas_call(
        kernel, out_shape=_out((pieces * wire.n,), jnp.int8, buf), grid=(-(-total // br),),
        in_specs=[pl.no_block_spec] * (2 + len(arrivals)), out_specs=pl.no_block_spec,
        interpret=interpret, compiler_params=_params(interpret, num_warps),
    )(buf.reshape(-1), jnp.asarray(shard, jnp.int32).reshape(1),
      *(a.reshape(-1) for a in arrivals))
    return out.reshape(pieces, wire.n)


def unrotate(codes: jax.Array, steps: jax.Array, exponents: jax.Array, g: int, code: str,
             out_dtype, interpret: bool = False, block_values: int = BLOCK_VALUES,
             num_warps: int = NUM_WARPS, chunked: bool = False) -> jax.Array:
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
    chunks = _chunks(w, g, chunked)
    br = _block_rows(chunks, g, block_values)
    half = g // 2
    mt = jnp.asarray(codec_spec.rotation(g).T, jnp.bfloat16)
    mats = (mt[:half], mt[half:]) if code == "int4" else (mt,)

    def kernel(codes_ref, steps_ref, exps_ref, *refs):
        *mat_refs, o_ref = refs
        rows2, rows1 = _rows(pl.program_id(0), br)
        live = rows2 < total
        ex = plgpu.load(exps_ref.at[rows1], mask=rows1 < total, other=0)
        for off, size in chunks:
            rp = size // g  # runs of this piece of a row
            cols = _cols(off, size)
            run = _cols(off // g, rp)
            st = plgpu.load(steps_ref.at[rows2 * runs + run], mask=live & (run < runs), other=0)
            s = codec_spec.row_scales(st, ex.reshape(br, 1)) / g  # [br, rp]
            if code == "int4":
                pcols = _cols(off // 2, size // 2)
                packed = plgpu.load(codes_ref.at[rows2 * c + pcols], mask=live & (pcols < c),
                                    other=0)
                low = ((packed << 4) >> 4).astype(jnp.bfloat16).reshape(br * rp, half)
                high = (packed >> 4).astype(jnp.bfloat16).reshape(br * rp, half)
                sums = (jnp.dot(low, mat_refs[0][...], preferred_element_type=jnp.float32)
                        + jnp.dot(high, mat_refs[1][...], preferred_element_type=jnp.float32))
            else:
                q = plgpu.load(codes_ref.at[rows2 * c + cols], mask=live & (cols < w), other=0)
                sums = jnp.dot(q.astype(jnp.bfloat16).reshape(br * rp, g), mat_refs[0][...],
                               preferred_element_type=jnp.float32)
            out = (sums * s.reshape(br * rp, 1)).astype(out_dtype).reshape(br, size)
            plgpu.store(o_ref.at[rows2 * w + cols], out, mask=live & (cols < w))

    out = pl.pallas_call(
        kernel,
        out_shape=_out((total * w,), out_dtype, codes),
        grid=(-(-total // br),),
        in_specs=[pl.no_block_spec] * (3 + len(mats)),
        out_specs=pl.no_block_spec,
        interpret=interpret, compiler_params=_params(interpret, num_warps),
    )(codes.reshape(-1), steps.reshape(-1), exponents.reshape(-1), *mats)
    return out.reshape(*lead, w)
