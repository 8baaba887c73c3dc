"""Multi-host serving on JAX's distributed runtime: one process per host, one mesh over all of them.

JAX runs a multi-host slice as one program per host, and every process must call the same jitted
programs in the same order (each program's collectives pair up across processes). So only process
0 serves HTTP and schedules; before every engine step it broadcasts the step's inputs (a few small
numpy arrays) to the others, which loop: receive a step, run it, repeat, until a shutdown step.

A step travels as one fixed-size int32 array (`encode_step`/`decode_step`), so the broadcast is a
single compiled program whatever the step. When process 0 is idle it broadcasts a heartbeat step
every `heartbeat_s` seconds, so a worker that hears nothing for `step_timeout_s` knows that process
0 is gone or stuck. Any failure of a step (a peer died mid-collective, or the watchdog fired) ends
the process with a clear error: the processes can no longer be kept in step, so serving on is not
an option.

No jax import at module level: `initialize` must run before jax creates its backends.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Callable, Mapping

import numpy as np

log = logging.getLogger(__name__)

# Step kinds (header[0]).
IDLE, PREFILL, DECODE, RESET, SHUTDOWN, MOVE = 0, 1, 2, 3, 4, 5
_KIND_NAMES = {IDLE: "idle", PREFILL: "prefill", DECODE: "decode", RESET: "reset", SHUTDOWN: "shutdown",
               MOVE: "move"}
_HEADER = 8  # kind, rows, columns, prompt_logprobs, payload length, (spare)

EXIT_PEER_LOST = 3  # exit status when the process group breaks


# ---- settings ----

@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """How this process joins the group. `coordinator_address=None` with `auto=True` lets jax
    detect the cluster itself (Cloud TPU VM slices, SLURM, ...)."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    heartbeat_timeout_s: int = 30  # jax's coordination service declares a silent process dead
    step_timeout_s: float = 600.0  # watchdog: longest wait for (or run of) one step
    heartbeat_s: float = 2.0  # process 0 broadcasts an idle step this often when nothing runs

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.num_processes is not None \
                and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.coordinator_address is not None and (self.num_processes is None or self.process_id is None):
            raise ValueError("--coordinator-address needs --num-processes and --process-id")
        if self.coordinator_address is None and not self.auto and (
                self.num_processes not in (None, 1) or self.process_id not in (None, 0)):
            raise ValueError("--num-processes/--process-id need --coordinator-address (or --distributed auto)")
        if self.heartbeat_timeout_s < 1 or self.step_timeout_s <= 0 or self.heartbeat_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.heartbeat_s >= self.step_timeout_s:
            raise ValueError("heartbeat_s must be shorter than step_timeout_s")

    @property
    def enabled(self) -> bool:
        return self.auto or (self.coordinator_address is not None and (self.num_processes or 1) > 1)


# flag dest -> (environment variables, most specific first; type; help)
_FLAGS: dict[str, tuple[tuple[str, ...], type, str]] = {
    "coordinator_address": (("GEMMA3_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS"), str,
                            "host:port of process 0's coordination service (multi-host)"),
    "num_processes": (("GEMMA3_NUM_PROCESSES", "JAX_NUM_PROCESSES"), int, "processes in the group"),
    "process_id": (("GEMMA3_PROCESS_ID", "JAX_PROCESS_ID"), int, "this process's index (0 serves HTTP)"),
    "distributed": (("GEMMA3_DISTRIBUTED",), str,
                    "'auto': let jax detect the cluster (Cloud TPU VM slice; the default when "
                    "TPU_WORKER_HOSTNAMES lists several hosts); 'off'"),
    "heartbeat_timeout": (("GEMMA3_HEARTBEAT_TIMEOUT",), int,
                          "seconds after which a silent process counts as dead (default 30)"),
    "step_timeout": (("GEMMA3_STEP_TIMEOUT",), float,
                     "watchdog: seconds a process may wait for or run one step (default 600)"),
}
FLAG_DESTS = tuple(_FLAGS)


