"""The model's device programs and the executables compiled ahead of time, by `ProgramKey`.

`ModelPrograms` owns all of one model setup but its weights (config, mesh, AllReduce, dtypes). It
builds the ragged step's `shard_map` program once per step shape, lowers it from abstract shapes
alone (so compiling can overlap weight loading), and `runnable(key)` hands back the compiled
executable or the jitted program."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import functools
import logging
import threading
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from equarx import AllReduceConfig, folds_rotation, groups
from models.gemma3 import model as forward
from models.gemma3.config import Gemma3Config
from models.gemma3.paged_kv import PagedKV, paged_shapes, paged_specs, pool_dtype
from models.gemma3.program_cache import ProgramCache
from models.gemma3.quantization import (CONTRACTED, check_group_size, check_quantization,
                                        map_quantized, quantize, quantized_shapes,
                                        quantized_specs)
from models.gemma3.ragged import (ImageRows, RaggedBatch, attention_impl,
                                  check_kv_cache_dtype, ragged_step, span_kv, span_rows, unpack)
from models.shapes import StepShape
from models.gemma3.sharding import (AXIS, local_kv_heads, mesh_label, named, resolve_tree,
                                    tp_axes, weight_specs)
from models.gemma3.weights import Weights, weight_shapes

log = logging.getLogger(__name__)


class Program(enum.Enum):
    """The step's programs (`ragged.ragged_step` over the paged cache, its batch packed:
    `ragged.pack`); the value names the program in the program cache's files.

    RAGGED:             (weights, pages, tokens, packed batch) -> (logits [S, V], pages)
    RAGGED_KV:          the same without logits (prompt pieces that sample nothing)
    RAGGED_IMAGES:      (weights, pages, tokens, packed batch, ImageRows) -> (logits, pages): a
                        step whose tokens include image soft tokens (their features replace
                        their embeddings); text-only steps keep the programs above
    RAGGED_IMAGES_KV:   the same without logits
    RAGGED_ALL_LOGITS:  (weights, pages, tokens, packed batch) -> (logits [S, V], logits [T, V]
                        at every token, pages): prompt logprobs, and `Gemma3Model.score`
    """

    RAGGED = "ragged"
    RAGGED_KV = "ragged_kv"
    RAGGED_IMAGES = "ragged_images"
    RAGGED_IMAGES_KV = "ragged_images_kv"
    RAGGED_ALL_LOGITS = "ragged_all"


RAGGED_PROGRAMS = (Program.RAGGED, Program.RAGGED_KV, Program.RAGGED_IMAGES,
                   Program.RAGGED_IMAGES_KV, Program.RAGGED_ALL_LOGITS)


def step_program(s: StepShape) -> Program:
    """The program variant a step of shape `s` runs."""
    if s.every_token:
        if s.features or not s.logits:
            raise ValueError("every-token logits are for text steps that sample")
        return Program.RAGGED_ALL_LOGITS
    if s.features:
        return Program.RAGGED_IMAGES if s.logits else Program.RAGGED_IMAGES_KV
    return Program.RAGGED if s.logits else Program.RAGGED_KV


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    """One ragged step program at one set of shapes, what a kept executable was compiled for:
    the step's shape and the paged cache's pools, (global pages, local pages, page size) as
    `paged_shapes` takes them, and what they hold (`paged_kv.KV_CACHE_DTYPES`)."""

    shape: StepShape
    pools: tuple[int, int, int]
    kv_cache_dtype: str = "auto"

    @classmethod
    def of(cls, shape: StepShape, pages: PagedKV) -> ProgramKey:
        """The program of a step of `shape` over `pages` (arrays or ShapeDtypeStructs: only the
        pools' shapes and dtypes are read)."""
        return cls(shape, (pages.num_pages("global"), pages.num_pages("local"), pages.page_size),
                   pages.kv_cache_dtype)

    @property
    def program(self) -> Program:
        return step_program(self.shape)

    def describe(self) -> str:
        """For logs: "ragged step " and the shape's `describe`."""
        return "ragged step " + self.shape.describe()


class ModelPrograms:
    """The jitted programs of one model setup and the executables compiled for it (see the
    module docstring). Needs no weights, only their shapes.

    reduction: called as `reduction(x, axis_name)` at every tensor-parallel reduction instead of
      `equarx.all_reduce(x, axis_name, allreduce)` (the forward pass then never reads
      `allreduce`, which only labels the model). For comparisons such as eval's strawman.
    program_cache: keep the traced programs on disk (`models.gemma3.program_cache`); not used
      with a reduction.
    fold_rotation: where the AllReduce's codec rotates groups of each row (the default int8
      at tp > 1), run the programs on weights with that rotation folded into the attention
      output and MLP down projections (`fold_weights`), so the AllReduce skips its forward
      rotation (`rotation_folded` says whether it applies).
    quantization: "none" (the weights as loaded), "int8" or "fp8": the programs take weights
      whose linear layers are `quantization.QuantizedArray`s (`quantize_weights` makes them).
    quantization_group_size: 0 (a scale per output channel) or G, a scale per G values along
      each weight's innermost contracted dim (ValueError where G does not divide a shard's).
    kv_cache_dtype: what the paged cache's pools hold: "auto" (the activations' dtype), "int8"
      or "fp8" (codec codes and scales: `paged_kv`); ValueError where the platform's paged
      attention cannot read them (`ragged.check_kv_cache_dtype`).
    """

    def __init__(self, config: Gemma3Config, *, mesh, allreduce: AllReduceConfig, dtype,
                 reduction: forward.Reduction | None = None,
                 program_cache: ProgramCache | None = None, fold_rotation: bool = False,
                 quantization: str = "none", kv_cache_dtype: str = "auto",
                 quantization_group_size: int = 0):
        self.config = config
        self.quantization = check_quantization(quantization, quantization_group_size)
        self.quantization_group_size = group = quantization_group_size
        self.mesh = mesh
        self.tp = mesh.devices.size
        self.allreduce = allreduce
        self.reduction = reduction
        self.dtype = jnp.dtype(dtype)
        self.program_cache = program_cache
        self.replicated = NamedSharding(mesh, P())
        # "2x2" on a multi-axis TP mesh (its axes then stand for "tp"), None on a 1-D one.
        self.tp_mesh = mesh_label(mesh)
        self.rotation_folded = bool(fold_rotation and reduction is None and self.tp > 1
                                    and folds_rotation(allreduce, config.d_model))
        self._ctx = forward.Ctx(config=config, tp=self.tp, allreduce=allreduce,
                                reduction=reduction, axes=tp_axes(mesh),
                                rotated_partials=self.rotation_folded)
        check_group_size(weight_shapes(config, self.dtype), weight_specs(config, self.tp),
                         self.tp, group)
        self._weight_specs = quantized_specs(weight_specs(config, self.tp), quantization, group)
        self.platform = mesh.devices.flat[0].platform
        check_kv_cache_dtype(kv_cache_dtype, self.platform)
        self.kv_cache_dtype = kv_cache_dtype
        self._pages_specs = paged_specs(config, kv_cache_dtype)
        self.attention = attention_impl(self.platform)
        # Lowering needs only the weights' shapes and shardings, so it can run while they load.
        self.abstract_weights: Weights = quantized_shapes(jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, self.dtype, sharding=sh),
            weight_shapes(config, self.dtype), named(mesh, weight_specs(config, self.tp))),
            quantization, group)
        self._ragged_programs: dict[StepShape, Callable] = {}
        self._span_programs: dict[tuple[str, str], Callable] = {}
        self._zeros_pages = jax.jit(
            lambda *a: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.pages_shapes(*a)),
            static_argnums=(0, 1, 2), out_shardings=named(mesh, self._pages_specs))
        # Executables compiled ahead of time (`compile`): calls with their key run them
        # directly, with no tracing or cache lookup.
        self._executables: dict[ProgramKey, Callable] = {}
        self._jit_ran: set[ProgramKey] = set()  # keys run through the jitted program
        # Keys being compiled on some thread (a server's background compiler): a caller that
        # needs one waits for that compile instead of compiling it a second time.
        self._compiling: dict[ProgramKey, concurrent.futures.Future] = {}
        self._compiling_lock = threading.Lock()

    # -- weights -------------------------------------------------------------------------------
    def fold_weights(self, weights: Weights, donate: bool = False) -> Weights:
        """The weights these programs run on: with `rotation_folded`, each layer's o and linear
        (whose products are the partial sums the AllReduce reduces) times the codec's rotation
        along their output columns, computed shard by shard in place of the originals (their
        buffers are donated: `weights` is consumed); else `weights` unchanged."""
        if not self.rotation_folded:
            return weights
        body = functools.partial(groups.fold_rotation, g=self.allreduce.group_size)

        def fold(w):
            return jax.jit(body, out_shardings=w.sharding,
                           donate_argnums=(0,) if donate else ())(w)

        layers = tuple(dataclasses.replace(lw, o=fold(lw.o), linear=fold(lw.linear))
                       for lw in weights.layers)
        return dataclasses.replace(weights, layers=layers)

    def quantize_weights(self, weights: Weights, donate: bool = False) -> Weights:
        """The weights these programs run on from unquantized (and already `fold_weights`ed)
        ones: with a quantization, each linear layer's weight as a `QuantizedArray`, computed
        on the devices, shard by shard, in the programs' shardings (the originals' buffers
        donated with `donate`: `weights` is consumed); else `weights` unchanged."""
        if self.quantization == "none":
            return weights
        shardings = named(self.mesh, self._weight_specs)

        def one(name, w):  # every layer's field has the same sharding
            out = shardings.embed if name == "embed" else getattr(shardings.layers[0], name)
            body = functools.partial(quantize, quantization=self.quantization,
                                     contracted=CONTRACTED[name],
                                     group_size=self.quantization_group_size)
            return jax.jit(body, out_shardings=out, donate_argnums=(0,) if donate else ())(w)

        return map_quantized(weights, one)

    # -- shapes --------------------------------------------------------------------------------
    def pages_shapes(self, num_global_pages: int, num_local_pages: int,
                     page_size: int) -> PagedKV:
        heads = local_kv_heads(self.config, self.tp) * self.tp
        return paged_shapes(self.config, num_global_pages, num_local_pages, page_size, heads,
                            pool_dtype(self.dtype, self.platform), self.kv_cache_dtype,
                            self.platform)

    def abstract_pages(self, num_global_pages: int, num_local_pages: int,
                       page_size: int) -> PagedKV:
        """The paged cache's ShapeDtypeStructs, with their shardings."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            self.pages_shapes(num_global_pages, num_local_pages, page_size),
                            named(self.mesh, self._pages_specs))

    def zeros_pages(self, num_global_pages: int, num_local_pages: int,
                    page_size: int) -> PagedKV:
        """A zeroed, sharded paged cache (zeros: the scratch page must hold finite values)."""
        self.pages_shapes(num_global_pages, num_local_pages, page_size)  # checks, eagerly
        return self._zeros_pages(num_global_pages, num_local_pages, page_size)

    # -- building ------------------------------------------------------------------------------
    def ragged_program(self, shape: StepShape) -> Callable:
        """The step's program for batches of `shape`: (weights, pages, tokens [T], the batch's
        other fields `ragged.pack`ed[, ImageRows]) -> its outputs (see `Program`). One jitted
        program per shape, which unpacks the batch with static slices."""
        if shape not in self._ragged_programs:
            self._ragged_programs[shape] = self._build_ragged(shape)
        return self._ragged_programs[shape]

    def _build_ragged(self, shape: StepShape) -> Callable:
        ids, pages, vocab_last = P(), self._pages_specs, P(None, AXIS)
        logits, every = shape.logits, shape.every_token

        def ragged_step_packed(w, kv, tokens, packed, rows=None):
            out = ragged_step(w, kv, unpack(tokens, packed, shape), rows, ctx=self._ctx,
                              attention=self.attention, logits=logits, every_token=every)
            return out if logits else out[1]

        in_specs = (self._weight_specs, pages, ids, ids)
        in_specs += (ImageRows(features=ids, index=ids),) if shape.features else ()
        out_specs = ((vocab_last, vocab_last, pages) if every else
                     (vocab_last, pages) if logits else pages)
        return self._jit(step_program(shape), ragged_step_packed, in_specs, out_specs, donate=(1,),
                         salt=f" shape={shape}")

    def span_program(self, part: str, kind: str) -> Callable:
        """An image span's stage over one layer of `kind` ("global" or "local"): part "kv"
        (layer weights, layer pages, x [N, D], positions [N], write [N]) -> layer pages
        (donated), or "rows" (layer weights, layer pages, x [N, D], RaggedBatch, start) -> x
        (donated). `ragged.span_kv` / `span_rows`; one program per shape, kept by jit."""
        key = (part, kind)
        if key not in self._span_programs:
            layer = next(i for i in range(self.config.num_layers)
                         if ("global" if self.config.is_global(i) else "local") == kind)
            w, pages, ids = self._weight_specs.layers[layer], self._pages_specs.layers[layer], P()
            if part == "kv":
                body = functools.partial(span_kv, kind=kind, ctx=self._ctx)
                fn = self._shard_jit(body, (w, pages, ids, ids, ids), pages, (1,), True)
            else:
                batch = RaggedBatch(**{f.name: ids for f in dataclasses.fields(RaggedBatch)})
                body = functools.partial(span_rows, kind=kind, ctx=self._ctx)
                # x is the replicated residual stream, as inside every step, but after an
                # AllReduce shard_map cannot prove it so: the check is off.
                fn = self._shard_jit(body, (w, pages, ids, batch, ids), ids, (2,), False)
            self._span_programs[key] = fn
        return self._span_programs[key]

    def _shard_jit(self, body, in_specs, out_specs, donate, check: bool):
        # A plugged-in reduction may run collectives over axes of its own (eval.quality_scaling
        # vmaps equarx.all_reduce over emulated devices), which shard_map's varying-axes check
        # cannot type; nor can this JAX's Pallas TPU lowering and interpreter the @pallas
        # kernels' device ids (equarx.pallas_ring.check_untyped). The model's own ppermute
        # reductions keep the check.
        check = check and self.reduction is None and self.allreduce.impl == "ppermute"
        return jax.jit(jax.shard_map(body, mesh=self.mesh,
                                     in_specs=resolve_tree(self.mesh, in_specs),
                                     out_specs=resolve_tree(self.mesh, out_specs),
                                     check_vma=check), donate_argnums=donate)

    def _jit(self, program: Program, body, in_specs, out_specs, donate=(), salt: str = ""):
        # Nor the Pallas attention kernel's outputs (the ragged step on TPU).
        check = not (program in RAGGED_PROGRAMS and self.attention == "pallas")
        fn = self._shard_jit(body, in_specs, out_specs, donate, check)
        # A plugged-in reduction's source is outside the program cache's fingerprint (models/,
        # equarx/), so a stored program could outlive an edit to it: such programs are traced.
        if self.program_cache is None or self.reduction is not None:
            return fn
        # Everything besides the arguments' shapes that changes what tracing produces.
        # (A multi-axis mesh lowers to the same HLO shardings as the 1-D one of its size.)
        static = (f"{self.config!r} tp={self.tp} {self.allreduce!r} "
                  f"dtype={self.dtype}"
                  f" rotated_partials={self.rotation_folded}"
                  + (f" quantization={self.quantization}" if self.quantization != "none" else "")
                  + (f" quantization_group_size={self.quantization_group_size}"
                     if self.quantization_group_size else "")
                  + (f" kv_cache_dtype={self.kv_cache_dtype}"
                     if self.kv_cache_dtype != "auto" else "")
                  + (f" tp_mesh={self.tp_mesh}" if self.tp_mesh else "") + salt)
        return self.program_cache.wrap(program.value, fn, donate, static, self.replicated)

    def program_of(self, key: ProgramKey) -> Callable:
        """The jitted program that runs `key`."""
        return self.ragged_program(key.shape)

    # -- lowering, compiling, running ------------------------------------------------------------
    def abstract_args(self, key: ProgramKey) -> tuple:
        """ShapeDtypeStructs (with shardings) of the arguments of `key`'s program."""
        def ids(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.replicated)

        s = key.shape
        args = (self.abstract_weights, self.abstract_pages(*key.pools), ids(s.tokens),
                ids(s.packed_size))
        if s.features:
            features = jax.ShapeDtypeStruct((s.features, self.config.d_model), self.dtype,
                                            sharding=self.replicated)
            args += (ImageRows(features=features, index=ids(s.tokens)),)
        return args

    def lower(self, key: ProgramKey) -> jax.stages.Lowered:
        """`key`'s program lowered from abstract arguments: `.compile()` it, or read its HLO."""
        return self.program_of(key).lower(*self.abstract_args(key))

    def compile(self, key: ProgramKey) -> None:
        """Compile `key`'s program (without running it) and keep the executable; if another
        thread is compiling it, wait for that one."""
        with self._compiling_lock:
            if key in self._executables or key in self._jit_ran:  # a step compiled it on first use
                return
            pending = self._compiling.get(key)
            mine = pending is None
            if mine:
                pending = self._compiling[key] = concurrent.futures.Future()
        if not mine:
            pending.result()
            return
        try:
            self._executables[key] = self.lower(key).compile()
            pending.set_result(None)
        except BaseException as e:
            pending.set_exception(e)
            raise
        finally:
            with self._compiling_lock:
                del self._compiling[key]

    def compile_all(self, jobs: Iterable[tuple[str, Iterable[ProgramKey]]], workers: int = 2,
                    progress: Callable[[str], None] | None = None) -> None:
        """Compile and keep each job's programs; `workers` jobs at a time: XLA compiles (and
        reads executables back from its cache) with the GIL released, so one program's
        compilation overlaps the next one's tracing. `progress` gets one line per job."""
        def run(job) -> str:
            name, keys = job
            t = time.perf_counter()
            for key in keys:
                self.compile(key)
            return f"{name}: {time.perf_counter() - t:.1f}s"

        with concurrent.futures.ThreadPoolExecutor(max(1, workers),
                                                   thread_name_prefix="compile") as pool:
            for line in pool.map(run, jobs):
                if progress is not None:
                    progress(line)

    def runnable(self, key: ProgramKey) -> Callable:
        """The executable kept for `key` (after the compile of it in progress, if any), else
        the jitted program (traced on first use)."""
        pending = self._compiling.get(key)
        if pending is not None:
            pending.exception()  # waits; a failed compile leaves the jitted program
        executable = self._executables.get(key)
        if executable is not None:
            return executable
        if key in self._jit_ran:
            return self.program_of(key)
        return functools.partial(self._first_call, key)

    def _first_call(self, key: ProgramKey, *args):
        """A program's first call without a kept executable: it traces and compiles (or reads
        the compilation cache) while its caller waits. Logged, since in a server every running
        sequence waits for it and it would read as a slow step otherwise."""
        t0 = time.perf_counter()
        out = self.program_of(key)(*args)
        self._jit_ran.add(key)
        log.info("%s compiled on first use: %.1fs, its caller waited", key.describe(),
                 time.perf_counter() - t0)
        return out

    def kept(self) -> frozenset[ProgramKey]:
        """The keys whose executables are kept."""
        return frozenset(self._executables)
