"""What `load_model`'s `source` names, and how to place its weights: the real 270M, a GGUF
file, a Hugging Face directory, our own or an official checkpoint, random weights, or an
official tree in memory.

`resolve_source` only reads what a source says about shapes (config, vocabulary) up front;
placing the weights is the returned function, so that programs can compile meanwhile.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np
from jax.sharding import Mesh

from models.gemma3 import hf_checkpoint, loading
from models.gemma3.config import Gemma3Config, get_config
from models.gemma3.weights import Weights

PlaceWeights = Callable[[Gemma3Config, Mesh], Weights]


def resolve_source(source, config: Gemma3Config | None, dtype, tp: int, seed: int,
                   weights_cache_dir=None) -> tuple[Gemma3Config, PlaceWeights, object]:
    """(config, place(config, mesh) -> sharded Weights, tokenizer or None) for a source."""
    if isinstance(source, dict):
        tree = loading.normalize_official_tree(source)
        return (loading.config_for_official_tree(tree, config),
                lambda c, mesh: loading.place_official(tree, c, dtype, mesh, tp), None)
    source = os.fspath(source)
    if source.startswith("random:"):
        return (config or get_config(source.removeprefix("random:")),
                lambda c, mesh: loading.random_weights(c, dtype, mesh, tp, seed), None)
    if source == "gemma3-270m" or source.endswith(".gguf") or os.path.isfile(source):
        from models.gemma3.gguf import default_gguf_path
        from models.gemma3.tokenizer import Tokenizer

        path = default_gguf_path() if source == "gemma3-270m" else source
        return (loading.config_from_gguf(path),
                lambda c, mesh: loading.place_official(_gguf_tree(path, dtype, weights_cache_dir),
                                                       c, dtype, mesh, tp),
                Tokenizer.from_gguf(path))
    if os.path.isdir(source) and hf_checkpoint.is_hf_checkpoint(source):
        from models.gemma3.hf_tokenizer import read_tokenizer

        return (hf_checkpoint.read_config(source),
                lambda c, mesh: hf_checkpoint.place_hf(source, c, dtype, mesh, tp),
                read_tokenizer(source))
    if os.path.isdir(source) and loading.is_converted_checkpoint(source):
        from models.gemma3.tokenizer import Tokenizer

        vocab = loading.checkpoint_tokenizer_path(source)
        return (loading.read_checkpoint_config(source),
                lambda c, mesh: loading.restore_checkpoint(source, c, dtype, mesh, tp),
                Tokenizer.from_file(vocab) if vocab is not None else None)
    if os.path.isdir(source):
        tree = loading.read_official_checkpoint(source)
        return (loading.config_for_official_tree(tree, config),
                lambda c, mesh: loading.place_official(tree, c, dtype, mesh, tp), None)
    raise ValueError(f"unknown model source {source!r}: expected 'gemma3-270m', a .gguf file, a "
                     "checkpoint directory (Hugging Face or orbax), 'random:<size>' or an official "
                     "parameter tree")


def _gguf_tree(path: str, dtype, cache_dir) -> dict:
    """The official tree of a GGUF file in `dtype`, from the weights cache when it has it."""
    from models.gemma3 import weights_cache
    from models.gemma3.gguf import load_gguf_params

    if cache_dir is not None:
        tree = weights_cache.load(cache_dir, path, dtype)
        if tree is not None:
            return tree
    tree = load_gguf_params(path, np.dtype(dtype))
    if cache_dir is not None:
        weights_cache.store(cache_dir, path, dtype, weights_cache.tree_items(tree))
    return tree