def add_arguments(parser, only: tuple[str, ...] | None = None) -> None:
    group = parser.add_argument_group("multi-host (JAX distributed runtime)")
    for dest, (envs, kind, help) in _FLAGS.items():
        if only is not None and dest not in only:
            continue
        choices = ("auto", "off") if dest == "distributed" else None
        group.add_argument("--" + dest.replace("_", "-"), type=kind, default=None, choices=choices,
                           help=f"{help} (env {' or '.join(envs)})")


def settings_from(values: Mapping[str, object], env: Mapping[str, str] | None = None) -> DistributedSettings:
    """Flags (None = not given) over environment variables over defaults."""
    env = os.environ if env is None else env
    merged: dict[str, object] = {}
    for dest, (envs, kind, _) in _FLAGS.items():
        v = values.get(dest)
        if v is None:
            v = next((env[e] for e in envs if env.get(e)), None)
        if v is not None:
            try:
                merged[dest] = kind(v)
            except ValueError:
                raise ValueError(f"{dest}: cannot use {v!r}") from None
    # GKE and some TPU VM images name every host of the slice: several hosts means multi-host.
    multi_host_tpu = len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1
    default = "auto" if multi_host_tpu and "coordinator_address" not in merged else "off"
    mode = merged.pop("distributed", default)
    if mode not in ("auto", "off"):
        raise ValueError(f"distributed must be 'auto' or 'off', got {mode!r}")
    kw = {}
    if "heartbeat_timeout" in merged:
        kw["heartbeat_timeout_s"] = merged.pop("heartbeat_timeout")
    if "step_timeout" in merged:
        kw["step_timeout_s"] = merged.pop("step_timeout")
        kw["heartbeat_s"] = min(2.0, kw["step_timeout_s"] / 4)
    return DistributedSettings(auto=mode == "auto", **merged, **kw)


def local_device_count(tp: int, settings: DistributedSettings) -> int:
    """Virtual CPU devices this process should create: its share of the tp mesh."""
    n = settings.num_processes or 1
    if tp % n:
        raise ValueError(f"tp={tp} must be a multiple of the number of processes ({n})")
    return tp // n


