"""The model's step API: `init_pages` and `ragged_step` (one program a step over the paged
cache, which the server's runner drives: serving/paged_runner.py), the image tower, and the
ahead-of-time half (`ragged_key`, `lower_ragged`, `compile_ragged`) that needs no weights.

`Gemma3StepAPI` is a model's programs (`ModelPrograms`) with its weights and tokenizer. Every call
has static shapes; a call whose shapes were compiled ahead of time runs the kept executable.
`ragged_step` donates the pages: never reuse a pages object after passing it in.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.gemma3.paged_kv import PagedKV
from models.gemma3.programs import ModelPrograms, ProgramKey
from models.shapes import StepShape
from models.gemma3.ragged import ImageRows, RaggedBatch, pack
from models.gemma3.weights import Weights


class Gemma3StepAPI:
    """A model's programs, weights and tokenizer behind the engine API (module docstring).

    The weights may be the programs' `abstract_weights` (ShapeDtypeStructs): such an engine
    lowers, compiles and warms up, but cannot run, e.g. while the real weights load.
    """

    def __init__(self, programs: ModelPrograms, weights: Weights, tokenizer=None):
        self.programs = programs
        self.weights = weights
        self.config = programs.config
        self.mesh = programs.mesh
        self.tp = programs.tp
        self.tp_mesh = programs.tp_mesh  # "2x2" on a multi-axis TP mesh, None on a 1-D one
        self.allreduce = programs.allreduce
        self.reduction = programs.reduction
        self.dtype = programs.dtype
        self.kv_cache_dtype = programs.kv_cache_dtype  # what the paged cache holds
        self._tokenizer = tokenizer
        self.vision = None  # a VisionModel with placed weights (`attach_vision`), or None
        self._image_features = None

    # -- images --------------------------------------------------------------------------------
    def attach_vision(self, vision) -> None:
        """Serve images with `vision` (a `vision_checkpoint.VisionModel`, host arrays): its
        tower and projector are placed, in the model's dtype, on one device of the mesh (this
        process's first), and `image_features` runs them there; the features then go to every
        device with the step that reads them (256 x D values an image). On a CPU the virtual
        devices share the cores, so a tower on every device ran slower (docs/vision.md); on an
        accelerator a tower split over the mesh (`vision_sharding.encode_sharded`) is the
        alternative to measure."""
        from models.gemma3.projector import image_features

        cast = lambda x: np.asarray(x, self.dtype)  # noqa: E731
        device = next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())
        tower, projector = (jax.device_put(jax.tree.map(cast, w), device)
                            for w in (vision.vision, vision.projector))
        placed = dataclasses.replace(vision, vision=tower, projector=projector)
        c = vision.config
        self._image_features = jax.jit(lambda v, p, x: image_features(v, p, x, c))
        self.vision = placed

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    def image_features(self, pixels) -> jax.Array:
        """pixels [n, H, W, 3] float32 (preprocessed, `serving.media`) -> features
        [n, tokens_per_image, D] in the model's dtype, where the tower is placed
        (`attach_vision`)."""
        if self.vision is None:
            raise ValueError("this model has no vision tower: it takes no images")
        pixels = jax.device_put(np.asarray(pixels, self.dtype),
                                jax.tree.leaves(self.vision.vision)[0].sharding)
        v = self.vision
        return self._image_features(v.vision, v.projector, pixels).astype(self.dtype)

    @property
    def tokenizer(self):
        """The source's tokenizer; without one, the real Gemma 3 tokenizer for a vocabulary of
        its size or more, else a byte-level one (`default_tokenizer`; loaded on first use: most
        engine work needs none)."""
        if self._tokenizer is None:
            self._tokenizer = default_tokenizer(self.config.vocab_size)
        return self._tokenizer

    # -- the paged cache -----------------------------------------------------------------------
    @property
    def paged_attention(self) -> str:
        """The paged attention's form on this model's devices (`ragged.attention_impl`)."""
        return self.programs.attention

    def pages_shapes(self, num_global_pages: int, num_local_pages: int,
                     page_size: int) -> PagedKV:
        """The paged cache's shapes (ShapeDtypeStructs, global shapes), e.g. for its bytes."""
        return self.programs.pages_shapes(num_global_pages, num_local_pages, page_size)

    def init_pages(self, num_global_pages: int, num_local_pages: int, page_size: int) -> PagedKV:
        """Zeroed page pools (sharded over cache heads): every global layer's pool holds
        num_global_pages pages of page_size positions, every local layer's num_local_pages.
        Page 0 of each is scratch (never a sequence's)."""
        return self.programs.zeros_pages(num_global_pages, num_local_pages, page_size)

    def ragged_step(self, pages: PagedKV, batch: RaggedBatch, logits: bool = True,
                    images: ImageRows | None = None, every_token: bool = False):
        """One ragged step (`models.gemma3.ragged`): batch's fields numpy or device int32
        arrays. Returns (float32 logits [S, V] at each row's `last` token, vocab-sharded as
        decode's, or None with logits=False; the pages). Donates the pages. `images`: the
        feature rows [F, D] the step's soft tokens take (index [T], -1 for text); each F is
        its own program (pad F to a few sizes). every_token=True returns (row logits, logits
        [T, V] at every token, pages) (`ragged.ragged_step`)."""
        check_token_range(batch.tokens, self.config.vocab_size)
        t, s, q, pg, pl = _batch_shape(batch)
        packed = pack(batch)
        if isinstance(batch.tokens, jax.Array):
            tokens = self._ids(batch.tokens, 1, "tokens")
            packed = jax.device_put(packed, self.programs.replicated)
        else:  # one transfer call for both
            tokens, packed = jax.device_put([np.asarray(batch.tokens, np.int32), packed],
                                            self.programs.replicated)
        args = (self.weights, pages, tokens, packed)
        features = 0
        if images is not None:
            feats = images.features
            if feats.ndim != 2 or feats.shape[1] != self.config.d_model:
                raise ValueError(f"image features must be [F, {self.config.d_model}], got "
                                 f"{tuple(feats.shape)}")
            feats = jax.device_put(jnp.asarray(feats, self.dtype), self.programs.replicated)
            index = self._ids(images.index, 1, "index")
            if index.shape != (t,):
                raise ValueError(f"the image index must be [T]={t}, got {index.shape}")
            features = feats.shape[0]
            args += (ImageRows(features=feats, index=index),)
        shape = StepShape(t, s, q, pg, pl, logits=logits, every_token=every_token,
                          features=features)
        out = self.programs.runnable(ProgramKey.of(shape, pages))(*args)
        if every_token:
            return out
        return out if logits else (None, out)

    def span_layer(self, pages: PagedKV, layer: int, x, positions=None, write=None,
                   rows: RaggedBatch | None = None, start: int = 0):
        """One stage of an image span's soft tokens through text layer `layer`
        (`ragged.span_kv` / `span_rows`: serving/image_spans.py runs them between steps).
        Without `rows`: stores the layer's keys/values of the span's rows x [N, D] at
        `positions` [N] into slots `write` [N]; returns the pages (the layer's pool donated).
        With `rows` (a RaggedBatch of R of those rows as one sequence row): moves rows
        start..start+R-1 of x through the layer; returns x (donated)."""
        kind = "global" if self.config.is_global(layer) else "local"
        w = self.weights.layers[layer]
        x = jax.device_put(jnp.asarray(x, self.dtype), self.programs.replicated)
        if rows is None:
            run = self.programs.span_program("kv", kind)
            new = run(w, pages.layers[layer], x, self._ids(positions, 1, "positions"),
                      self._ids(write, 1, "write"))
            layers = pages.layers[:layer] + (new,) + pages.layers[layer + 1:]
            return PagedKV(layers=layers, kinds=pages.kinds)
        b = RaggedBatch(**{f.name: self._ids(getattr(rows, f.name), _RAGGED_NDIM[f.name], f.name)
                           for f in dataclasses.fields(RaggedBatch)})
        return self.programs.span_program("rows", kind)(w, pages.layers[layer], x, b,
                                                        np.int32(start))

    def ragged_key(self, shape: StepShape, pages: PagedKV) -> ProgramKey:
        """The program of a step of `shape` over `pages` (arrays or their shapes)."""
        return ProgramKey.of(shape, pages)

    def lower_ragged(self, key: ProgramKey) -> jax.stages.Lowered:
        """A ragged step's program (from `ragged_key`), lowered from abstract shapes."""
        return self.programs.lower(key)

    def compile_ragged(self, keys, workers: int = 2,
                       progress: Callable[[str], None] | None = None) -> None:
        """Compile (without running) and keep the ragged steps of `keys` (`ragged_key`s).

        Every `StepShape` is its own program, so the caller pads each step to a few
        (the paged engine's choice: `serving.paged_steps.buckets_for`, which also says how many
        programs that gives). Compile the ones every server meets first here; the others
        compile on first use.
        """
        keys = list(keys)
        self.programs.compile_all(
            [(k.describe(), [k]) for k in keys], workers, progress)

    def _ids(self, x, ndim: int, name: str) -> jax.Array:
        """Integer ids as int32, replicated on the mesh (as the kept executables expect)."""
        replicated = self.programs.replicated
        if isinstance(x, jax.Array):
            if x.ndim != ndim or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(f"{name} must be an integer array with {ndim} dims, got "
                                 f"{x.dtype} {x.shape}")
            # (An eager op on a mesh-sharded array costs milliseconds: convert only if needed.)
            x = x if x.dtype == jnp.int32 else x.astype(jnp.int32)
            if not x.sharding.is_equivalent_to(replicated, x.ndim):
                x = jax.device_put(x, replicated)
            return x
        x = np.asarray(x)
        if x.ndim != ndim or not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"{name} must be an integer array with {ndim} dims, got "
                             f"{x.dtype} {x.shape}")
        return jax.device_put(x.astype(np.int32), replicated)

