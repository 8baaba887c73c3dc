"""Placing the vision encoder on the tensor-parallel mesh: replicated (the default) or split.

Split: the attention heads (qkv over N, the output projection over N) and the MLP's hidden units
(fc1's columns, fc2's rows) over the "tp" axis, as the text model splits its heads and FFN; each
block's two partial sums go through `equarx.all_reduce` with the model's AllReduce setting.
Replicated: every device holds the whole tower. docs/vision.md has the measurement that chose
the default.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from equarx import AllReduceConfig, all_reduce
from models.gemma3.sharding import AXIS
from models.gemma3.vision import VisionConfig, VisionLayerWeights, VisionWeights, encode

# The split of each layer tensor over "tp" (the others are replicated).
_SPLIT = {"qkv": P(None, None, AXIS, None), "qkv_bias": P(None, AXIS, None),
          "o": P(AXIS, None, None), "fc1": P(None, AXIS), "fc1_bias": P(AXIS), "fc2": P(AXIS, None)}


def vision_mesh(tp: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:tp]), (AXIS,))


def check_vision_tp(c: VisionConfig, tp: int) -> None:
    for what, n in (("num_heads", c.num_heads), ("mlp_hidden", c.mlp_hidden)):
        if n % tp:
            raise ValueError(f"tp={tp} must divide the vision tower's {what}={n} to split it; "
                             "keep the tower replicated instead")


def vision_specs(c: VisionConfig, split: bool) -> VisionWeights:
    """A VisionWeights tree of PartitionSpecs."""
    def spec(layer, name, shape):
        return _SPLIT[name] if split and layer is not None and name in _SPLIT else P()
    return _map(c, spec)


def _map(c: VisionConfig, fn) -> VisionWeights:
    from models.gemma3.vision import map_vision_weights
    return map_vision_weights(c, fn)


def place_vision(weights: VisionWeights, c: VisionConfig, mesh: Mesh, split: bool = False
                 ) -> VisionWeights:
    specs = vision_specs(c, split)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), weights, specs,
                        is_leaf=lambda x: isinstance(x, P))


@functools.lru_cache(maxsize=16)
def _sharded_fn(c: VisionConfig, mesh: Mesh, allreduce: AllReduceConfig, query_chunk: int):
    check_vision_tp(c, mesh.shape[AXIS])
    specs = vision_specs(c, split=True)
    reduce = functools.partial(all_reduce, axis_name=AXIS, config=allreduce)

    def body(w, pixels):
        return encode(w, pixels, c, reduce=lambda x: reduce(x), query_chunk=query_chunk)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=P(),
                                 check_vma=False))


def encode_sharded(weights: VisionWeights, pixels, c: VisionConfig, mesh: Mesh,
                   allreduce: AllReduceConfig | None = None, query_chunk: int = 1024):
    """`vision.encode` with the heads and MLP split over the mesh's "tp" axis."""
    allreduce = allreduce or AllReduceConfig.from_label("f32")
    placed = place_vision(weights, c, mesh, split=True)
    return _sharded_fn(c, mesh, allreduce, query_chunk)(placed, pixels)


__all__ = ["VisionLayerWeights", "check_vision_tp", "encode_sharded", "place_vision",
           "vision_mesh", "vision_specs"]
