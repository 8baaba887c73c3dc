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
an option. The watchdog is `serving.watchdog`'s, the single-process server's: a step gets
`step_timeout_s`, or `compile_timeout_s` the first time its kind and shapes run (it may compile);
a wait for the other processes may last as long as the step they may still be running.

No jax import at module level (the process joins its group, `jax_platform.join_process_group`,
before jax creates its backends).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable

import numpy as np

from serving import watchdog
from jax_platform import GroupFormationError, ProcessGroup, exit_group_not_formed
from serving.watchdog import StepLimits, describe, step_key

log = logging.getLogger(__name__)

# Step kinds (header[0]).
IDLE, PREFILL, DECODE, RESET, SHUTDOWN, MOVE, CHUNK = 0, 1, 2, 3, 4, 5, 6
_KIND_NAMES = {IDLE: "idle", PREFILL: "prefill", DECODE: "decode", RESET: "reset", SHUTDOWN: "shutdown",
               MOVE: "move", CHUNK: "chunk"}
_HEADER = 8  # kind, rows, columns, prompt_logprobs, payload length, (spare)

EXIT_PEER_LOST = 3  # exit status when the process group breaks


# The group's settings and how a process joins it are process set-up, shared with eval:
# `jax_platform` (ProcessGroup, add_group_arguments, group_from, join_process_group).

# ---- the step wire format ----

def step_capacity(num_slots: int, buckets: tuple[int, ...], batch_sizes_for: Callable[[int], tuple[int, ...]],
                  chunk_size: int = 0, max_seq_len: int = 0) -> int:
    """Int32 words of the largest step an engine can be asked to run (header included)."""
    need = _HEADER + 6 * num_slots  # decode: tokens, positions and 4 sampling fields per slot
    for bucket in buckets:
        for batch in batch_sizes_for(bucket):
            need = max(need, _HEADER + batch * bucket + 6 * batch)
    if chunk_size:  # tokens, start/length/slot/save_block, the blocks to restore, 1 sampling row
        need = max(need, _HEADER + chunk_size + 4 + max_seq_len // chunk_size + 4)
    return need


def _capacity(info) -> int:
    return step_capacity(info.num_slots, info.prefill_buckets, info.batch_sizes_for,
                         info.chunk_size, info.max_seq_len)


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
    elif kind == CHUNK:
        header[1:4] = len(inputs.tokens), len(inputs.restore), int(bool(inputs.final))
        parts = [_words(inputs.tokens, np.int32),
                 _words([inputs.start, inputs.length, inputs.slot, inputs.save_block], np.int32),
                 _words(np.asarray(inputs.restore, np.int32), np.int32)]
    elif inputs is not None:
        raise ValueError(f"a {_KIND_NAMES.get(kind, kind)} step carries no inputs")
    if kind in (PREFILL, DECODE, CHUNK):
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
    from serving.engine import ChunkInputs, DecodeInputs, PrefillInputs
    from serving.sampling import SlotSampling

    buf = np.asarray(buf, np.int32)
    kind, rows, cols, prompt_lps, size = (int(v) for v in buf[:5])
    payload = buf[_HEADER:_HEADER + size]
    if kind not in _KIND_NAMES:
        raise ValueError(f"unknown step kind {kind}")
    if kind == MOVE:
        return kind, (rows, cols)
    if kind not in (PREFILL, DECODE, CHUNK):
        return kind, None
    pos = 0

    def take(n: int, dtype) -> np.ndarray:
        nonlocal pos
        chunk = payload[pos:pos + n]
        pos += n
        return chunk.view(dtype).copy()

    if kind == CHUNK:
        tokens, (start, length, slot, save) = take(rows, np.int32), take(4, np.int32)
        restore = tuple(int(b) for b in take(cols, np.int32))
        rows = 1
    elif kind == PREFILL:
        tokens = take(rows * cols, np.int32).reshape(rows, cols)
        lengths, slots = take(rows, np.int32), take(rows, np.int32)
    else:
        tokens, positions = take(rows, np.int32), take(rows, np.int32)
    sampling = SlotSampling(take(rows, np.float32), take(rows, np.int32), take(rows, np.float32),
                            take(rows, np.uint32))
    if pos != size:
        raise ValueError(f"malformed step: {size} payload words, {pos} used")
    if kind == CHUNK:
        return kind, ChunkInputs(tokens, int(start), int(length), int(slot), sampling,
                                 bool(prompt_lps), restore, int(save))
    if kind == PREFILL:
        return kind, PrefillInputs(tokens, lengths, slots, sampling, bool(prompt_lps))
    return kind, DecodeInputs(tokens, positions, sampling)


# ---- failure detection ----

class Watchdog(watchdog.Watchdog):
    """The group's watchdog: ends the process when an armed wait outlasts its limit (`timeout_s`
    unless `arm` gives another); a collective whose peer vanished can block forever inside the
    runtime, where no Python exception reaches it."""

    def __init__(self, timeout_s: float, what: str, exit: Callable[[int], None] = os._exit):
        def end(what: str, limit: float) -> None:
            fatal(f"no progress for {limit:.0f}s while {what}: another process has died or hangs", exit)

        super().__init__(end, timeout_s, what)


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

    watches_steps = True  # its watchdog ends the group: the engine core needs none of its own

    def __init__(self, engine, settings: ProcessGroup):
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self.settings = settings
        self.capacity = _capacity(self.info)
        self._bcast = _Broadcaster(self.capacity)
        self._lock = threading.Lock()  # one step at a time: broadcasts must keep their order
        self._last = time.monotonic()
        self._closed = False
        self._watchdog = Watchdog(settings.step_timeout_s, "running a step on process 0")
        self._limits = StepLimits(settings.step_timeout_s, settings.compile_timeout_s)
        self._peer_limit = self._limits.compile_s  # the others may still run the last step this long
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="step-heartbeat", daemon=True)
        self._heartbeat.start()

    def bucket_for(self, length: int) -> int:
        return self.engine.bucket_for(length)

    def run_prefill(self, inputs):
        return self._step(PREFILL, inputs, lambda: self.engine.run_prefill(inputs))

    def run_decode(self, inputs):
        return self._step(DECODE, inputs, lambda: self.engine.run_decode(inputs))

    def run_chunk(self, inputs):
        return self._step(CHUNK, inputs, lambda: self.engine.run_chunk(inputs))

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
            key = step_key(_KIND_NAMES[kind], inputs)
            limit = self._limits.limit(key)
            self._watchdog.arm(f"running a {describe(key)} on process 0", limit)
            try:
                out = run()
            except Exception as e:
                # The workers ran (or failed) the same step; nothing keeps the group in step now.
                fatal(f"{_KIND_NAMES[kind]} step failed: {type(e).__name__}: {e}")
                raise
            finally:
                self._watchdog.disarm()
            self._limits.done(key)
            self._peer_limit = limit
            return out

    def _send(self, kind: int, inputs) -> None:
        buf = encode_step(kind, inputs, self.capacity)
        # Every process must join the broadcast: the others may still be running the last step.
        self._watchdog.arm(f"broadcasting the {_KIND_NAMES[kind]} step",
                           max(self._peer_limit, self._limits.limit("broadcast")))
        try:
            self._bcast(buf)
        except Exception as e:
            fatal(f"broadcasting the {_KIND_NAMES[kind]} step failed (a process has died?): "
                  f"{type(e).__name__}: {e}")
            raise
        finally:
            self._watchdog.disarm()
        self._limits.done("broadcast")
        self._peer_limit = self._limits.step_s
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


