"""EQuARX: block-wise quantized AllReduce for JAX (shard_map + ppermute, or a Pallas TPU kernel).

`AllReduceConfig` is the one switch and its label; `all_reduce(x, axis_name, cfg)` runs inside
`jax.shard_map` (a tuple of axes: the multi-axis schedule) and gives identical replicas;
`plan_for` and `resolved_variant` say which layout and schedule a message takes;
`quantize_blockwise` / `dequantize` are the paper's tile codec; `bytes_sent_per_device` and
`ideal_ring_bytes` count bytes. How it works: docs/algorithm.md.
"""
from equarx.accounting import bytes_sent_per_device, collectives, ideal_ring_bytes
from equarx.collective import (Layout, TokenLayout, all_reduce, folds_rotation, multi_axis_plan,
                               plan_for, plan_layout, plan_token_layout, resolved_variant)
from equarx.config import AllReduceConfig
from equarx.quantize import absmax, dequantize, quantize_blockwise, scale_round_cast

__all__ = [
    "AllReduceConfig",
    "Layout",
    "TokenLayout",
    "absmax",
    "all_reduce",
    "bytes_sent_per_device",
    "collectives",
    "dequantize",
    "folds_rotation",
    "ideal_ring_bytes",
    "multi_axis_plan",
    "plan_for",
    "plan_layout",
    "plan_token_layout",
    "resolved_variant",
    "quantize_blockwise",
    "scale_round_cast",
]