_RAGGED_NDIM = {f.name: 2 if f.name in ("queries", "global_table", "local_table") else 1
                for f in dataclasses.fields(RaggedBatch)}


def _batch_shape(batch: RaggedBatch) -> tuple[int, int, int, int, int]:
    """(T, S, Q, Pg, Pl) of a batch of host or device arrays, checked for their ranks."""
    for f in dataclasses.fields(RaggedBatch):
        x = getattr(batch, f.name)
        dtype = getattr(x, "dtype", None) or np.asarray(x).dtype
        if np.ndim(x) != _RAGGED_NDIM[f.name] or not np.issubdtype(dtype, np.integer):
            raise ValueError(f"{f.name} must be an integer array with {_RAGGED_NDIM[f.name]} "
                             f"dims, got {dtype} {np.shape(x)}")
    t, (s, q) = np.shape(batch.tokens)[0], np.shape(batch.queries)
    if any(np.shape(getattr(batch, n)) != (t,) for n in _PER_TOKEN) or any(
            np.shape(getattr(batch, n))[0] != s for n in _PER_ROW):
        raise ValueError("a RaggedBatch's per-token arrays must all be [T] and its per-row "
                         f"arrays [S, ...]: got {_describe(batch)}")
    return t, s, q, np.shape(batch.global_table)[1], np.shape(batch.local_table)[1]


