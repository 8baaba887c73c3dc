"""What a running server holds: its settings, the engine once loaded and warmed up, the engine
core that runs it and the metrics. Loading runs on a background thread so that /health answers 503 meanwhile.

Test hook: `GEMMA3_TEST_STALL_STEP=<n>`, read when the engine core is built, makes its n-th engine
call block forever (as a step wedged in the runtime would), to exercise the step watchdog.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from serving.config import ServerConfig
from serving.metrics import Metrics
from serving.engine_core import EngineCore

log = logging.getLogger(__name__)

STALL_STEP_ENV = "GEMMA3_TEST_STALL_STEP"

RunnerFactory = Callable[[ServerConfig, Callable[[str], None]], object]


BACKGROUND_STOP_S = 120.0  # the most a shutdown waits for the program being compiled


class Runtime:
    def __init__(self, config: ServerConfig, runner_factory: RunnerFactory | None = None):
        self.config = config
        self.status = "loading"  # loading -> ready -> shutting_down; or error (load), stuck (a step)
        self.error: str | None = None
        self.runner = None
        self.core: EngineCore | None = None
        self.metrics: Metrics | None = None
        self.created = int(time.time())
        self.load_seconds: float | None = None
        self._factory = runner_factory or load_runner
        self._thread: threading.Thread | None = None
        self.background = None  # serving.background_compile.BackgroundCompiler, once serving
        self.sampling_defaults: dict = {}  # what requests that leave them out sample with
        self.on_load_failure: Callable[[str], None] | None = None

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def start_loading(self) -> "Runtime":
        self._thread = threading.Thread(target=self.load, name="model-loader", daemon=True)
        self._thread.start()
        return self

    def load(self) -> None:
        t0 = time.perf_counter()
        try:
            runner = self._factory(self.config, lambda msg: log.info("%s", msg))
            self.sampling_defaults = model_sampling_defaults(self.config, getattr(runner, "tokenizer", None))
            if self.sampling_defaults:
                log.info("requests that leave them out sample with the model's "
                         "generation_config.json: %s (--generation-config none: OpenAI's)",
                         self.sampling_defaults)
        except Exception as e:
            log.exception("loading the model failed")
            self.status, self.error = "error", f"{type(e).__name__}: {e}"
            if self.on_load_failure is not None:
                self.on_load_failure(self.error)
            return
        self.attach(runner)
        self.load_seconds = time.perf_counter() - t0
        log.info("ready in %.1fs: %s", self.load_seconds, runner.info)

    def attach(self, runner) -> None:
        """Starts serving with an engine (loaded and warmed up)."""
        info = runner.info
        self.runner = runner
        self.metrics = Metrics(self.config.model_name, info.allreduce_label, info.tp, info.dtype,
                               weights=info.weights, kv_cache=info.kv_cache)
        c = self.config
        # A multi-host group's leader watches its steps itself (a stuck step ends the group).
        watched = not getattr(runner, "watches_steps", False)
        stall = _stall_step()
        self.core = EngineCore(runner, max_waiting=c.max_waiting, metrics=self.metrics,
                               admission_wait=c.admission_wait_ms / 1000, overlap=c.overlap,
                               step_timeout=c.step_timeout if watched else None,
                               compile_timeout=c.compile_timeout, on_stuck=self._on_stuck,
                               stall_step=stall).start()
        if self.status == "loading":
            self.status = "ready"
        if c.background_compile:
            self._compile_in_background(runner)

    def _compile_in_background(self, runner) -> None:
        """The step programs the warm-up left, compiled while the engine is idle (one
        process; serving/background_compile.py)."""
        programs = getattr(getattr(runner, "model", None), "programs", None)
        later = runner.later_programs() if hasattr(runner, "later_programs") and programs else []
        if not later:
            return
        from serving.background_compile import BackgroundCompiler

        core = self.core
        self.background = BackgroundCompiler(
            later, programs.compile,
            idle=lambda: core.num_running == 0 and core.num_waiting == 0).start()

    def _on_stuck(self, message: str) -> None:
        """A step got stuck (the engine core's watchdog): unhealthy until restarted."""
        self.status, self.error = "stuck", message

    def begin_shutdown(self) -> None:
        """Stop accepting new requests (running ones continue)."""
        if self.status in ("loading", "ready"):
            self.status = "shutting_down"
        if self.core is not None:
            self.core.stop_accepting()

    def shutdown(self, drain_timeout: float = 0.0, join_timeout: float | None = None) -> bool:
        """Returns whether the engine thread ended (not if a step is stuck: `EngineCore.shutdown`)."""
        self.begin_shutdown()
        if self.core is None:
            return True
        ended = self.core.shutdown(drain_timeout, join_timeout)
        if self.background is not None:
            # After the program being compiled: exiting under a compile could crash the process.
            self.background.stop(BACKGROUND_STOP_S)
        return ended

    def describe(self) -> dict:
        """Model, parallelism and AllReduce mode (shown by /health and /v1/models)."""
        c = self.config
        d = {"model": c.model_name, "source": c.model, "tp": c.tp, "dtype": c.dtype,
             "allreduce": c.allreduce_config().to_dict(), "allreduce_label": c.allreduce_config().label,
             "max_model_len": c.max_seq_len, "max_num_seqs": c.max_num_seqs,
             "batch_invariant": c.batch_invariant}
        if self.runner is not None:
            info = self.runner.info
            d.update(tp=info.tp, dtype=info.dtype, allreduce=info.allreduce,
                     allreduce_label=info.allreduce_label, max_model_len=info.max_seq_len,
                     weights=info.weights,
                     max_num_seqs=info.max_num_seqs, deterministic=info.deterministic,
                     long_prefill_token_threshold=info.long_prefill_token_threshold,
                     prefix_caching=info.prefix_caching, engine="paged", page_size=info.page_size,
                     kv_cache_pages={"global": info.num_global_pages - 1,
                                     "local": info.num_local_pages - 1},
                     max_num_batched_tokens=info.max_num_batched_tokens,
                     kv_cache=info.kv_cache,
                     sampling_defaults=self.sampling_defaults)
        return d


def model_sampling_defaults(config: ServerConfig, tokenizer) -> dict:
    """The model's sampling defaults under --generation-config auto, checked as a request's
    values are (a bad one is an error naming the file); {} for none."""
    from serving.sampling import checked_defaults

    values = getattr(tokenizer, "sampling_defaults", None) or {}
    if config.generation_config != "auto" or not values:
        return {}
    return checked_defaults(values, "the model's generation_config.json")


def _stall_step() -> int | None:
    """The test hook's step (module docstring), None when it is not set."""
    value = os.environ.get(STALL_STEP_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        log.error("ignoring %s=%r: not a step number (1, 2, ...)", STALL_STEP_ENV, value)
        return None
    log.warning("test hook %s=%s: engine call %s will block forever", STALL_STEP_ENV, value, value)
    return int(value)


def configure_jax(config: ServerConfig) -> None:
    """Persistent compilation cache: a restart (or the second server) loads compiled programs
    instead of compiling them again, which is most of the start-up time on CPU. (The traced
    programs are kept beside it, see `load_runner`.) Also keeps freed host memory for reuse (no
    page faults on every large temporary). Both from `jax_platform`."""
    import jax_platform

    jax_platform.keep_freed_memory()
    jax_platform.enable_compilation_cache(config.compile_cache_dir)


def load_configured_model(config: ServerConfig):
    """The model a config names, with the traced programs and a GGUF file's decoded weights
    kept beside the compilation cache (call `configure_jax` first)."""
    from models.gemma3 import load_model

    cache = config.compile_cache_dir
    return load_model(config.model, tp=config.tp, tp_mesh=config.tp_mesh,
                      allreduce=config.allreduce_config(),
                      dtype=config.dtype, max_seq_len=config.max_seq_len,
                      quantization=config.quantization,
                      quantization_group_size=config.quantization_group_size,
                      kv_cache_dtype=config.kv_cache_dtype,
                      program_cache_dir=os.path.join(cache, "programs") if cache else None,
                      weights_cache_dir=os.path.join(cache, "weights") if cache else None)


def load_runner(config: ServerConfig, progress: Callable[[str], None]):
    """The real engine (serving/paged_runner.py): loads the model, allocates the KV pages,
    compiles the warm-up's programs and warms up; the other step shapes compile on first use
    or in the background once serving (`Runtime`). In a multi-process group every process
    builds the same engine and warms it up in the same order, and the processes wait for each
    other once loaded and once compiled: their first collective (gloo's rendezvous, which gives
    up after 30 s) then starts in every process at once, however unevenly they loaded
    (`jax_platform.group_barrier`, deadline --load-timeout)."""
    configure_jax(config)
    import jax

    import jax_platform
    from serving.paged_runner import PagedRunner

    if config.deterministic and not config.batch_invariant:
        log.warning("--allreduce %s shares quantization scales across tokens: in deterministic "
                    "mode outputs still do not depend on the batch's shape, but they can depend "
                    "on the other requests' values (the token-local int8 cannot)",
                    config.allreduce_config().label)
    mesh = f", tp_mesh={config.tp_mesh}" if config.tp_mesh else ""
    progress(f"loading {config.model} (tp={config.tp}{mesh}, {config.dtype}, allreduce="
             f"{config.allreduce_config().label}) on {len(jax.devices())} {jax.default_backend()} device(s)")
    group = jax.process_count() > 1
    t = time.perf_counter()
    model = load_configured_model(config)
    progress(f"weights loaded in {time.perf_counter() - t:.1f}s")
    model_sampling_defaults(config, model.tokenizer)  # a bad one fails before the compiles
    if group:
        jax_platform.group_barrier("loaded")
    runner = PagedRunner(model, max_num_seqs=config.max_num_seqs, max_seq_len=config.max_seq_len,
                         page_size=config.page_size, kv_cache_tokens=config.kv_cache_tokens or None,
                         long_prefill_token_threshold=config.long_prefill_token_threshold,
                         max_num_batched_tokens=config.max_num_batched_tokens or None,
                         prefix_caching=config.prefix_caching, deterministic=config.deterministic,
                         model_name=config.model_name)
    info = runner.info
    progress(f"paged KV cache: {info.num_global_pages - 1} global and {info.num_local_pages - 1} "
             f"local pages of {info.page_size} tokens ({info.kv_cache_dtype}, "
             f"{info.kv_cache_bytes / 2**20:.1f} MiB), step budget {info.max_num_batched_tokens} tokens")
    # The step programs compiled first, several at a time (XLA compiles with the GIL released):
    # the warm-up then only runs them.
    runner.compile_warmup(progress, everything=config.precompile == "all")
    if group:
        jax_platform.group_barrier("compiled")
    seconds = runner.warmup(progress)
    progress(f"warm-up done in {seconds:.1f}s (total {time.perf_counter() - t:.1f}s)")
    return runner
