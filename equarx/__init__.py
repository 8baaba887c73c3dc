"""EQuARX: block-wise int8 quantized AllReduce for JAX (shard_map + ppermute).

Public API: `AllReduceConfig`, `all_reduce(x, axis_name, config)`.
"""
from equarx.config import AllReduceConfig
from equarx.collective import all_reduce

__all__ = ["AllReduceConfig", "all_reduce"]
