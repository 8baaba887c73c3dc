"""Codecs: how float32 pieces f32[g, *piece] travel on the wire as one array (one ppermute).

A schedule encodes a partial sum before each send and decodes what it receives; the codec picks the
wire type and where the scales go (`for_phases` chooses one from an AllReduceConfig). Every encode
is `encode_sum`: a piece plus its arrivals, decoded and added in order, then encoded. See
docs/algorithm.md, "Version 2"."""
from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax

from equarx import backends, codec_spec, groups, native_cpu, triton_codecs
from equarx import quantize as qz
from equarx.layout import TokenLayout


class Codec(Protocol):
    def encode(self, x: jax.Array) -> jax.Array: ...

    def decode(self, wire: jax.Array) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class FlatInt8Codec:
    """The flat layout's int8 codecs. rows=False: the paper's tile scales, per minishard int8
    payload rows then its float32 8x128 scales (one int8 buffer [g, K + 4, 1024] for a piece of
    g minishards). rows=True (blocks="hadamard"): one float32 scale per 128 consecutive values,
    packed as int8 rows of 32 bytes [g, 33 K, 32] (the payload's 32 K rows, then K rows of
    scales)."""

    rows: bool = False

    def encode(self, x: jax.Array) -> jax.Array:
        if self.rows:
            return qz.pack_rows(*qz.quantize_rows(x))
        return qz.pack(*qz.quantize_blockwise(x))

    def decode(self, wire: jax.Array) -> jax.Array:
        return qz.packed_dequantize_rows(wire) if self.rows else qz.packed_dequantize(wire)