def initialize(settings: DistributedSettings) -> None:
    """Joins the group; must run before any other jax use. CPU collectives between processes go
    through gloo (TCP); TPU/GPU backends use their own interconnect."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if settings.auto and settings.coordinator_address is None:
        jax.distributed.initialize(heartbeat_timeout_seconds=settings.heartbeat_timeout_s)
    else:
        jax.distributed.initialize(settings.coordinator_address, settings.num_processes, settings.process_id,
                                   heartbeat_timeout_seconds=settings.heartbeat_timeout_s)
    log.info("process %d of %d joined: %d local / %d global %s devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count(), jax.default_backend())


# ---- the step wire format ----

def step_capacity(num_slots: int, buckets: tuple[int, ...], batch_sizes_for: Callable[[int], tuple[int, ...]]) -> int:
    """Int32 words of the largest step an engine can be asked to run (header included)."""
    need = _HEADER + 6 * num_slots  # decode: tokens, positions and 4 sampling fields per slot
    for bucket in buckets:
        for batch in batch_sizes_for(bucket):
            need = max(need, _HEADER + batch * bucket + 6 * batch)
    return need


def _words(a: np.ndarray, dtype) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype)).reshape(-1).view(np.int32)


def encode_step(kind: int, inputs, capacity: int) -> np.ndarray:
    """One step as int32 [capacity]: a header and the arrays bit-cast to int32, zero-padded."""
    header = np.zeros(_HEADER, np.int32)
    header[0] = kind
    parts: list[np.ndarray] = []
    if kind == PREFILL:
        rows, cols = inputs.tokens.shape
        header[1:4] = rows, cols, int(bool(inputs.prompt_logprobs))
        parts = [_words(inputs.tokens, np.int32), _words(inputs.lengths, np.int32),
                 _words(inputs.slots, np.int32)]
    elif kind == DECODE:
        header[1] = rows = inputs.tokens.shape[0]
        parts = [_words(inputs.tokens, np.int32), _words(inputs.positions, np.int32)]
    elif kind == MOVE:
        header[1:3] = inputs  # (src, dst) slots
    elif inputs is not None:
        raise ValueError(f"a {_KIND_NAMES.get(kind, kind)} step carries no inputs")
    if kind in (PREFILL, DECODE):
        s = inputs.sampling
        parts += [_words(s.temperature, np.float32), _words(s.top_k, np.int32),
                  _words(s.top_p, np.float32), _words(s.seed, np.uint32)]
    payload = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    header[4] = payload.size
    if _HEADER + payload.size > capacity:
        raise ValueError(f"step of {_HEADER + payload.size} words exceeds the broadcast capacity {capacity}")
    out = np.zeros(capacity, np.int32)
    out[:_HEADER] = header
    out[_HEADER:_HEADER + payload.size] = payload
    return out


def decode_step(buf: np.ndarray) -> tuple[int, object]:
    """Inverse of `encode_step`: (kind, PrefillInputs | DecodeInputs | None)."""
    from serving.engine import DecodeInputs, PrefillInputs
    from serving.sampling import SlotSampling

    buf = np.asarray(buf, np.int32)
    kind, rows, cols, prompt_lps, size = (int(v) for v in buf[:5])
    payload = buf[_HEADER:_HEADER + size]
    if kind not in _KIND_NAMES:
        raise ValueError(f"unknown step kind {kind}")
    if kind == MOVE:
        return kind, (rows, cols)
    if kind not in (PREFILL, DECODE):
        return kind, None
    pos = 0

    def take(n: int, dtype) -> np.ndarray:
        nonlocal pos
        chunk = payload[pos:pos + n]
        pos += n
        return chunk.view(dtype).copy()

    if kind == PREFILL:
        tokens = take(rows * cols, np.int32).reshape(rows, cols)
        lengths, slots = take(rows, np.int32), take(rows, np.int32)
    else:
        tokens, positions = take(rows, np.int32), take(rows, np.int32)
    sampling = SlotSampling(take(rows, np.float32), take(rows, np.int32), take(rows, np.float32),
                            take(rows, np.uint32))
    if pos != size:
        raise ValueError(f"malformed step: {size} payload words, {pos} used")
    if kind == PREFILL:
        return kind, PrefillInputs(tokens, lengths, slots, sampling, bool(prompt_lps))
    return kind, DecodeInputs(tokens, positions, sampling)


# ---- failure detection ----

class Watchdog:
    """Ends the process when an armed wait lasts longer than `timeout_s`: a collective whose peer
    vanished can block forever inside the runtime, where no Python exception reaches it."""

    def __init__(self, timeout_s: float, what: str, exit: Callable[[int], None] = os._exit):
        self.timeout_s = timeout_s
        self.what = what
        self._exit = exit
        self._armed_at: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        with self._lock:
            self._armed_at = time.monotonic()

    def disarm(self) -> None:
        with self._lock:
            self._armed_at = None

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            with self._lock:
                armed = self._armed_at
            if armed is not None and time.monotonic() - armed > self.timeout_s:
                fatal(f"no progress for {self.timeout_s:.0f}s while {self.what}: another process has "
                      "died or hangs", self._exit)
                return


def fatal(message: str, exit: Callable[[int], None] = os._exit) -> None:
    """Logs and ends the process at once (jax's runtime threads would otherwise keep it alive)."""
    import jax

    text = f"multi-host serving failed in process {jax.process_index()} of {jax.process_count()}: {message}"
    log.critical("%s", text)
    print(f"FATAL: {text}", file=sys.stderr, flush=True)
    for h in logging.getLogger().handlers:
        h.flush()
    exit(EXIT_PEER_LOST)


# ---- process 0 and the workers ----

class _Broadcaster:
    def __init__(self, capacity: int):
        from jax.experimental import multihost_utils

        self.capacity = capacity
        self._bcast = multihost_utils.broadcast_one_to_all

    def __call__(self, buf: np.ndarray | None) -> np.ndarray:
        if buf is None:
            buf = np.zeros(self.capacity, np.int32)
        return np.asarray(self._bcast(buf))


class LeaderEngine:
    """Process 0's engine: the scheduler drives it exactly like the local engine it wraps; each
    step is broadcast to the workers first. Idle heartbeats keep the workers' watchdogs quiet."""

    def __init__(self, engine, settings: DistributedSettings):
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self.settings = settings
        self.capacity = step_capacity(self.info.num_slots, self.info.prefill_buckets, self.info.batch_sizes_for)
        self._bcast = _Broadcaster(self.capacity)
        self._lock = threading.Lock()  # one step at a time: broadcasts must keep their order
        self._last = time.monotonic()
        self._closed = False
        self._watchdog = Watchdog(settings.step_timeout_s, "running a step on process 0")
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="step-heartbeat", daemon=True)
        self._heartbeat.start()

    def bucket_for(self, length: int) -> int:
        return self.engine.bucket_for(length)

    def run_prefill(self, inputs):
        return self._step(PREFILL, inputs, lambda: self.engine.run_prefill(inputs))

    def run_decode(self, inputs):
        return self._step(DECODE, inputs, lambda: self.engine.run_decode(inputs))

    def move_slot(self, src: int, dst: int) -> None:
        self._step(MOVE, (src, dst), lambda: self.engine.move_slot(src, dst))

    def reset(self) -> None:
        self._step(RESET, None, self.engine.reset)

    def close(self) -> None:
        """Ends the workers' loops (they exit 0) and stops the heartbeat."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._send(SHUTDOWN, None)
            self._closed = True
        self._watchdog.close()

    def _step(self, kind: int, inputs, run: Callable[[], object]):
        with self._lock:
            if self._closed:
                raise RuntimeError("the process group has shut down")
            self._send(kind, inputs)
            self._watchdog.arm()
            try:
                return run()
            except Exception as e:
                # The workers ran (or failed) the same step; nothing keeps the group in step now.
                fatal(f"{_KIND_NAMES[kind]} step failed: {type(e).__name__}: {e}")
                raise
            finally:
                self._watchdog.disarm()

    def _send(self, kind: int, inputs) -> None:
        buf = encode_step(kind, inputs, self.capacity)
        self._watchdog.arm()
        try:
            self._bcast(buf)
        except Exception as e:
            fatal(f"broadcasting the {_KIND_NAMES[kind]} step failed (a process has died?): "
                  f"{type(e).__name__}: {e}")
            raise
        finally:
            self._watchdog.disarm()
        self._last = time.monotonic()

    def _beat(self) -> None:
        interval = self.settings.heartbeat_s
        while not self._stop.wait(interval / 2):
            if time.monotonic() - self._last < interval or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closed:
                    self._send(IDLE, None)
            finally:
                self._lock.release()


def worker_loop(engine, settings: DistributedSettings) -> int:
    """A non-zero process's life after warm-up: run process 0's steps until it says shutdown."""
    info = engine.info
    capacity = step_capacity(info.num_slots, info.prefill_buckets, info.batch_sizes_for)
    bcast = _Broadcaster(capacity)
    watchdog = Watchdog(settings.step_timeout_s, "waiting for process 0's next step")
    steps = 0
    while True:
        watchdog.arm()
        try:
            kind, inputs = decode_step(bcast(None))
            if kind == PREFILL:
                engine.run_prefill(inputs)
            elif kind == DECODE:
                engine.run_decode(inputs)
            elif kind == MOVE:
                engine.move_slot(*inputs)
            elif kind == RESET:
                engine.reset()
            elif kind == SHUTDOWN:
                watchdog.close()
                log.info("shutdown step received after %d steps", steps)
                return 0
        except Exception as e:
            fatal(f"worker step failed (process 0 has died?): {type(e).__name__}: {e}")
            return EXIT_PEER_LOST
        steps += kind in (PREFILL, DECODE)


def leader_factory(settings: DistributedSettings):
    """Runtime engine factory for process 0: the usual load and warm-up, then broadcast steps."""
    from serving.runtime import load_engine

    def factory(config, progress):
        return LeaderEngine(load_engine(config, progress), settings)

    return factory


def run_worker(config, settings: DistributedSettings) -> int:
    """A non-zero process: load and warm up exactly as process 0 does (the same programs in the
    same order), then follow its steps. Returns the exit status."""
    from serving.runtime import load_engine

    try:
        engine = load_engine(config, lambda msg: log.info("%s", msg))
    except Exception as e:
        log.exception("loading the model failed")
        print(f"error: loading the model failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    log.info("warmed up; following process 0's steps")
    return worker_loop(engine, settings)
