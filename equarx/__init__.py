"""EQuARX: block-wise int8 quantized AllReduce for JAX (shard_map + ppermute).

Public API:
  AllReduceConfig                 the one switch (method, variant, phases, minishards, min_bytes)
  all_reduce(x, axis_name, cfg)   inside jax.shard_map; same shape/dtype as x, identical replicas
  plan_layout(n, n_devices, m)    how a message is cut into shards / minishards / 8x128 tiles
  quantize_blockwise, dequantize  the int8 codec (Qp1 `absmax`, Qp2 `scale_round_cast`)
  bytes_sent_per_device(compiled), ideal_ring_bytes(n, dtype_bytes, n_devices)  byte accounting
"""
from equarx.accounting import bytes_sent_per_device, collectives, ideal_ring_bytes
from equarx.collective import Layout, all_reduce, plan_layout
from equarx.config import AllReduceConfig
from equarx.quantize import absmax, dequantize, quantize_blockwise, scale_round_cast

__all__ = [
    "AllReduceConfig",
    "Layout",
    "absmax",
    "all_reduce",
    "bytes_sent_per_device",
    "collectives",
    "dequantize",
    "ideal_ring_bytes",
    "plan_layout",
    "quantize_blockwise",
    "scale_round_cast",
]
