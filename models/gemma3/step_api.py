"""The model's step API: over a dense cache of slots, `init_cache`, `prefill`, `decode_step` and
chunked prefill (what `generate`, the parity tests and eval run), and the ahead-of-time half
(`lower_*`, `compile_*`, `warm_up`) that needs no weights; over a paged cache, `init_pages` and
`ragged_step` (one program a step), which the server's runner drives (serving/paged_runner.py).

`Gemma3StepAPI` is a model's programs (`ModelPrograms`) with its weights and tokenizer. Every call
has static shapes: a new prompt length only picks a bucket, and a call whose shapes were
compiled ahead of time runs the kept executable. Both `prefill` and `decode_step` donate the
cache: never reuse a cache object after passing it in.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.gemma3.kv_cache import KVCache
from models.gemma3.paged_kv import PagedKV
from models.gemma3.programs import ModelPrograms, ProgramKey
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
        self.cache_dtype = programs.cache_dtype
        self.prefill_buckets = programs.prefill_buckets
        self._tokenizer = tokenizer
        self.vision = None  # a VisionModel with placed weights (`attach_vision`), or None
        self._image_features = None

    # -- images --------------------------------------------------------------------------------
    def attach_vision(self, vision, replicated: bool = False) -> None:
        """Serve images with `vision` (a `vision_checkpoint.VisionModel`, host arrays): its
        tower and projector are placed, in the model's dtype, on one device of the mesh (this
        process's first), and `image_features` runs them there; the features then go to every
        device with the step that reads them (256 x D values an image). Replicated on the mesh
        (replicated=True, as before) every device ran the whole tower: free on an accelerator
        with its own compute per chip, but on a CPU the tp virtual devices share the cores, so
        at tp=2 one image took twice as long (docs/vision.md). The split placement
        (`vision_sharding.encode_sharded`) gained nothing here."""
        from models.gemma3.projector import image_features
        from models.gemma3.vision_sharding import place_vision

        cast = lambda x: np.asarray(x, self.dtype)  # noqa: E731
        if replicated:
            tower = place_vision(jax.tree.map(cast, vision.vision), vision.config, self.mesh,
                                 split=False)
            projector = jax.device_put(jax.tree.map(cast, vision.projector),
                                       self.programs.replicated)
        else:
            device = next(d for d in self.mesh.devices.flat
                          if d.process_index == jax.process_index())
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

    # -- shapes and caches ---------------------------------------------------------------------
    def bucket_for(self, length: int) -> int:
        return self.programs.bucket_for(length)

    def cache_shapes(self, num_slots: int, max_seq_len: int) -> KVCache:
        return self.programs.cache_shapes(num_slots, max_seq_len)

    def init_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        """Zeroed KV cache for num_slots sequences of up to max_seq_len tokens (sharded)."""
        if max_seq_len > self.config.max_seq_len:
            raise ValueError(f"cache max_seq_len {max_seq_len} exceeds the model's "
                             f"{self.config.max_seq_len}")
        return self.programs.zeros_cache(num_slots, max_seq_len)

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
        shape = _batch_shape(batch)
        packed = pack(batch)
        t, s, q, pg, pl = shape
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
        key = ProgramKey.ragged(t, s, q, pg, pl, pages, logits, features, every_token)
        out = self.programs.runnable(key)(*args)
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

    def ragged_key(self, tokens: int, seqs: int, queries: int, global_pages: int,
                   local_pages: int, pages: PagedKV, logits: bool = True,
                   features: int = 0) -> ProgramKey:
        return ProgramKey.ragged(tokens, seqs, queries, global_pages, local_pages, pages, logits,
                                 features)

    def lower_ragged(self, key: ProgramKey) -> jax.stages.Lowered:
        """A ragged step's program (from `ragged_key`), lowered from abstract shapes."""
        return self.programs.lower(key)

    def compile_ragged(self, keys, workers: int = 2,
                       progress: Callable[[str], None] | None = None) -> None:
        """Compile (without running) and keep the ragged steps of `keys` (`ragged_key`s).

        Every (T, S, Q, Pg, Pl) is its own program, so the caller pads each to a few values
        (the paged engine's choice: `serving.paged_steps.Buckets`, which also says how many
        programs that gives). Compile the ones every server meets first here; the others
        compile on first use.
        """
        keys = list(keys)
        self.programs.compile_all(
            [(k.describe(), [k]) for k in keys], workers, progress)

    # -- running -------------------------------------------------------------------------------
    def prefill(self, cache: KVCache, tokens, lengths, slots, return_all_logits: bool = False):
        """Run prompts tokens [B, Tb] (right-padded) at positions 0..len-1 into cache rows
        slots [B]. Returns (float32 logits [B, V] at each last real token, or [B, Tb, V] with
        return_all_logits; the new cache). Tb may exceed the cache length only by padding."""
        check_token_range(tokens, self.config.vocab_size)
        tokens = self._ids(tokens, 2, "tokens")
        lengths, slots = self._ids(lengths, 1, "lengths"), self._ids(slots, 1, "slots")
        if not tokens.shape[0] == lengths.shape[0] == slots.shape[0]:
            raise ValueError(f"tokens {tokens.shape}, lengths {lengths.shape} and slots "
                             f"{slots.shape} disagree on the batch size")
        key = ProgramKey.prefill(*tokens.shape, cache, return_all_logits)
        return self.programs.runnable(key)(self.weights, cache, tokens, lengths, slots)

    def decode_step(self, cache: KVCache, tokens, positions):
        """One token for each of the first R cache slots (tokens, positions [R], 1 <= R <= cache
        slots) -> (logits [R, V], cache). The other slots are neither read nor written; each R
        is its own program (a server compiles a few, e.g. 1, 2, 4, 8)."""
        check_token_range(tokens, self.config.vocab_size)
        tokens, positions = self._ids(tokens, 1, "tokens"), self._ids(positions, 1, "positions")
        rows = tokens.shape[0]
        if not (rows == positions.shape[0] and 1 <= rows <= cache.num_slots):
            raise ValueError(f"decode_step needs one token and position for each of 1.."
                             f"{cache.num_slots} leading cache slots, got {rows} and "
                             f"{positions.shape[0]}")
        decode = self.programs.runnable(ProgramKey.decode(rows, cache))
        write = self.programs.runnable(ProgramKey.write_token(rows, cache))
        logits, new_kv = decode(self.weights, cache, tokens, positions)
        return logits, write(cache, new_kv, positions)

    def prefill_chunk(self, cache: KVCache, tokens, start: int, length: int, slot: int,
                      logits: bool = True):
        """One chunk of a prompt: tokens [1, T] (the first `length` real) at positions
        start..start+T-1 of the sequence in cache row `slot`, whose earlier positions are in the
        cache. Returns (float32 logits [1, V] at the chunk's last real token, or None with
        logits=False, and the chunk's keys and values for `write_chunk`); the cache is only
        read (not donated)."""
        check_token_range(tokens, self.config.vocab_size)
        tokens = self._ids(tokens, 2, "tokens")
        t = tokens.shape[1]
        if tokens.shape[0] != 1 or not 1 <= int(length) <= t:
            raise ValueError(f"a chunk is one row of 1..{t} real tokens, got {tokens.shape} "
                             f"with length {length}")
        if t > cache.max_seq_len or not 0 <= int(slot) < cache.num_slots:
            raise ValueError(f"chunk of {t} tokens into slot {slot} of a cache of "
                             f"{cache.num_slots} x {cache.max_seq_len}")
        args = [self._ids(np.array([v], np.int32), 1, n)
                for v, n in ((start, "start"), (length, "length"), (slot, "slot"))]
        key = ProgramKey.chunk(t, cache, logits)
        out = self.programs.runnable(key)(self.weights, cache, tokens, *args)
        return out if logits else (None, out)

    def write_chunk(self, cache: KVCache, kv, start: int, length: int, slot: int) -> KVCache:
        """Store a chunk's keys/values (from `prefill_chunk`, or a prefix cache's copy of them)
        at positions start..start+length-1 of cache row `slot`. Donates the cache."""
        t = kv[0].k.shape[1]
        args = [self._ids(np.array([v], np.int32), 1, n)
                for v, n in ((start, "start"), (length, "length"), (slot, "slot"))]
        return self.programs.runnable(ProgramKey.write_chunk(t, cache))(cache, kv, *args)

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

    # -- ahead of time (warm-up without running, HLO inspection) -------------------------------
    def lower_prefill(self, batch: int, bucket: int, num_slots: int, max_seq_len: int,
                      return_all_logits: bool = False) -> jax.stages.Lowered:
        """The prefill program for tokens [batch, bucket] into a (num_slots, max_seq_len) cache,
        as `prefill` runs it: (weights, cache, tokens, lengths, slots) -> (logits, cache).
        `.compile()` it to warm the compilation caches or to read its HLO."""
        return self.programs.lower(self._prefill_key(batch, bucket, num_slots, max_seq_len,
                                                     return_all_logits))

    def lower_decode(self, num_slots: int, max_seq_len: int, rows: int | None = None
                     ) -> jax.stages.Lowered:
        """The decode-step forward program for a (num_slots, max_seq_len) cache and its first
        `rows` slots (default all): (weights, cache, tokens, positions) -> (logits, new
        keys/values); it holds all of decode's communication. `decode_step` runs it, then the
        write-only cache update."""
        return self.programs.lower(self._decode_keys(num_slots, max_seq_len, rows)[0])

    def warm_up(self, num_slots: int, max_seq_len: int, buckets=None, batch: int = 1,
                decode_rows=None, prefill_shapes=None, workers: int = 2,
                progress: Callable[[str], None] | None = None, chunk_sizes=()) -> None:
        """Compile (without running) every program a server needs: prefill of `batch` prompts
        per bucket (default: the buckets up to max_seq_len; or the (batch, bucket) pairs in
        `prefill_shapes`), the decode step over each count of leading slots in `decode_rows`
        (default: all slots) and its cache write. The executables are kept for calls with
        those shapes; with a persistent compilation cache (and a program cache), a later start
        loads them instead of compiling. `workers` programs compile at a time (see
        `ModelPrograms.compile_all`); `progress` receives one line per program with its
        seconds. `chunk_sizes`: prefill chunk lengths (`prefill_chunk` and `write_chunk`; the
        largest also without logits, as every chunk before a prompt's last runs)."""
        if prefill_shapes is None:
            buckets = buckets or [b for b in self.prefill_buckets if b <= max_seq_len]
            prefill_shapes = [(batch, bucket) for bucket in buckets]
        jobs = [(f"prefill bucket {bucket} x{n}",
                 [self._prefill_key(n, bucket, num_slots, max_seq_len)])
                for n, bucket in prefill_shapes]
        jobs += [(f"decode step x{rows}", self._decode_keys(num_slots, max_seq_len, rows))
                 for rows in decode_rows or (num_slots,)]
        cache = self.programs.cache_shapes(num_slots, max_seq_len)
        jobs += [(f"prefill chunk of {t}", [ProgramKey.chunk(t, cache),
                                            ProgramKey.write_chunk(t, cache)]
                  + ([ProgramKey.chunk(t, cache, logits=False)] if t == max(chunk_sizes) else []))
                 for t in chunk_sizes]
        self.programs.compile_all(jobs, workers, progress)

    def _prefill_key(self, batch, bucket, num_slots, max_seq_len, all_logits=False):
        cache = self.programs.cache_shapes(num_slots, max_seq_len)
        return ProgramKey.prefill(batch, bucket, cache, all_logits)

    def _decode_keys(self, num_slots, max_seq_len, rows=None) -> list[ProgramKey]:
        """The decode step's two programs: the forward pass, then the cache write."""
        cache = self.programs.cache_shapes(num_slots, max_seq_len)
        rows = rows or num_slots
        return [ProgramKey.decode(rows, cache), ProgramKey.write_token(rows, cache)]


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
