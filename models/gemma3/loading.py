"""Weights into the sharded layout: from GGUF, official Flax/orbax trees, random init, and our own
converted orbax checkpoints (fast restarts).

Every tensor is placed with `jax.make_array_from_callback` (or generated under `out_shardings`),
so each device only ever receives its own shard: no device holds the whole model when tp > 1.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from models.gemma3.config import CONFIGS, Gemma3Config
from models.gemma3.sharding import PARAM_AXES, named, weight_specs
from models.gemma3.weights import (
    LayerWeights, Weights, check_official_tree, infer_official_config, map_weights,
    normalize_official_tree, official_tensor, weight_shapes)

CONFIG_FILE = "gemma3_config.json"  # marks a checkpoint written by `save_checkpoint`
PARAMS_DIR = "params"


# ---------------------------------------------------------------------------------------------
# Configs


def _known_name(sizes: dict) -> str | None:
    for key, c in CONFIGS.items():
        if all(getattr(c, k) == v for k, v in sizes.items()):
            return key
    return None


def config_from_gguf(path: str | os.PathLike) -> Gemma3Config:
    from models.gemma3.gguf import read_gguf_config

    m = read_gguf_config(path)
    if m["sliding_window_pattern"] < 1:
        raise ValueError(f"{path}: sliding window pattern {m['sliding_window_pattern']} < 1")
    sizes = {k: m[k] for k in ("vocab_size", "num_layers", "d_model", "ffn_hidden", "num_heads",
                               "num_kv_heads", "head_dim")}
    known = _known_name(sizes)
    return Gemma3Config(
        name=CONFIGS[known].name if known else m["name"], **sizes,
        sliding_window=m["sliding_window"], max_seq_len=m["max_seq_len"],
        query_scale=m["query_pre_attn_scalar"] ** -0.5, rope_local_base=m["local_rope_base"],
        rope_global_base=m["global_rope_base"], rope_global_scale=m["global_rope_scale"],
        norm_eps=m["rms_norm_eps"], global_every=m["sliding_window_pattern"])


def config_for_official_tree(tree: dict, config: Gemma3Config | None) -> Gemma3Config:
    """The given config (checked against the tree) or the official size matching its shapes."""
    if config is None:
        sizes = infer_official_config(tree)
        known = _known_name(sizes)
        if known is None:
            raise ValueError(f"parameter shapes {sizes} match no known Gemma 3 size; pass "
                             "config= (window, RoPE and query scale are not in the weights)")
        config = CONFIGS[known]
    check_official_tree(tree, config)
    return config


# ---------------------------------------------------------------------------------------------
# Placement


def _sharding(shardings: Weights, layer: int | None, name: str):
    return getattr(shardings, name) if layer is None else getattr(shardings.layers[layer], name)


def place_official(tree: dict, c: Gemma3Config, dtype, mesh: Mesh, tp: int) -> Weights:
    """Sharded Weights from an official tree of host arrays, one device shard at a time."""
    shardings = named(mesh, weight_specs(c, tp))
    np_dtype = np.dtype(dtype)

    def make(layer, name, shape):
        def shard(index):
            return np.asarray(official_tensor(tree, layer, name)[index], np_dtype)

        return jax.make_array_from_callback(shape, _sharding(shardings, layer, name), shard)

    return map_weights(c, make)


def _path_names(path) -> tuple[str, ...]:
    """A pytree key path as names: ("layers", "0", "q", "codes")."""
    return tuple(str(getattr(k, "name", getattr(k, "idx", k))) for k in path)


def tree_items_of(weights: Weights) -> list[tuple[tuple[str, ...], np.ndarray]]:
    """(path, whole host array) for every leaf of placed weights (quantized ones included), for
    `place_tree` to put back; gathers each array to the host (one process)."""
    return [(_path_names(path), np.asarray(leaf))
            for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]]


def place_tree(tree: dict, abstract: Weights) -> Weights:
    """Weights shaped as `abstract` (ShapeDtypeStructs with shardings) from a nested dict of
    host arrays keyed as `tree_items_of` names them, one device shard at a time; ValueError
    when a leaf is missing or of another shape or dtype."""
    def make(path, s):
        node = tree
        for name in _path_names(path):
            if not isinstance(node, dict) or name not in node:
                raise ValueError(f"no {'/'.join(_path_names(path))} among the arrays")
            node = node[name]
        if tuple(node.shape) != tuple(s.shape) or np.dtype(node.dtype) != np.dtype(s.dtype):
            raise ValueError(f"{'/'.join(_path_names(path))} is {node.dtype} {node.shape}, "
                             f"expected {s.dtype} {s.shape}")
        return jax.make_array_from_callback(s.shape, s.sharding,
                                            lambda index: np.asarray(node[index]))

    return jax.tree_util.tree_map_with_path(make, abstract)


def random_weights(c: Gemma3Config, dtype, mesh: Mesh, tp: int, seed: int = 0) -> Weights:
    """Random weights (unit-variance activations), drawn on the host one shard at a time.

    Values depend only on (seed, tensor, layer), never on tp: each tensor is cut into fixed blocks
    along the axis it may be sharded on, each block drawn from its own seeded generator, and a
    device's shard is the concatenation of its blocks. So tp=1 and tp=4 load identical models,
    no device (and no host buffer) ever holds more than one shard, and nothing is compiled.
    Norm scales get small random values so that the (1 + scale) path is exercised.
    """
    shardings = named(mesh, weight_specs(c, tp))
    np_dtype = np.dtype(dtype)
    fan_in = {"embed": c.d_model, "q": c.d_model, "kv": c.d_model,
              "o": c.num_heads * c.head_dim, "gating": c.d_model, "linear": c.ffn_hidden}
    names = ("embed", "final_norm", *PARAM_AXES)

    def make(layer, name, shape):
        tensor_id = names.index(name)
        axes = PARAM_AXES[name]
        axis = next((i for i, a in enumerate(axes) if a in ("vocab", "heads", "kv_heads", "ffn")),
                    0)
        size = shape[axis]
        block = size // _largest_pow2_divisor(size, 64)
        std = fan_in[name] ** -0.5 if name in fan_in else 0.1

        def shard(index):
            start, stop, _ = index[axis].indices(size)
            pieces = []
            for b in range(start // block, -(-stop // block)):
                rng = np.random.default_rng([seed, tensor_id, 0 if layer is None else layer + 1, b])
                block_shape = list(shape)
                block_shape[axis] = block
                x = rng.standard_normal(block_shape, dtype=np.float32)
                lo, hi = max(start - b * block, 0), min(stop - b * block, block)
                pieces.append(np.take(x, np.arange(lo, hi), axis=axis))
            keep = tuple(slice(None) if i == axis else s for i, s in enumerate(index))
            x = np.concatenate(pieces, axis=axis)[keep] * np.float32(std)
            return x.astype(np_dtype)

        return jax.make_array_from_callback(shape, _sharding(shardings, layer, name), shard)

    return map_weights(c, make)


def _largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


# ---------------------------------------------------------------------------------------------
# Orbax


def _to_tree(weights: Weights) -> dict:
    """Plain nested dict (orbax-friendly)."""
    layers = {f"layer_{i}": {f.name: getattr(layer, f.name) for f in dataclasses.fields(LayerWeights)}
              for i, layer in enumerate(weights.layers)}
    return {"embed": weights.embed, "final_norm": weights.final_norm, "layers": layers}


def _from_tree(tree: dict) -> Weights:
    layers = tuple(LayerWeights(**tree["layers"][f"layer_{i}"]) for i in range(len(tree["layers"])))
    return Weights(embed=tree["embed"], final_norm=tree["final_norm"], layers=layers)


def save_checkpoint(path: str | os.PathLike, weights: Weights, c: Gemma3Config) -> None:
    """Write converted, sharded weights (each device writes its shards) and the config. The
    tokenizer goes beside them as in a Hugging Face directory (`Gemma3Model.save`,
    `hf_tokenizer.save_tokenizer`), and is read back the same way."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    # Uncompressed: bf16 weights shrink only to ~3/4 under orbax's default zstd, and decoding
    # it is most of a restore (docs/results.md, "Figures moved from code comments").
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ckptr:
        ckptr.save(path / PARAMS_DIR, args=ocp.args.PyTreeSave(_to_tree(weights)), force=True)
    (path / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(c), indent=1))


