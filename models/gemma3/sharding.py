"""Tensor-parallel layout, declared once: logical axes -> the mesh axis "tp".

Sharded over tp: query heads, the FFN hidden dimension, the vocabulary (embedding and logits),
and KV heads when tp divides their number. Replicated: norms' scales, and the KV projection when
there are fewer KV heads than devices (Gemma 3 270M and 1B have a single KV head); each device
then computes only the KV head its query heads use, so the KV *cache* is still split over tp.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.gemma3.config import Gemma3Config
from models.gemma3.kv_cache import KVCache, LayerCache
from models.gemma3.weights import Weights, map_weights

AXIS = "tp"

# Logical axes of each tensor's dims.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "d_model"),
    "final_norm": ("d_model",),
    "q": ("d_model", "heads", "head_dim"),
    "kv": ("d_model", None, "kv_heads", "head_dim"),
    "o": ("heads", "head_dim", "d_model"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "pre_attn_norm": ("d_model",),
    "post_attn_norm": ("d_model",),
    "pre_ffw_norm": ("d_model",),
    "post_ffw_norm": ("d_model",),
    "gating": ("d_model", None, "ffn"),
    "linear": ("ffn", "d_model"),
}
CACHE_AXES = {"k": ("slots", "cache_heads", "head_dim", "seq"),
              "v": ("slots", "cache_heads", "seq", "head_dim")}


def check_tp(c: Gemma3Config, tp: int) -> None:
    """Raise a clear error when `c` cannot be split `tp` ways."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    for what, n in (("num_heads", c.num_heads), ("ffn_hidden", c.ffn_hidden),
                    ("vocab_size", c.vocab_size)):
        if n % tp:
            raise ValueError(f"tp={tp} must divide {what}={n} of {c.name}")
    if c.num_kv_heads % tp and tp % c.num_kv_heads:
        raise ValueError(f"tp={tp} must divide num_kv_heads={c.num_kv_heads} of {c.name}, or be "
                         "a multiple of it (KV heads are then replicated)")


def kv_sharded(c: Gemma3Config, tp: int) -> bool:
    return c.num_kv_heads % tp == 0


def local_kv_heads(c: Gemma3Config, tp: int) -> int:
    """KV heads each device computes and caches."""
    return c.num_kv_heads // tp if kv_sharded(c, tp) else 1


def rules(c: Gemma3Config, tp: int) -> dict[str, str | None]:
    return {"vocab": AXIS, "heads": AXIS, "ffn": AXIS, "cache_heads": AXIS,
            "kv_heads": AXIS if kv_sharded(c, tp) else None}


def _spec(logical: tuple[str | None, ...], table: dict) -> P:
    return P(*(table.get(a) if a else None for a in logical))


def weight_specs(c: Gemma3Config, tp: int) -> Weights:
    """PartitionSpec of every weight, in a Weights tree."""
    table = rules(c, tp)
    return map_weights(c, lambda layer, name, shape: _spec(PARAM_AXES[name], table))


def cache_specs(c: Gemma3Config, tp: int) -> KVCache:
    table = rules(c, tp)
    layer = LayerCache(k=_spec(CACHE_AXES["k"], table), v=_spec(CACHE_AXES["v"], table))
    return KVCache(layers=(layer,) * c.num_layers)


def make_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D mesh over `tp` devices, with a clear error when there are not enough of them."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tp:
        platform = devices[0].platform if devices else "?"
        hint = (" On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is "
                "imported to get N devices." if platform == "cpu" else "")
        raise ValueError(f"tp={tp} needs {tp} devices, only {len(devices)} {platform} device(s) "
                         f"are available.{hint}")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def named(mesh: Mesh, specs):
    """NamedSharding tree for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))
