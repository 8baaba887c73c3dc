"""The one switch that selects how a tensor-parallel reduction is performed, and its label."""
from __future__ import annotations

import dataclasses
import operator
from typing import Literal

Method = Literal["f32", "bf16", "bf16_ring", "int8", "int4", "fp8"]
Variant = Literal["auto", "full", "semi", "twoshot"]
Phases = Literal["both", "rs", "ag"]
Blocks = Literal["group", "tile", "hadamard"]
Topology = Literal["auto", "ring", "switched"]
Impl = Literal["ppermute", "pallas"]

METHODS = ("f32", "bf16", "bf16_ring", "int8", "int4", "fp8")
QUANTIZED = ("int8", "int4", "fp8")  # methods with a quantizing codec
RING_METHODS = ("bf16_ring",) + QUANTIZED  # methods that run this package's schedules
VARIANTS = ("auto", "full", "semi", "twoshot")
PHASES = ("both", "rs", "ag")
BLOCKS = ("group", "tile", "hadamard")
TOPOLOGIES = ("auto", "ring", "switched")
GROUP_SIZES = (16, 32, 64, 128)
IMPLS = ("ppermute", "pallas")


def _is_int(value) -> bool:
    try:
        operator.index(value)  # int, numpy integers; not float, str or bool-like floats
    except TypeError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class AllReduceConfig:
    """How `equarx.all_reduce` reduces.

    method: "f32" (XLA psum in float32), "bf16" (XLA psum in bfloat16), "bf16_ring" (this
      package's schedules, unquantized, bf16 on the wire), or a quantized wire type: "int8"
      (EQuARX), "int4" (two values per byte) or "fp8" (float8 e4m3 with a block scale).
    variant: the schedule. "full" (full-loop ring, both directions), "semi" (semi-loop:
      bidirectional chains of about N/2 hops), "twoshot" (reduce-scatter as direct sends to
      each owner, then a direct all-gather: every value quantized exactly twice whatever N),
      or "auto" (picked per message from the axis size, its bytes and `topology`; see
      equarx.schedule).
    phases: which phases are quantized: "both", "rs" (reduce-scatter only), "ag".
    blocks: how quantized values share scales.
      "group" (default): the token-local layout (every row of the message split by columns
        across the shards) and, within a row, runs of `group_size` values rotated by a
        randomized Hadamard transform and given one scale (a byte on a grid below the row's
        exponent byte). A row's result depends on that row alone, bitwise.
      "tile" (the paper's): the message flattened, per minishard one float32 8x128 scale tile,
        scale[s, l] covering the K values at that tile position (mixes tokens).
      "hadamard": the flattened message rotated in runs of 128, one float32 scale per 128.
    group_size: values per scale (and per rotation) with blocks="group".
    topology: how the devices are linked, for variant="auto": "ring" (a torus' ring, where
      sends to far devices cross several links: TPU), "switched" (every pair one hop: GPUs
      behind NVSwitch, hosts behind a network switch), or "auto" (ring on TPU, else switched).
    minishards: an upper bound on how many pieces a shard is cut into for pipelining (each
      travels as its own ppermute when `pipelined`).
    min_bytes: messages smaller than this (in bytes of the caller's dtype) use the bf16 psum.
    pipelined: True sends each minishard as its own ppermute (XLA may overlap one minishard's
      transfer with another's quantization); False sends all the minishards of a chain in one
      ppermute per hop (fewer, larger messages: better where collectives block, as on XLA:CPU).
    impl: how a ring method runs: "ppermute" (unrolled lax.ppermutes, any backend) or "pallas"
      (Pallas TPU kernels with remote DMAs: equarx.pallas_ring, over several axes
      equarx.pallas_torus; interpreted off TPU, slowly).
    """

    method: Method = "bf16"
    variant: Variant = "auto"
    phases: Phases = "both"
    minishards: int = 4
    min_bytes: int = 0
    pipelined: bool = True
    blocks: Blocks = "group"
    group_size: int = 32
    topology: Topology = "auto"
    impl: Impl = "ppermute"

    def __post_init__(self):
        for name, choices in (("method", METHODS), ("variant", VARIANTS), ("phases", PHASES),
                              ("blocks", BLOCKS), ("topology", TOPOLOGIES), ("impl", IMPLS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if not _is_int(self.minishards) or self.minishards < 1:
            raise ValueError(f"minishards must be an integer >= 1, got {self.minishards!r}")
        if not _is_int(self.min_bytes) or self.min_bytes < 0:
            raise ValueError(f"min_bytes must be an integer >= 0, got {self.min_bytes!r}")
        if not _is_int(self.group_size) or self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        # Plain ints, so that to_dict() serialises (numpy integers are accepted above).
        for name in ("minishards", "min_bytes", "group_size"):
            object.__setattr__(self, name, operator.index(getattr(self, name)))
        if not isinstance(self.pipelined, bool):
            raise ValueError(f"pipelined must be a bool, got {self.pipelined!r}")
        if self.method in ("int4", "fp8") and self.blocks != "group":
            raise ValueError(f"{self.method} needs blocks='group', got {self.blocks!r}")
        if self.impl != "ppermute" and self.method not in RING_METHODS:
            raise ValueError(f"impl={self.impl!r} needs a ring method {RING_METHODS}, "
                             f"got {self.method!r} (XLA's own psum)")

    @property
    def token_local(self) -> bool:
        """Whether a row's result depends on that row's partial sums alone, bitwise (the
        layout and the scales keep to one row; XLA's psums reduce each value on its own)."""
        if self.method in ("f32", "bf16"):
            return True
        return self.blocks == "group"

    @property
    def group_codec(self) -> bool:
        """Whether the ppermute schedules quantize with the group codec (codecs.GroupCodec),
        whose operations have native kernels on some platforms (equarx.backends): XLA's psums,
        bf16_ring, the flat "tile" / "hadamard" scales and the Pallas kernel never call them."""
        return self.method in QUANTIZED and self.blocks == "group" and self.impl == "ppermute"

    @property
    def label(self) -> str:
        """Short name used in metrics labels, benchmark rows, /health and on the command line:
        method, then -variant, -phases, +blocks where they differ from the defaults, then the
        group size where it is not 32, then @impl where it is not ppermute (e.g. "int8",
        "int8-full+tile", "int4-twoshot/64", "int8-full+tile@pallas")."""
        if self.method in ("f32", "bf16"):
            return self.method
        label = self.method
        if self.variant != "auto":
            label += f"-{self.variant}"
        if self.method != "bf16_ring":
            if self.phases != "both":
                label += f"-{self.phases}"
            if self.blocks != "group":
                label += f"+{self.blocks}"
            elif self.group_size != 32:
                label += f"/{self.group_size}"
        if self.impl != "ppermute":
            label += f"@{self.impl}"
        return label

    @classmethod
    def from_label(cls, label: str, **fields) -> "AllReduceConfig":
        """The inverse of `label`: "f32", "bf16", "bf16_ring[-full|-semi|-twoshot]", "int8",
        "int8-semi", "int8-full+tile", "int8-semi-ag+hadamard", "int4-twoshot/64",
        "int8-full+tile@pallas", ... Other fields (minishards, min_bytes, pipelined, topology)
        come from keyword arguments."""
        example = ("e.g. 'bf16', 'bf16_ring', 'int8', 'int8-semi', 'int8-full+tile', "
                   "'int8-twoshot-ag', 'int4/64', 'int8-full@pallas'")
        label, at, impl = label.partition("@")
        if at and (impl not in IMPLS or impl == "ppermute"):  # ppermute is spelled by no suffix
            raise ValueError(f"cannot parse AllReduce label {label + at + impl!r} ({example})")
        if at:
            fields["impl"] = impl
        base, _, group = label.partition("/")
        base, plus, blocks = base.partition("+")
        parts = base.split("-")
        method = parts[0]
        rest = parts[1:]
        variant = rest.pop(0) if rest and rest[0] in VARIANTS else "auto"
        phases = rest.pop(0) if rest and rest[0] in PHASES else "both"
        bad = (method not in METHODS or rest or (plus and not blocks)
               or (method in ("f32", "bf16") and (base != method or plus or group))
               or (method == "bf16_ring" and (plus or group or phases != "both"))
               or (group and not group.isdigit()) or (group and blocks not in ("", "group")))
        if bad:
            raise ValueError(f"cannot parse AllReduce label {label!r} ({example})")
        if group:
            fields["group_size"] = int(group)
        return cls(method, variant, phases, blocks=blocks or "group", **fields)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
