"""The engine core: the thread that owns the engine and runs its steps, and the thread-safe face
consumers (HTTP, CLI, `LLM`) submit sequences to and cancel them through. Each step: the
scheduler plans it, the runner runs it as one ragged step, the output processor turns its outputs
into `Event`s delivered on the engine thread. Steps are overlapped (step N+1 dispatched before
step N's tokens are read), and every engine call runs under the step watchdog. See
docs/engine.md, "Overlapped steps", and docs/deployment.md, "Stuck steps"."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import threading
import time
from typing import Callable


from serving.runner import Runner
from serving.logits_processing import step_extras
from serving.metrics import NullMetrics
from serving.output_processor import Emitted, OutputProcessor, Sink
from serving.paged_scheduler import PagedScheduler, StepPlan
from serving.sampling import LogitsExtras, SamplingParams, check_generable
from serving.sequence import Sequence
from serving.watchdog import StepLimits, StepStuck, Watchdog, describe, step_key

log = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """The engine core no longer accepts work."""


class EngineStuck(ShuttingDown):
    """The engine core stopped for good: a step got stuck (the process must be restarted)."""


class EngineCore:
    """step_timeout, compile_timeout: the watchdog's limits in seconds (module docstring; None: no
    watchdog); on_stuck(message): told once when a step got stuck, after the core stopped
    accepting work and before the failed sequences' events go out. stall_step: a test hook, the
    stall_step-th engine call (1-based) blocks forever."""

    def __init__(self, runner: Runner, max_waiting: int = 256, metrics=None, admission_wait: float = 0.0,
                 overlap: bool = True, step_timeout: float | None = None, compile_timeout: float | None = None,
                 on_stuck: Callable[[str], None] | None = None, stall_step: int | None = None):
        self.runner = runner
        # Overlapped steps (module docstring): needs a runner that can dispatch a step and
        # return before its outputs reach the host.
        self.overlap = bool(overlap) and callable(getattr(runner, "dispatch_step", None))
        # (StepPlan, the runner's pending step, its step_key, when it started): outputs not read
        self._inflight = None
        self.metrics = metrics or NullMetrics()
        self.scheduler = PagedScheduler(runner.info, max_waiting)
        if callable(getattr(runner, "image_ready", None)):
            # Pieces wait for their images' features, which the engine encodes a bounded
            # piece per step (serving/image_encoder.py) instead of whole inside one step.
            self.scheduler.image_ready = runner.image_ready
            # ... and an image's soft tokens are written a layer at a time between steps
            # while other sequences run (serving/image_spans.py).
            if callable(getattr(runner, "advance_spans", None)):
                self.scheduler.stage_spans = True
                self.scheduler.span_written = runner.span_written
        self.outputs = OutputProcessor(runner.tokenizer, runner.info, self.metrics)
        self.admission_wait = admission_wait
        self._freed = 0  # running sequences ended by the last step
        self._ids = itertools.count(1)
        # Guards the scheduler's waiting queue and the flags below between consumer threads and the
        # engine thread (the running set is the engine thread's alone; other threads only read it).
        self._lock = threading.Condition()
        self._cancelled: set[int] = set()
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self._stuck: str | None = None  # why the engine stopped for good
        self.on_stuck = on_stuck
        self._calls = 0  # engine calls made (the stall hook counts them)
        self._stall_step = stall_step
        self._watchdog: Watchdog | None = None
        if step_timeout is not None:
            self._limits = StepLimits(step_timeout, compile_timeout or step_timeout)
            self._watchdog = Watchdog(self._on_stuck, name="engine-watchdog")

    # ---- consumer side (any thread) ----

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raises InvalidParameter when a prompt (plus its max_tokens) does not fit the context."""
        self.scheduler.check(prompt_len, max_tokens)

    def submit(self, requests: list[tuple[list[int], SamplingParams, Sink]],
               prompt_logprobs: bool = False) -> list[int]:
        """Queues sequences (all or none) and returns their ids. A request may carry a fourth
        item, its images (sequence.SeqImage). Raises QueueFull, ShuttingDown or
        InvalidParameter (prompt too long for the context, a bias towards a token the model
        never generates)."""
        never = self.runner.info.never_generate
        for _, params, *_ in requests:
            check_generable(params, never)
        now = time.perf_counter()
        seqs = [(Sequence(id=next(self._ids), prompt=list(prompt), params=params,
                          seed=params.seed32(random.getrandbits(32)),
                          want_prompt_logprobs=prompt_logprobs,
                          images=tuple(images[0]) if images else ()), sink)
                for prompt, params, sink, *images in requests]
        with self._lock:
            if self._stuck is not None:
                raise EngineStuck(self._stuck)
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            self.scheduler.add([s for s, _ in seqs])
            for s, sink in seqs:
                self.outputs.add(s, sink, now)
            self._lock.notify_all()
        return [s.id for s, _ in seqs]

    def cancel(self, seq_ids) -> None:
        """Frees the sequences' pages before the next step (no further events after "abort")."""
        with self._lock:
            self._cancelled.update(seq_ids)
            self._lock.notify_all()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def kv_usage(self) -> float:
        return self.scheduler.kv_usage()

    @property
    def stuck(self) -> str | None:
        """Why the engine stopped for good (a step got stuck), None while it runs."""
        return self._stuck

    def busy_with(self) -> str | None:
        """The engine call running now and for how long, as the watchdog sees it (None: none)."""
        now = self._watchdog.current() if self._watchdog is not None else None
        return None if now is None else f"a {now[0]}, running for {now[1]:.1f}s"

    # ---- lifecycle ----

    def start(self) -> "EngineCore":
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def shutdown(self, drain_timeout: float = 0.0, join_timeout: float | None = None) -> bool:
        """Stops accepting; lets running and waiting sequences finish for up to `drain_timeout`
        seconds, then aborts the rest and joins the engine thread: for up to `join_timeout`
        seconds (None: as long as it takes), never once a step is stuck (it may never return).
        Returns whether the engine thread ended."""
        self.stop_accepting()
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline and (self.num_waiting or self.num_running) and self._stuck is None:
            time.sleep(0.02)
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is None:
            return True
        deadline = None if join_timeout is None else time.monotonic() + join_timeout
        while self._thread.is_alive() and self._stuck is None and (deadline is None or time.monotonic() < deadline):
            self._thread.join(0.05)
        if self._thread.is_alive():
            return False
        if self._watchdog is not None:
            self._watchdog.close()
        return True

    # ---- engine thread ----

    def _run(self) -> None:
        try:
            self._loop()
        except StepStuck as e:
            log.error("the stuck %s returned after the watchdog gave up on it; the engine stays "
                      "stopped (its state may be inconsistent): restart the server", e)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stop or self.num_waiting or self._cancelled or self.num_running
                           or self._inflight is not None):
                    self._lock.wait()
                self._await_replacements()
                if self._stop:
                    break
                cancelled, self._cancelled = self._cancelled, set()
                dropped = self.scheduler.abort(cancelled)
                plan = self.scheduler.schedule()
            try:
                self._publish(self.outputs.finish(dropped, "abort", None, time.perf_counter()))
                self._execute(plan)
            except Exception as e:  # an engine failure must not kill the thread
                log.exception("engine step failed")
                self._fail_running(f"engine error: {type(e).__name__}: {e}")
            self.metrics.on_state(self.num_running, self.num_waiting, self.kv_usage())
        try:
            self._drain()
        except Exception:
            log.exception("engine step failed")
            self._inflight = None
        with self._lock:
            dropped = self.scheduler.abort_all()
        self._publish(self.outputs.finish(dropped, "abort", "the server is shutting down", time.perf_counter()))

    def _await_replacements(self) -> None:
        """After a step that ended running sequences, wait up to `admission_wait` seconds (lock
        held) for requests to take their places before starting the next step.

        A client that sends its next request as soon as the last one finished (a chat turn, a
        batch job, a benchmark stream) otherwise arrives just after the next step began and
        waits for all of it before its prompt runs: its time to first token grows by a whole
        step. The running streams pay the wait only on steps after a finish."""
        freed, self._freed = self._freed, 0
        if not (freed and self.admission_wait > 0 and self.num_running):
            return
        deadline = time.monotonic() + self.admission_wait
        while self.num_waiting < freed and not self._stop and not self._cancelled:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._lock.wait(left)

    def _execute(self, plan: StepPlan) -> None:
        """One ragged step: every piece of the plan in one program (two in deterministic
        mode), then the image work between steps."""
        from serving.paged_steps import step_inputs

        for queried, hit in plan.lookups:
            self.metrics.on_prefix_cache(queried, hit)
        pool = self.scheduler.kv.global_pool or self.scheduler.kv.local_pool
        self.metrics.on_prefix_blocks(pool.num_cached, pool.num_pages - 1)
        if plan.preempted:
            log.info("preempted %d sequence(s) for KV-cache pages; they will recompute",
                     len(plan.preempted))
        prev = self._inflight
        if prev is not None and any(p.seq.params.needs_extras for p in plan.pieces):
            # Logits processing reads the last tokens on the host: wait for them, and drop
            # the pieces of sequences that the step in flight ended.
            self._drain()
            prev = None
            plan = dataclasses.replace(plan, pieces=tuple(
                p for p in plan.pieces if self.outputs.is_live(p.seq.id)))
        if plan.pieces:
            t0 = time.perf_counter()
            prev_rows = None if prev is None else {
                p.seq.id: row for row, p in enumerate(prev[0].pieces) if p.sample}
            inputs = step_inputs(plan, self.scheduler.kv, self.runner.info, self._extras,
                                 prev_rows)
            key = step_key("ragged", inputs, feed=inputs.feed is not None)
            if self.overlap:
                pending = self._call(key, lambda: self.runner.dispatch_step(
                    inputs, None if prev is None else prev[1]))
            else:
                out = self._call(key, lambda: self.runner.run_step(inputs))
                pending = _Ready(out)
            self._drain()  # the step in flight's outputs, while the device runs this one
            self._inflight = (plan, pending, key, t0)
            if not self.overlap:
                self._drain()
        else:
            self._drain()
        # After the step's tokens went out, so the streams do not wait for it: image spans
        # being written, then the encoder, sharing one budget. A step that ran nothing has
        # nothing to stall: both may then run whole.
        bounded, spent = bool(plan.pieces), 0.0
        if plan.spans:
            spent = self._call(step_key("spans", spans=len(plan.spans), bounded=bounded),
                               lambda: self.runner.advance_spans(plan.spans, self.scheduler.kv,
                                                                 bounded))
        if plan.encode:
            self._call(step_key("encode", images=len(plan.encode), bounded=bounded),
                       lambda: self.runner.advance_images(plan.encode, bounded, spent))

    def _drain(self) -> None:
        """Waits for the step in flight, if any, and processes its outputs (rows of sequences
        that ended meanwhile are dropped by the output processor)."""
        if self._inflight is None:
            return
        plan, pending, key, started = self._inflight
        self._inflight = None
        out = self._call(key, pending.result, count=False)
        self._publish(self.outputs.on_step(plan, out, started, time.perf_counter()))

    def _extras(self, seqs) -> LogitsExtras | None:
        """The logits processing of a step's rows (penalties, bias, grammar masks), None if none."""
        return step_extras(seqs, self.outputs.structured, self.runner.info.eos_ids)

    def _publish(self, events: list[Emitted]) -> None:
        """Frees the pages of the sequences that ended, then delivers the events (so that a
        consumer woken by a last event sees them free). Counts the running sequences that
        ended, aborted ones included (the scheduler took those out already; `finish` is
        idempotent)."""
        for e in events:
            if e.event.finish_reason is not None and (self.scheduler.finish(e.seq) or e.seq.generated):
                self._freed += 1
        self.outputs.deliver(events)

    def _fail_running(self, message: str) -> None:
        """After an engine error the cache may be lost: every running sequence fails."""
        self._inflight = None
        with self._lock:
            failed = self.scheduler.abort_running()
        self._publish(self.outputs.finish(failed, "error", message, time.perf_counter()))
        with self._lock:
            self.scheduler.reset_prefix_cache()
        reset = getattr(self.runner, "reset", None)
        if reset is not None:
            try:
                self._call(step_key("reset"), reset)
            except Exception:
                log.exception("engine reset failed")

    def _call(self, key: tuple, run: Callable[[], object], count: bool = True):
        """run() (an engine call, or a wait for one: count=False) under the watchdog, limited by
        its kind and shapes (`key`). Raises StepStuck if the watchdog declared it stuck first."""
        stall = False
        if count:
            self._calls += 1
            stall = self._calls == self._stall_step
        dog = self._watchdog
        if dog is None:
            if stall:
                _stall_forever(self._calls, key)
            return run()
        dog.arm(describe(key), self._limits.limit(key))
        try:
            if stall:
                _stall_forever(self._calls, key)
            out = run()
        except BaseException:
            if not dog.disarm():
                raise StepStuck(describe(key))
            raise
        if not dog.disarm():
            raise StepStuck(describe(key))
        self._limits.done(key)
        return out

    def _on_stuck(self, what: str, limit: float) -> None:
        """The watchdog's action (on its thread; the engine thread is blocked and may never
        return): stop for good, fail every sequence, tell `on_stuck`."""
        message = (f"the engine is stuck: a {what} did not finish within {limit:g}s "
                   "(--step-timeout / --compile-timeout); the server must be restarted")
        with self._lock:
            self._accepting = False
            self._stuck = message
            failed = self.scheduler.abort_all()
            self._lock.notify_all()
        log.error("%s. Failing %d sequence(s) in flight; new requests are refused.", message, len(failed))
        if self.on_stuck is not None:
            try:
                self.on_stuck(message)
            except Exception:
                log.exception("on_stuck failed")
        self.outputs.deliver(self.outputs.finish(failed, "error", message, time.perf_counter()))


class _Ready:
    """A step's outputs already on the host, as a dispatched step's (`result()`)."""

    def __init__(self, out):
        self._out = out

    def result(self):
        return self._out


def _stall_forever(n: int, key: tuple) -> None:
    """The test hook (`stall_step`): this engine call never returns, as if wedged in the runtime."""
    log.warning("test hook: engine call %d (%s) blocks forever", n, describe(key))
    threading.Event().wait()
