"""What one device sends for one AllReduce of each method: messages, sequential steps and bytes
(the byte model every prediction starts from)."""
from __future__ import annotations

import dataclasses

from equarx import plan_for, plan_layout, resolved_variant
from equarx.codec_spec import wire_bytes_per_value
from equarx.quantize import SCALE_ROWS, TILE_ELEMENTS
from equarx.ring import ring_hops
from eval.quality import mode_config


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One AllReduce as seen by one device: how many messages it sends (one collective-permute
    each, or one psum step), how many of those follow one another when concurrent chains overlap
    (`steps`), and how many bytes it sends in total. `xla_psum` marks XLA's own psum."""

    messages: int
    steps: int
    bytes_per_device: float
    xla_psum: bool = False


def allreduce_schedule(label: str, n_elements: int, n_devices: int, minishards: int = 4,
                       dtype_bytes: int = 2, pipelined: bool = True,
                       topology: str | None = None) -> Schedule:
    """What one device sends for one AllReduce of `n_elements` values of `dtype_bytes` bytes.

    Mirrors equarx's layout (padding to shards x minishards x 8x128 tiles, float32 scales per
    minishard) and messages (pipelined: one collective-permute per minishard per chain and hop;
    else one per chain and hop); XLA's psum is counted as a bandwidth-optimal ring of 2 (N-1)
    steps, as equarx's accounting does.
    """
    if n_elements < 1 or n_devices < 1:
        raise ValueError(f"need n_elements >= 1 and n_devices >= 1, got {n_elements}, {n_devices}")
    n = n_devices
    if n == 1:
        return Schedule(0, 0, 0.0)
    cfg = mode_config(label)  # None: the naive strawman
    if cfg is None:  # all-gather of int8 values plus one float32 scale per device
        return Schedule(n - 1, n - 1, (n - 1) * (n_elements + 4))
    method, variant, phases = cfg.method, cfg.variant, cfg.phases
    if method in ("f32", "bf16"):
        width = 4 if method == "f32" else 2
        steps = 2 * (n - 1)
        return Schedule(steps, steps, 2 * (n - 1) / n * n_elements * width, xla_psum=True)
    cfg = dataclasses.replace(cfg, minishards=minishards, pipelined=pipelined,
                              topology=topology or cfg.topology)
    variant = resolved_variant(cfg, n, n_elements * dtype_bytes)
    if method == "bf16_ring" or cfg.blocks == "group":
        return _token_schedule(cfg, variant, n_elements, n, dtype_bytes)
    layout = plan_layout(n_elements, n, minishards)
    m, k = layout.minishards, layout.tiles
    seq_hops, all_hops = ring_hops(variant, n)
    if cfg.blocks == "hadamard":  # a float32 scale per 128 values
        int8_bytes = k * (TILE_ELEMENTS + TILE_ELEMENTS // 32)
    else:
        int8_bytes = (k + SCALE_ROWS) * TILE_ELEMENTS  # payload rows + 4 rows of scale bytes
    plain_bytes = k * TILE_ELEMENTS * (2 if method == "bf16_ring" else dtype_bytes)

    def phase(quantized: bool) -> float:
        return all_hops * m * (int8_bytes if quantized else plain_bytes)

    if method == "bf16_ring":
        total = 2 * phase(False)
    else:
        total = phase(phases in ("both", "rs")) + phase(phases in ("both", "ag"))
    if variant == "semi":  # every chain carries every minishard
        messages = 2 * all_hops * (m if pipelined else 1)
    else:  # two chains (one if m == 1) share the minishards
        messages = 2 * seq_hops * (m if pipelined else min(m, 2))
    return Schedule(messages, 2 * seq_hops, total)


def _token_schedule(cfg, variant: str, n_elements: int, n: int, dtype_bytes: int) -> Schedule:
    """The token layout's sends (equarx.layout.TokenLayout, one row of n_elements values: the
    column padding of a real [tokens, d_model] message is at most a group per shard and row)."""
    layout = plan_for(cfg, (n_elements,), n, variant)
    shard = layout.padded_elements / n
    pieces = layout.pieces if cfg.pipelined else 1
    if cfg.method == "bf16_ring":
        rs_width = ag_width = 2.0
    else:
        quantized = wire_bytes_per_value(cfg.group_size, cfg.method, layout.width)
        rs_width = quantized if cfg.phases in ("both", "rs") else dtype_bytes
        ag_width = quantized if cfg.phases in ("both", "ag") else dtype_bytes
    total = (n - 1) * shard * (rs_width + ag_width)
    if variant == "twoshot":  # N-1 direct sends per phase, all at once
        return Schedule(2 * (n - 1) * pieces, 2, total)
    seq_hops, all_hops = ring_hops(variant, n)
    if variant == "semi":
        return Schedule(2 * all_hops * pieces, 2 * seq_hops, total)
    return Schedule(2 * seq_hops * (pieces if cfg.pipelined else min(layout.pieces, 2)),
                    2 * seq_hops, total)
