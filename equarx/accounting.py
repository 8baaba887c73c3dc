"""Bytes each device sends, read from a compiled program's HLO text (and its size:
`program_size`): a figure that does not depend on network noise, as timings do.

collective-permute: the operand bytes, per source device; all-reduce: what a bandwidth-optimal
ring sends, 2 (N-1)/N x operand bytes; all-gather: (N-1)/N x result bytes; reduce-scatter:
(N-1) x result bytes; all-to-all: (N-1)/N x operand bytes. An op inside a while loop counts
once (this package's schedules are unrolled).
"""
from __future__ import annotations

import collections
import dataclasses
import re

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "s4": 0.5, "u4": 0.5,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
KINDS = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")

_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\([^=]*?\)|\S+)\s+"
    r"(?P<op>collective-permute|all-reduce|all-gather|reduce-scatter|all-to-all)(?P<start>-start)?\("
)
_PAIRS = re.compile(r"source_target_pairs=\{([^}]*(?:\}\s*,\s*\{[^}]*)*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,\s]*\},?\s*)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[")
_NUM_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_NUM_REPLICAS = re.compile(r"replica_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective in the program. `bytes_by_device` maps device id -> bytes it sends;
    `None` as key means 'every device in the groups' when the groups are implicit."""

    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of the counted buffers
    group_size: int
    bytes_by_device: dict
    # A collective-permute's (source, target) device pairs, in the program's order; a link-level
    # model needs who sends to whom, not only how much each device sends.
    pairs: tuple[tuple[int, int], ...] = ()

    @property
    def buffer_bytes(self) -> float:
        """Bytes of the counted buffers: for a collective-permute, one message of one pair."""
        return sum(_nbytes(s) for s in self.shapes)


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dtype, dims in _SHAPE.findall(text):
        if dtype in DTYPE_BYTES:
            out.append((dtype, tuple(int(v) for v in dims.split(",") if v)))
    return out


def _nbytes(shape: tuple[str, tuple[int, ...]]) -> float:
    dtype, dims = shape
    n = 1
    for v in dims:
        n *= v
    return n * DTYPE_BYTES[dtype]


def _groups(line: str, default_size: int) -> list[list[int]] | int:
    """Explicit groups as lists, or just the group size when the text does not list devices."""
    m = _GROUPS_LIST.search(line)
    if m and m.group(1).strip():
        return [[int(v) for v in g.split(",") if v.strip()]
                for g in re.findall(r"\{([0-9,\s]*)\}", m.group(1))]
    m = _GROUPS_IOTA.search(line)
    if m:
        dims = [int(v) for v in m.group(1).split(",")]
        return dims[-1]
    return default_size


def hlo_text(program) -> str:
    """HLO text of a compiled program (`jax.jit(f).lower(...).compile()`) or the text itself."""
    if isinstance(program, str):
        return program
    if hasattr(program, "as_text"):
        text = program.as_text()
        if "HloModule" not in text:
            raise ValueError("need a compiled program (lower(...).compile()), not a lowering")
        return text
    raise TypeError(f"expected HLO text or a compiled program, got {type(program).__name__}")


def program_size(program) -> tuple[int, int]:
    """(fused kernels in the entry computation, HLO instructions in all) of a compiled program:
    what its compile time and executable size grow with."""
    text = hlo_text(program)
    fusions = re.findall(r"^\s*\S+ = \S+ fusion\(", text[text.index("ENTRY"):], re.M)
    return len(fusions), len(re.findall(r"^\s*\S+ = ", text, re.M))


def collectives(program) -> list[CollectiveOp]:
    """Every collective in the program with the bytes each device sends for it."""
    text = hlo_text(program)
    m = _NUM_PARTITIONS.search(text) or _NUM_REPLICAS.search(text)
    default_size = int(m.group(1)) if m else 1
    ops = []
    for line in text.splitlines():
        found = _INSTR.match(line)
        if not found:
            continue
        kind, is_start = found.group("op"), bool(found.group("start"))
        shapes = _shapes(found.group("shape"))
        if kind == "collective-permute":
            if is_start:  # (operand, result, contexts...): the operand is what moves
                shapes = shapes[:1]
            size = sum(_nbytes(s) for s in shapes)
            found_pairs = _PAIRS.search(line)
            pairs = tuple((int(a), int(b)) for a, b in re.findall(
                r"\{(\d+),(\d+)\}", "{" + found_pairs.group(1) + "}")) if found_pairs else ()
            sources = collections.Counter(a for a, _ in pairs)
            by_dev = {dev: size * count for dev, count in sources.items()}
            ops.append(CollectiveOp(kind, tuple(shapes), 2, by_dev, pairs))
            continue
        groups = _groups(line, default_size)
        n = len(groups[0]) if isinstance(groups, list) else groups
        if kind == "all-gather" and is_start:  # (operand, result)
            shapes = shapes[len(shapes) // 2:]
        elif kind == "all-reduce" and is_start and len(shapes) > 1:
            shapes = shapes[: len(shapes) // 2] or shapes
        size = sum(_nbytes(s) for s in shapes)
        per_device = {
            "all-reduce": 2 * (n - 1) / n * size,
            "all-gather": (n - 1) / n * size,
            "reduce-scatter": (n - 1) * size,
            "all-to-all": (n - 1) / n * size,
        }[kind] if n > 1 else 0.0
        if isinstance(groups, list):
            by_dev = {dev: per_device for g in groups for dev in g}
        else:
            by_dev = {None: per_device}
        ops.append(CollectiveOp(kind, tuple(shapes), n, by_dev))
    return ops


def bytes_sent_per_device(program) -> float:
    """Bytes the busiest device sends in one run of the program (collectives only)."""
    totals: collections.Counter = collections.Counter()
    implicit = 0.0
    for op in collectives(program):
        for dev, b in op.bytes_by_device.items():
            if dev is None:
                implicit += b
            else:
                totals[dev] += b
    return (max(totals.values()) if totals else 0.0) + implicit


def ideal_ring_bytes(n_elements: int, dtype_bytes: float, n_devices: int) -> float:
    """Bytes each device sends in a bandwidth-optimal ring AllReduce: 2 (N-1)/N x message."""
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    return 2 * (n_devices - 1) / n_devices * n_elements * dtype_bytes
