"""The one switch that selects how a tensor-parallel reduction is performed."""
from __future__ import annotations

import dataclasses
import operator
from typing import Literal

Method = Literal["f32", "bf16", "bf16_ring", "int8"]
Variant = Literal["full", "semi"]
Phases = Literal["both", "rs", "ag"]
Blocks = Literal["tile", "hadamard"]

METHODS = ("f32", "bf16", "bf16_ring", "int8")
VARIANTS = ("full", "semi")
PHASES = ("both", "rs", "ag")
BLOCKS = ("tile", "hadamard")


def _is_int(value) -> bool:
    try:
        operator.index(value)  # int, numpy integers; not float, str or bool-like floats
    except TypeError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class AllReduceConfig:
    """How `equarx.all_reduce` reduces.

    method: "f32" (XLA psum in float32), "bf16" (XLA psum in bfloat16: today's baseline),
      "bf16_ring" (our ring schedule, unquantized, bf16 on the wire), "int8" (EQuARX).
    variant: "full" (full-loop ring, both directions) or "semi" (semi-loop, bidirectional chains).
    phases: which phases are quantized for int8: "both", "rs" (reduce-scatter only), "ag".
    minishards: scale blocks per shard, an upper bound (a minishard is never cut below 128
      tiles of 8x128, see equarx.collective); each carries its own 8x128 float32 scales.
    min_bytes: messages smaller than this (in bytes of the caller's dtype) use the bf16 psum.
    pipelined: True sends each minishard as its own ppermute (the paper's pipelining: XLA may
      overlap one minishard's transfer with another's quantization); False sends all the
      minishards a ring direction carries in one ppermute per hop (same bytes, same scales,
      fewer messages: better where collectives block and never overlap compute, as on XLA:CPU).
    blocks: how int8 values share scales. "tile" (the paper's): per minishard one 8x128 scale
      tile, scale[s, l] covering the K elements at that tile position. "hadamard": each run of
      128 consecutive elements is rotated by a randomized Hadamard transform (once before the
      reduce-scatter, undone once after the all-gather) and gets its own float32 scale. It
      costs two cheap transforms and the same wire bytes (4 bytes per 128 values), and is far
      more accurate on activations with outlier channels (see equarx.hadamard).
    """

    method: Method = "bf16"
    variant: Variant = "full"
    phases: Phases = "both"
    minishards: int = 4
    min_bytes: int = 0
    pipelined: bool = True
    blocks: Blocks = "tile"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.phases not in PHASES:
            raise ValueError(f"phases must be one of {PHASES}, got {self.phases!r}")
        if self.blocks not in BLOCKS:
            raise ValueError(f"blocks must be one of {BLOCKS}, got {self.blocks!r}")
        if not _is_int(self.minishards) or self.minishards < 1:
            raise ValueError(f"minishards must be an integer >= 1, got {self.minishards!r}")
        if not _is_int(self.min_bytes) or self.min_bytes < 0:
            raise ValueError(f"min_bytes must be an integer >= 0, got {self.min_bytes!r}")
        # Plain ints, so that to_dict() serialises (numpy integers are accepted above).
        object.__setattr__(self, "minishards", operator.index(self.minishards))
        object.__setattr__(self, "min_bytes", operator.index(self.min_bytes))
        if not isinstance(self.pipelined, bool):
            raise ValueError(f"pipelined must be a bool, got {self.pipelined!r}")

    @property
    def label(self) -> str:
        """Short name used in metrics labels, benchmark rows and /health."""
        if self.method != "int8":
            return self.method
        suffix = "" if self.phases == "both" else f"-{self.phases}"
        blocks = "" if self.blocks == "tile" else f"+{self.blocks}"
        return f"int8-{self.variant}{suffix}{blocks}"

    @classmethod
    def from_label(cls, label: str, **fields) -> "AllReduceConfig":
        """The inverse of `label`: "f32", "bf16", "bf16_ring[-semi]", "int8-full",
        "int8-semi-rs+hadamard", ... The other fields (minishards, min_bytes, pipelined) come
        from keyword arguments."""
        base, plus, blocks = label.partition("+")
        parts = base.split("-")
        quantized = parts[0] == "int8"
        if len(parts) > (3 if quantized else 2) or (plus and not (quantized and blocks)):
            raise ValueError(f"cannot parse AllReduce label {label!r} (e.g. 'bf16', "
                             f"'bf16_ring', 'int8-full', 'int8-semi-rs+hadamard')")
        return cls(parts[0], parts[1] if len(parts) > 1 else "full",
                   parts[2] if len(parts) > 2 else "both", blocks=blocks or "tile", **fields)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