@dataclasses.dataclass(frozen=True)
class GroupCodec:
    """blocks="group" (token layout): runs of `group` values of one row, a scale byte each and
    an exponent byte per row, `code` payload ("int8", "int4", "fp8"); see equarx.groups."""

    group: int
    code: str
    piece_shape: tuple[int, ...]  # the shape of one minishard: [rows, width]
    # Decode to the caller's dtype with the rotation undone (groups.unrotate_codes): for the
    # all-gather's final decode, whose values nothing adds to any more.
    unrotate_to: jnp.dtype | None = None

    def encode(self, x: jax.Array) -> jax.Array:
        """[..., *piece_shape] -> [..., wire bytes]: each minishard on its own (any leading
        axes, e.g. pieces stacked by `encode_shards`)."""
        lead = x.shape[:x.ndim - len(self.piece_shape)]
        wire = groups.encode(x.reshape(-1, *self.piece_shape), self.group, self.code)
        return wire.reshape(*lead, wire.shape[-1])

    def decode(self, wire: jax.Array) -> jax.Array:
        if self.unrotate_to is not None:
            return self.decode_parts(*self.wire_parts(wire))
        return codec_spec.decode(wire, self.group, self.code, (wire.shape[0], *self.piece_shape))

    def wire_parts(self, wire: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(codes, steps, exponents), one row per token each (see codec_spec.wire_parts)."""
        return codec_spec.wire_parts(wire, self.piece_shape, self.group, self.code)

    def decode_parts(self, codes: jax.Array, steps: jax.Array, exponents: jax.Array
                     ) -> jax.Array:
        """Values un-rotated to `unrotate_to` from `wire_parts`' arrays (any leading shape)."""
        return groups.unrotate_codes(codes, steps, exponents, self.group, self.code,
                                     self.unrotate_to)

    def gathers_natively(self, layout) -> bool:
        """Whether `unrotate_gathered` runs as a kernel here (equarx.backends'
        gather_unrotate: the native CPU kernel)."""
        return (self.unrotate_to is not None and isinstance(layout, TokenLayout)
                and "cpu" in backends.kernels("gather_unrotate", self.piece_shape[-1],
                                              self.group, self.code, self.unrotate_to))

    def unrotate_gathered(self, device: jax.Array, rows: list[list[jax.Array]],
                          pieces: list[tuple[int, int]], layout) -> jax.Array:
        """rows[r][i]: the wire bytes of piece pieces[i] of relative shard r (device + r's)
        -> the layout's whole buffer in `unrotate_to`, every value decoded and un-rotated in
        its place: the all-gather's end as one native CPU kernel (`gathers_natively`)."""
        wires = [w for row in rows for w in row]
        geometries = [layout.piece_geometry(*p) for p in pieces]
        shape = (layout.minishards, layout.rows_per_minishard, layout.n_devices, layout.halves,
                 layout.width)
        return native_cpu.gather_unrotate(device, wires, codec_spec.rotation(self.group).T,
                                          self.code, self.unrotate_to, shape, geometries)

    def sum_kernels(self, arrival_codec, layout, dtype) -> dict[str, str]:
        """{platform: backend} of `encode_sum`'s kernels here (equarx.backends' encode_sum):
        for the token layout's buffer with arrivals in this codec's own groups and code, what
        a kernel that reads the piece in place takes."""
        if not (isinstance(layout, TokenLayout) and isinstance(arrival_codec, GroupCodec)
                and (arrival_codec.group, arrival_codec.code) == (self.group, self.code)):
            return {}
        return backends.kernels("encode_sum", self.piece_shape[-1], self.group, self.code,
                                dtype)


@dataclasses.dataclass(frozen=True)
class FloatCodec:
    """Unquantized: the values rounded to `dtype`. 16-bit floats travel bit-cast to uint16
    because gloo moves bfloat16 at about half the bytes/s of integer types; the cast is pure
    data movement and changes nothing numerically."""

    dtype: jnp.dtype

    def encode(self, x: jax.Array) -> jax.Array:
        v = x.astype(self.dtype)
        if jnp.dtype(self.dtype).itemsize == 2:
            v = lax.bitcast_convert_type(v, jnp.uint16)
        return v

    def decode(self, wire: jax.Array) -> jax.Array:
        if wire.dtype == jnp.uint16:
            wire = lax.bitcast_convert_type(wire, self.dtype)
        return wire.astype(jnp.float32)


def encode_sum(codec: Codec, buf: jax.Array, layout, shard, piece: tuple[int, int],
               arrivals=(), arrival_codec: Codec | None = None) -> jax.Array:
    """`codec`'s wire bytes of piece `piece` of `buf` at `shard` (`layout.piece`) plus each of
    `arrivals` (wire bytes of that piece from `arrival_codec`, by default `codec`), decoded and
    added in float32 in their order. With no arrivals the piece is encoded in its own dtype.

    The group codec runs this as one kernel that reads the piece in place where
    equarx.backends has one (`GroupCodec.sum_kernels`), with the same bits."""
    arrival_codec = arrival_codec or codec

    def pure(buf, shard, *arrivals):
        return codec.encode(_plus(layout.piece(buf, shard, *piece), arrivals, arrival_codec))

    kernels = _sum_kernels(codec, arrival_codec, layout, piece, buf.dtype, _kernel_sum)
    if not kernels:
        return pure(buf, shard, *arrivals)
    return lax.platform_dependent(buf, jnp.asarray(shard, jnp.int32), *arrivals, default=pure,
                                  **kernels)


def encode_shards(codec: Codec, buf: jax.Array, layout, shards, piece: tuple[int, int]
                  ) -> jax.Array:
    """`encode_sum` of piece `piece` at each of `shards`, without arrivals: [len(shards),
    *wire]. The XLA form encodes the pieces stacked, as one encode: an AllReduce's encodes are
    most of its fused kernels, so one per shard multiplied its compile time and its
    executable's size. The same bits: an encode reads each minishard alone. The kernels of
    `GroupCodec.sum_kernels` still run once per shard."""
    shards = list(shards)

    def pure(buf, where):
        return codec.encode(jnp.stack([layout.piece(buf, where[i], *piece)
                                       for i in range(len(shards))]))

    kernels = _sum_kernels(codec, codec, layout, piece, buf.dtype, _kernel_shards)
    where = jnp.stack([jnp.asarray(s, jnp.int32) for s in shards])
    if not kernels:
        return pure(buf, where)
    return lax.platform_dependent(buf, where, default=pure, **kernels)


def encode_together(codec: Codec, xs: list[jax.Array]) -> list[jax.Array]:
    """`codec.encode` of each of `xs` (stacks [S_i, m_i, *piece] of pieces, one dtype), as one
    encode of them all (see `encode_shards`): [S_i, m_i, *wire] each, the same bits."""
    if not xs:
        return []
    flat = [x.reshape(-1, *x.shape[2:]) for x in xs]
    wire = codec.encode(jnp.concatenate(flat) if len(flat) > 1 else flat[0])
    out, at = [], 0
    for x, f in zip(xs, flat):
        out.append(wire[at:at + f.shape[0]].reshape(*x.shape[:2], *wire.shape[1:]))
        at += f.shape[0]
    return out


def _sum_kernels(codec: Codec, arrival_codec: Codec, layout, piece: tuple[int, int], dtype,
                 call) -> dict:
    """{platform: `call` bound to that platform's encode_sum kernel} where
    `GroupCodec.sum_kernels` has one, else {}."""
    if not isinstance(codec, GroupCodec):
        return {}
    geometry = layout.piece_geometry(*piece) if isinstance(layout, TokenLayout) else None
    impls = {"native_cpu": native_cpu.encode_sum, "triton": triton_codecs.encode_sum}
    return {platform: functools.partial(call, impls[backend], geometry, codec.group, codec.code)
            for platform, backend in codec.sum_kernels(arrival_codec, layout, dtype).items()}


def _kernel_shards(impl, geometry, group, code, buf, where):
    return jnp.stack([impl(buf, where[i], (), geometry, group, code)
                      for i in range(where.shape[0])])


def _kernel_sum(impl, geometry, group, code, buf, shard, *arrivals):
    return impl(buf, shard, arrivals, geometry, group, code)


def reduced(codec: Codec, buf: jax.Array, layout, shard, arrivals: dict) -> jax.Array:
    """A reduce-scatter's result as values: f32[pieces, *piece], each piece of `buf` at `shard`
    plus its arrivals (`codec`'s wire bytes) decoded, added in order."""
    return jnp.concatenate([
        _plus(layout.piece(buf, shard, *piece).astype(jnp.float32), arrivals[piece], codec)
        for piece in sorted(arrivals)])


def _plus(values: jax.Array, arrivals, codec: Codec) -> jax.Array:
    """values plus each arrival decoded by `codec`, added in float32 in order (values keep their
    own dtype when nothing arrives)."""
    for wire in arrivals:
        values = values.astype(jnp.float32) + codec.decode(wire)
    return values


def for_phases(config, dtype, piece_shape: tuple[int, ...]) -> tuple[Codec, Codec]:
    """(reduce-scatter codec, all-gather codec) of a ring method. An unquantized phase of a
    quantized method moves the caller's own precision (bf16 -> bf16, f32 -> f32), so it adds no
    error beyond the input's."""
    if config.method == "bf16_ring":
        bf16 = FloatCodec(jnp.bfloat16)
        return bf16, bf16
    plain = FloatCodec(jnp.dtype(dtype))
    if config.blocks == "group":
        quantized = GroupCodec(config.group_size, config.method, tuple(piece_shape))
    else:
        quantized = FlatInt8Codec(rows=config.blocks == "hadamard")
    rs = quantized if config.phases in ("both", "rs") else plain
    ag = quantized if config.phases in ("both", "ag") else plain
    return rs, ag