def worker_loop(engine, settings: ProcessGroup) -> int:
    """A non-zero process's life after warm-up: run process 0's steps until it says shutdown."""
    info = engine.info
    capacity = _capacity(info)
    bcast = _Broadcaster(capacity)
    dog = Watchdog(settings.step_timeout_s, "waiting for process 0's next step")
    limits = StepLimits(settings.step_timeout_s, settings.compile_timeout_s)
    wait = limits.compile_s  # process 0 may still be running the last step (or its first broadcast)
    steps = 0
    while True:
        dog.arm(timeout_s=wait)
        try:
            kind, inputs = decode_step(bcast(None))
            key = step_key(_KIND_NAMES[kind], inputs)
            wait = limits.limit(key)
            dog.arm(f"running a {describe(key)}", wait)
            if kind == PREFILL:
                engine.run_prefill(inputs)
            elif kind == DECODE:
                engine.run_decode(inputs)
            elif kind == CHUNK:
                engine.run_chunk(inputs)
            elif kind == MOVE:
                engine.move_slot(*inputs)
            elif kind == RESET:
                engine.reset()
            elif kind == SHUTDOWN:
                dog.close()
                log.info("shutdown step received after %d steps", steps)
                return 0
        except Exception as e:
            fatal(f"worker step failed (process 0 has died?): {type(e).__name__}: {e}")
            return EXIT_PEER_LOST
        limits.done(key)
        steps += kind in (PREFILL, DECODE, CHUNK)


def leader_factory(settings: ProcessGroup):
    """Runtime engine factory for process 0: the usual load and warm-up, then broadcast steps."""
    from serving.runtime import load_engine

    def factory(config, progress):
        try:
            engine = load_engine(config, progress)
        except GroupFormationError as e:
            exit_group_not_formed(e)  # at once: the others' deadlines are running too
        return LeaderEngine(engine, settings)

    return factory


def run_worker(config, settings: ProcessGroup) -> int:
    """A non-zero process: load and warm up exactly as process 0 does (the same programs in the
    same order), then follow its steps. Returns the exit status."""
    from serving.runtime import load_engine

    try:
        engine = load_engine(config, lambda msg: log.info("%s", msg))
    except GroupFormationError as e:
        exit_group_not_formed(e)
    except Exception as e:
        log.exception("loading the model failed")
        print(f"error: loading the model failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    log.info("warmed up; following process 0's steps")
    return worker_loop(engine, settings)
