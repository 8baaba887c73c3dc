"""Which implementation of the group codec's operations (`OPERATIONS`) runs on which platform: the
one table.

Every operation has the XLA form (equarx.groups over equarx.codec_spec) as its default; a row
adds a kernel for one platform with the same bits (tests/equarx/test_codec_conformance.py). A
traced program carries the usable kernels beside the XLA form and `lax.platform_dependent` picks
by the platform it is compiled for, so one trace serves CPU, GPU and TPU. The Pallas TPU ring
(`@pallas`) has its own codec (equarx.pallas_codecs).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from equarx import native_cpu, triton_codecs

# encode: rotated rows -> wire bytes (`groups.encode`); encode_sum: a reduce-scatter hop, a piece
# of the layout's buffer read in place plus its arrivals decoded and added in float32, encoded
# (`codecs.encode_sum`); decode_add: arrivals decoded and added (`codecs.reduced`; XLA only, the
# kernels fold it into encode_sum); unrotate: codes, steps and exponents -> un-rotated values
# (`groups.unrotate_codes`); gather_unrotate: every arrived piece of the all-gather un-rotated
# into its place (`codecs.GroupCodec.unrotate_gathered`).
OPERATIONS = ("encode", "encode_sum", "decode_add", "unrotate", "gather_unrotate")
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One row: `backend`'s kernel for `operation` on `platform` (lax.platform_dependent's
    name), used in programs traced while `in_use()` holds, for the shapes `takes`."""

    operation: str
    platform: str
    backend: str  # "native_cpu" (equarx/csrc) or "triton" (equarx.triton_codecs)
    in_use: Callable[[], bool]
    takes: Callable[[int, int, str, object], bool]  # (row width, g, code, value dtype)


def _native_takes(width: int, g: int, code: str, dtype) -> bool:
    return code in ("int8", "int4", "fp8") and jnp.dtype(dtype) in _FLOATS


def _triton_takes(width: int, g: int, code: str, dtype) -> bool:
    return triton_codecs.supports(width, g, code) and jnp.dtype(dtype) in _FLOATS


def _native_in_use() -> bool:
    return native_cpu.in_use()  # looked up per call (tests switch the kernels off)


def _triton_in_use() -> bool:
    return triton_codecs.in_use()


TABLE: tuple[Kernel, ...] = (
    Kernel("encode", "cuda", "triton", _triton_in_use, _triton_takes),
    Kernel("encode_sum", "cpu", "native_cpu", _native_in_use, _native_takes),
    Kernel("encode_sum", "cuda", "triton", _triton_in_use, _triton_takes),
    Kernel("unrotate", "cpu", "native_cpu", _native_in_use, _native_takes),
    Kernel("unrotate", "cuda", "triton", _triton_in_use, _triton_takes),
    Kernel("gather_unrotate", "cpu", "native_cpu", _native_in_use, _native_takes),
)


def kernels(operation: str, width: int, g: int, code: str, dtype=jnp.float32
            ) -> dict[str, str]:
    """{platform: backend} of the kernels that programs traced now include for `operation` on
    rows of `width` values in runs of g with `code`, `dtype` being the values' (encode's input,
    encode_sum's buffer, unrotate's output); every other platform runs the XLA form."""
    if operation not in OPERATIONS:
        raise ValueError(f"unknown operation {operation!r}; one of {OPERATIONS}")
    return {k.platform: k.backend for k in TABLE
            if k.operation == operation and k.takes(width, g, code, dtype) and k.in_use()}
