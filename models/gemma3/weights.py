"""The parameter pytree: one LayerWeights per layer, in matmul-friendly layouts.

Each projection is stored with its contracted dimension first ([D, N, H] for the query
projection, officially [N, D, H]), the layout matmul kernels read without a transpose;
conversion from and to the official tree is a fixed transpose per tensor. Layers are separate
arrays, not stacked for a `lax.scan`: on CPU, slicing a layer out of a stack copies its weights
on every call.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import numpy as np

from models.gemma3.config import Gemma3Config

Array = Any  # jax.Array, np.ndarray, or a ShapeDtypeStruct / PartitionSpec in parallel trees


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One transformer block."""

    q: Array  # [D, N, H]      official attn/q_einsum/w [N, D, H]
    kv: Array  # [D, 2, K, H]  official attn/kv_einsum/w [2, K, D, H] (keys, values)
    o: Array  # [N, H, D]      official attn/attn_vec_einsum/w
    q_norm: Array  # [H]
    k_norm: Array  # [H]
    pre_attn_norm: Array  # [D]
    post_attn_norm: Array  # [D]
    pre_ffw_norm: Array  # [D]
    post_ffw_norm: Array  # [D]
    gating: Array  # [D, 2, F]  official mlp/gating_einsum [2, F, D] (gate, up)
    linear: Array  # [F, D]     official mlp/linear (down projection)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    embed: Array  # [V, D], also the (tied) output projection
    final_norm: Array  # [D]
    layers: tuple[LayerWeights, ...]


# Official per-layer path (below layer_{i}/) of each LayerWeights field.
OFFICIAL_LAYER_PATHS: dict[str, tuple[str, ...]] = {
    "q": ("attn", "q_einsum", "w"),
    "kv": ("attn", "kv_einsum", "w"),
    "o": ("attn", "attn_vec_einsum", "w"),
    "q_norm": ("attn", "_query_norm", "scale"),
    "k_norm": ("attn", "_key_norm", "scale"),
    "pre_attn_norm": ("pre_attention_norm", "scale"),
    "post_attn_norm": ("post_attention_norm", "scale"),
    "pre_ffw_norm": ("pre_ffw_norm", "scale"),
    "post_ffw_norm": ("post_ffw_norm", "scale"),
    "gating": ("mlp", "gating_einsum"),
    "linear": ("mlp", "linear"),
}
LAYER_FIELDS = tuple(OFFICIAL_LAYER_PATHS)
# Our layout = np.transpose(official, FROM_OFFICIAL[field]) (identity for other fields).
FROM_OFFICIAL: dict[str, tuple[int, ...]] = {"q": (1, 0, 2), "kv": (2, 0, 1, 3), "gating": (2, 0, 1)}


def from_official(field: str | None, x):
    return np.transpose(x, FROM_OFFICIAL[field]) if field in FROM_OFFICIAL else x


def to_official(field: str | None, x):
    return np.transpose(x, np.argsort(FROM_OFFICIAL[field])) if field in FROM_OFFICIAL else x