def is_converted_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def read_checkpoint_config(path: str | os.PathLike) -> Gemma3Config:
    return Gemma3Config(**json.loads((Path(path) / CONFIG_FILE).read_text()))


def restore_checkpoint(path: str | os.PathLike, c: Gemma3Config, dtype, mesh: Mesh,
                       tp: int) -> Weights:
    """Restore straight into the sharded layout (and dtype) of this mesh."""
    import orbax.checkpoint as ocp

    shardings = named(mesh, weight_specs(c, tp))
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh),
                          weight_shapes(c, dtype), shardings)
    with ocp.StandardCheckpointer() as ckptr:
        return _from_tree(ckptr.restore(Path(path).absolute() / PARAMS_DIR, _to_tree(target)))


def save_official_checkpoint(path: str | os.PathLike, tree: dict) -> None:
    """An official parameter tree (nested dicts of host arrays) as an orbax checkpoint that
    `read_official_checkpoint` and the official `gemma` library read."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), tree, force=True)


def read_official_checkpoint(path: str | os.PathLike) -> dict:
    """An official Flax/orbax checkpoint (nested or flat "transformer/..." tree) as host arrays."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
        tree = getattr(meta, "item_metadata", meta)
        # Host numpy arrays: a device receives only its shards later, in place_official.
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        raw = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    return normalize_official_tree(raw)


def as_dtype(dtype) -> jnp.dtype:
    names = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32,
             "f32": jnp.float32}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(names)}, got {dtype!r}")
        return jnp.dtype(names[dtype])
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dt}")
    return dt