_PER_TOKEN = ("positions", "visible", "seq", "col", "write_global", "write_local")
_PER_ROW = ("global_table", "local_table", "local_first", "last")


def _describe(batch: RaggedBatch) -> str:
    return ", ".join(f"{f.name} {tuple(getattr(batch, f.name).shape)}"
                     for f in dataclasses.fields(RaggedBatch))


def check_token_range(tokens, vocab_size: int) -> None:
    """ValueError on host token ids outside the vocabulary (device arrays are not read back)."""
    if not isinstance(tokens, jax.Array):
        t = np.asarray(tokens)
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise ValueError(f"token ids must be in [0, {vocab_size})")


@functools.cache
def default_tokenizer(vocab_size: int):
    """The real Gemma 3 tokenizer for its vocabulary size or more, else a byte-level one (one
    per size and process: models of one vocabulary share it).

    More: 4B-27B embed 262,208 rows for the same 262,144 pieces (the rest pad the table, image
    tokens among them), and a checkpoint without tokenizer files (an official tree, a download
    of only config.json and safetensors) is one of them. Every Gemma 3 size shares the one
    vocabulary; a byte tokenizer would turn each request into garbage without a word, and
    refusing would refuse the official checkpoints, which never carry a tokenizer."""
    from models.gemma3.byte_tokenizer import ByteTokenizer

    if vocab_size >= 262_144:
        from models.gemma3.gguf import default_gguf_path
        from models.gemma3.tokenizer import Tokenizer

        return Tokenizer.from_gguf(default_gguf_path())
    return ByteTokenizer(vocab_size)
