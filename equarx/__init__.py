"""EQuARX: block-wise int8 quantized AllReduce for JAX (shard_map + ppermute).

Public API:
  AllReduceConfig                 the one switch (method, variant, phases, blocks, ...) and its label
  all_reduce(x, axis_name, cfg)   inside jax.shard_map; same shape/dtype as x, identical replicas;
                                  axis_name a tuple of mesh axes: the multi-axis schedule;
                                  rotated=True: x comes from weights with the codec's rotation
                                  folded in (folds_rotation, groups.fold_rotation)
  plan_for(cfg, shape, n, variant) the layout a message takes (plan_token_layout: rows split by
                                  columns across shards; plan_layout: the paper's flat 8x128 tiles)
  resolved_variant(cfg, n, bytes) the schedule variant="auto" picks (equarx.schedule)
  quantize_blockwise, dequantize  the paper's tile codec (Qp1 `absmax`, Qp2 `scale_round_cast`)
  bytes_sent_per_device(compiled), ideal_ring_bytes(n, dtype_bytes, n_devices)  byte accounting
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