def official_layer_shapes(c: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor of one block in the official tree."""
    N, K, D, H, F = c.num_heads, c.num_kv_heads, c.d_model, c.head_dim, c.ffn_hidden
    return {"q": (N, D, H), "kv": (2, K, D, H), "o": (N, H, D), "q_norm": (H,), "k_norm": (H,),
            "pre_attn_norm": (D,), "post_attn_norm": (D,), "pre_ffw_norm": (D,),
            "post_ffw_norm": (D,), "gating": (2, F, D), "linear": (F, D)}


def layer_shapes(c: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor of one block, in our layout."""
    return {f: tuple(from_official(f, np.empty(s, np.int8)).shape)
            for f, s in official_layer_shapes(c).items()}


def map_weights(c: Gemma3Config, fn: Callable[[int | None, str, tuple[int, ...]], Any]) -> Weights:
    """Build a Weights tree: fn(layer, name, shape) for every tensor; layer None and name
    "embed" / "final_norm" for the two tensors outside the layers."""
    V, D = c.vocab_size, c.d_model
    shapes = layer_shapes(c)
    layers = tuple(LayerWeights(**{f: fn(i, f, s) for f, s in shapes.items()})
                   for i in range(c.num_layers))
    return Weights(embed=fn(None, "embed", (V, D)), final_norm=fn(None, "final_norm", (D,)),
                   layers=layers)


def weight_shapes(c: Gemma3Config, dtype) -> Weights:
    """Abstract weights (ShapeDtypeStruct leaves): no memory is touched."""
    return map_weights(c, lambda layer, name, shape: jax.ShapeDtypeStruct(shape, dtype))


# ---------------------------------------------------------------------------------------------
# The official parameter tree (nested dicts, or flat "transformer/..." keys).


def normalize_official_tree(tree: dict) -> dict:
    """Nested official tree {"embedder": ..., "final_norm": ..., "layer_i": ...} from either
    layout official checkpoints use: nested (optionally under "transformer"), or flat with keys
    like "transformer/layer_0/attn/q_einsum" holding {"w": ...}."""
    if "params" in tree and len(tree) == 1:
        tree = tree["params"]
    nested: dict = {}
    for key, value in tree.items():
        parts = [p for p in str(key).split("/") if p]
        if parts and parts[0] == "transformer":
            parts = parts[1:]
        node = nested
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        if not parts:  # the "transformer" wrapper itself
            _merge(nested, normalize_official_tree(value))
        elif isinstance(value, dict):
            _merge(node.setdefault(parts[-1], {}), normalize_official_tree(value))
        else:
            node[parts[-1]] = value
    return nested


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def lookup(tree: dict, path: tuple[str, ...]):
    """The leaf at `path` of a nested parameter tree; KeyError naming the whole path if absent."""
    node = tree
    for p in path:
        if not isinstance(node, dict) or p not in node:
            raise KeyError("/".join(path))
        node = node[p]
    return node


def official_tensor(tree: dict, layer: int | None, name: str) -> np.ndarray:
    """One of our tensors from an official tree, in our layout."""
    if name == "embed":
        path = ("embedder", "input_embedding")
    elif name == "final_norm":
        path = ("final_norm", "scale")
    else:
        path = (f"layer_{layer}", *OFFICIAL_LAYER_PATHS[name])
    try:
        return from_official(name, np.asarray(lookup(tree, path)))
    except KeyError:
        raise KeyError(f"official parameter tree has no {'/'.join(path)}") from None


def check_official_tree(tree: dict, c: Gemma3Config) -> None:
    """Raise a clear error when a tree does not hold exactly config `c`'s tensors."""
    expected = {("embedder", "input_embedding"): (c.vocab_size, c.d_model),
                ("final_norm", "scale"): (c.d_model,)}
    for i in range(c.num_layers):
        for field, shape in official_layer_shapes(c).items():
            expected[(f"layer_{i}", *OFFICIAL_LAYER_PATHS[field])] = shape
    for path, shape in expected.items():
        try:
            got = tuple(np.shape(lookup(tree, path)))
        except KeyError:
            raise ValueError(f"parameter {'/'.join(path)} is missing for {c.name}") from None
        if got != shape:
            raise ValueError(f"parameter {'/'.join(path)} has shape {got}, {c.name} needs {shape}")
    extra = [k for k in tree if k.startswith("layer_") and int(k[6:]) >= c.num_layers]
    if extra:
        raise ValueError(f"tree has more layers than {c.name}: {sorted(extra)[:3]}")


def infer_official_config(tree: dict) -> dict[str, int]:
    """Sizes readable from an official tree's shapes (not windows, RoPE or query scale)."""
    V, D = np.shape(lookup(tree, ("embedder", "input_embedding")))
    layers = sum(1 for k in tree if k.startswith("layer_"))
    N, _, H = np.shape(lookup(tree, ("layer_0", "attn", "q_einsum", "w")))
    K = np.shape(lookup(tree, ("layer_0", "attn", "kv_einsum", "w")))[1]
    F = np.shape(lookup(tree, ("layer_0", "mlp", "linear")))[0]
    return dict(vocab_size=int(V), d_model=int(D), num_layers=layers, num_heads=int(N),
                num_kv_heads=int(K), head_dim=int(H), ffn_hidden=int(F))


def iter_official(weights: Weights, c: Gemma3Config) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(official path, host array in the official layout) for every tensor of `weights`."""
    yield ("embedder", "input_embedding"), np.asarray(weights.embed)
    yield ("final_norm", "scale"), np.asarray(weights.final_norm)
    for i, layer in enumerate(weights.layers):
        for field, path in OFFICIAL_LAYER_PATHS.items():
            yield (f"layer_{i}", *path), to_official(field, np.asarray(getattr(layer, field)))


def to_official_tree(weights: Weights, c: Gemma3Config) -> dict:
    """Nested official tree of numpy arrays (gathers every tensor to the host)."""
    tree: dict = {}
    for path, value in iter_official(weights, c):
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = value
    return tree
