"""The orchestrator: a bounded waiting queue, continuous batching over the engine's slots, and the
thread that owns the engine. Consumers (the HTTP layer, the CLI) submit sequences and receive
`Event`s through a callback, called on the engine thread (it must not block).

Policy, between two decode steps: cancelled sequences leave first (their slots are free at once),
then waiting sequences are prefilled into free slots, oldest first, in groups that share a prefill
bucket (a group is one prefill call); then one decode step advances every running sequence by a
token. Prefill before decode keeps the time to first token low at the cost of one longer gap for
the running streams (vLLM's default policy without chunked prefill).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import threading
import time
from typing import Callable

import numpy as np

from serving.detokenize import TextStream
from serving.engine import DecodeInputs, Engine, StepOutputs, pad_prefill_batch
from serving.sampling import InvalidParameter, SamplingParams, SlotSampling

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """Too many waiting sequences; the caller should retry later."""


class ShuttingDown(RuntimeError):
    """The scheduler no longer accepts work."""


@dataclasses.dataclass(frozen=True)
class TokenInfo:
    id: int
    logprob: float | None = None  # None unless logprobs were requested
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Event:
    """New output of one sequence. The last event of a sequence has `finish_reason` set:
    "stop" (EOS, a stop token or string), "length" (max_tokens or the context), "abort"
    (cancelled, or the server is stopping) or "error" (`error` says why)."""

    text: str
    tokens: tuple[TokenInfo, ...]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_generated: int = 0
    # First event only, when prompt logprobs were requested: one entry per prompt token after the
    # first (the first token has no context to be scored in).
    prompt_logprobs: tuple[TokenInfo, ...] | None = None
    error: str | None = None


@dataclasses.dataclass(eq=False)
class Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    seed: int
    want_prompt_logprobs: bool
    stream: TextStream
    arrival: float
    slot: int = -1
    generated: list[int] = dataclasses.field(default_factory=list)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False

    @property
    def length(self) -> int:
        """Tokens of this sequence held in (or about to enter) its cache row."""
        return len(self.prompt) + len(self.generated)


class NullMetrics:
    """The observer interface the scheduler reports to (see serving.metrics.Metrics)."""

    def on_scheduled(self, seq: Sequence, queue_time: float) -> None: ...

    def on_prefill(self, seqs: list[Sequence], seconds: float, bucket: int = 0, batch: int = 0) -> None: ...

    def on_token(self, seq: Sequence, now: float) -> None: ...

    def on_finish(self, seq: Sequence, reason: str, now: float) -> None: ...

    def on_state(self, running: int, waiting: int, kv_usage: float) -> None: ...

    def on_decode(self, rows: int, busy: int) -> None: ...

    def on_move(self) -> None: ...


class Scheduler:
    def __init__(self, engine: Engine, max_waiting: int = 256, metrics=None, admission_wait: float = 0.0):
        self.engine = engine
        self.info = engine.info
        self.max_waiting = max_waiting
        self.admission_wait = admission_wait
        self._freed = 0  # slots freed by the last step
        self.metrics = metrics or NullMetrics()
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._cancelled: set[int] = set()
        self._slots: list[Sequence | None] = [None] * self.info.num_slots
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self._eos = set(self.info.eos_ids)

    # ---- consumer side (any thread) ----

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raises InvalidParameter when a prompt (plus its max_tokens) does not fit the context."""
        limit = self.info.max_seq_len
        if prompt_len < 1:
            raise InvalidParameter("prompt", "the prompt is empty")
        if prompt_len >= limit:
            raise InvalidParameter(
                "prompt", f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_len} tokens (at most {limit - 1} leave room for one generated token).")
        if prompt_len + max_tokens > limit:
            raise InvalidParameter(
                "max_tokens", f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                f"in the completion). Please reduce the prompt or max_tokens.")

    def submit(self, requests: list[tuple[list[int], SamplingParams, Callable[[Event], None]]],
               prompt_logprobs: bool = False) -> list[int]:
        """Queues sequences (all or none) and returns their ids. Raises QueueFull, ShuttingDown or
        InvalidParameter (prompt too long for the context)."""
        now = time.perf_counter()
        seqs = []
        for prompt, params, sink in requests:
            self.check(len(prompt), params.max_tokens)
            seqs.append(Sequence(
                id=next(self._ids), prompt=list(prompt), params=params, sink=sink,
                seed=params.seed32(random.getrandbits(32)), want_prompt_logprobs=prompt_logprobs,
                stream=TextStream(self.engine.tokenizer, params.stop), arrival=now))
        with self._lock:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) + len(seqs) > self.max_waiting:
                raise QueueFull(f"too many waiting requests ({len(self._waiting)} waiting, limit "
                                f"{self.max_waiting}); retry later")
            self._waiting.extend(seqs)
            self._lock.notify_all()
        return [s.id for s in seqs]

    def cancel(self, seq_ids) -> None:
        """Frees the sequences' slots before the next step (no further events after "abort")."""
        with self._lock:
            self._cancelled.update(seq_ids)
            self._lock.notify_all()

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def kv_usage(self) -> float:
        used = sum(s.length for s in self._slots if s is not None)
        return used / (self.info.num_slots * self.info.max_seq_len)

    # ---- lifecycle ----

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stops accepting; lets running and waiting sequences finish for up to `drain_timeout`
        seconds, then aborts the rest and joins the engine thread."""
        self.stop_accepting()
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline and (self._waiting or self.num_running):
            time.sleep(0.02)
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ---- engine thread ----

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._stop or self._waiting or self._cancelled or self.num_running):
                    self._lock.wait()
                self._await_replacements()
                if self._stop:
                    break
                cancelled, self._cancelled = self._cancelled, set()
            try:
                self._drop(cancelled)
                self._admit()
                self._pack()
                if self.num_running:
                    self._decode()
            except Exception as e:  # an engine failure must not kill the thread
                log.exception("engine step failed")
                self._fail_all(f"engine error: {type(e).__name__}: {e}")
            self.metrics.on_state(self.num_running, self.num_waiting, self.kv_usage())
        self._abort_everything()

    def _await_replacements(self) -> None:
        """After a step that freed slots, wait up to `admission_wait` seconds (lock held) for
        requests to take them before starting the next decode step.

        A client that sends its next request as soon as the last one finished (a chat turn, a
        batch job, a benchmark stream) otherwise arrives just after the next decode step began and
        waits for all of it before its prefill: its time to first token grows by a whole decode
        step. The running streams pay the wait only on steps after a finish."""
        freed, self._freed = self._freed, 0
        if not (freed and self.admission_wait > 0 and self.num_running):
            return
        deadline = time.monotonic() + self.admission_wait
        while len(self._waiting) < freed and not self._stop and not self._cancelled:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._lock.wait(left)

    def _drop(self, cancelled: set[int]) -> None:
        if not cancelled:
            return
        now = time.perf_counter()
        with self._lock:
            keep = [s for s in self._waiting if s.id not in cancelled]
            dropped = [s for s in self._waiting if s.id in cancelled]
            self._waiting = collections.deque(keep)
        dropped += [s for s in self._slots if s is not None and s.id in cancelled]
        for s in dropped:
            self._finish(s, "abort", "", now)

    def _admit(self) -> None:
        while True:
            free = [i for i, s in enumerate(self._slots) if s is None]
            with self._lock:
                if not free or not self._waiting:
                    return
                group = self._take_group(len(free))
            self._prefill(group, free)

    def _take_group(self, free: int) -> list[Sequence]:
        """The oldest waiting sequences that can share one prefill call (lock held): short prompts
        (buckets up to `batched_prefill_max_bucket`) go together, padded to the longest one's
        bucket: a small batch costs less than its prompts one by one (on a 2-core CPU, two
        32-token prompts take ~1.4x the time of one). Long prompts go alone."""
        head = self._waiting[0]
        short = self.info.batched_prefill_max_bucket
        if head.want_prompt_logprobs or self.engine.bucket_for(len(head.prompt)) > short:
            return [self._waiting.popleft()]
        limit = min(free, max(self.info.prefill_batch_sizes))
        group = []
        while self._waiting and len(group) < limit:
            s = self._waiting[0]
            if s.want_prompt_logprobs or self.engine.bucket_for(len(s.prompt)) > short:
                break
            group.append(self._waiting.popleft())
        return group

    def _prefill(self, group: list[Sequence], free: list[int]) -> None:
        now = time.perf_counter()
        for s, slot in zip(group, free):
            s.slot, s.scheduled_at = slot, now
            self._slots[slot] = s
            self.metrics.on_scheduled(s, now - s.arrival)
        bucket = self.engine.bucket_for(max(len(s.prompt) for s in group))
        batch = min(b for b in self.info.batch_sizes_for(bucket) if b >= len(group))
        rows = [(s.prompt, s.slot, SlotSampling.of([s.params], [s.seed])) for s in group]
        inputs = pad_prefill_batch(rows, bucket, batch)
        if group[0].want_prompt_logprobs:
            inputs = inputs._replace(prompt_logprobs=True)
        t0 = time.perf_counter()
        out = self.engine.run_prefill(inputs)
        now = time.perf_counter()
        self.metrics.on_prefill(group, now - t0, bucket, batch)
        log.debug("prefill of %d prompt(s), lengths %s, in bucket %d x%d: %.3fs", len(group),
                  [len(s.prompt) for s in group], bucket, batch, now - t0)
        for row, s in enumerate(group):
            prompt_lps = _prompt_logprobs(out, row, s) if s.want_prompt_logprobs else None
            self._on_token(s, out, row, now, prompt_lps)

    def _pack(self) -> None:
        """Move sequences from high slots into free low ones when that lets decode run a smaller
        program (the engine's decode batch sizes): e.g. two sequences left in slots 0 and 7 of 8
        decode as 2 rows instead of 8. A move copies one slot's KV cache rows on the device."""
        busy = [i for i, s in enumerate(self._slots) if s is not None]
        if not busy:
            return
        rows = self.info.decode_rows_for(len(busy))
        if self.info.decode_rows_for(busy[-1] + 1) <= rows:
            return
        free = [i for i in range(rows) if self._slots[i] is None]
        for src, dst in zip(reversed([i for i in busy if i >= rows]), free):
            self.engine.move_slot(src, dst)
            self.metrics.on_move()
            s = self._slots[src]
            self._slots[dst], self._slots[src], s.slot = s, None, dst

    def _decode(self) -> None:
        # Only the slots up to the last busy one decode (free slots are taken lowest first, so
        # with few sequences this is a short prefix and the step is cheaper).
        n = 1 + max(i for i, s in enumerate(self._slots) if s is not None)
        tokens = np.zeros(n, np.int32)
        positions = np.zeros(n, np.int32)
        params, seeds = [], []
        for i, s in enumerate(self._slots[:n]):
            if s is None:
                params.append(_IDLE)
                seeds.append(0)
                continue
            tokens[i] = s.generated[-1]
            positions[i] = s.length - 1
            params.append(s.params)
            seeds.append(s.seed)
        self.metrics.on_decode(self.info.decode_rows_for(n), self.num_running)
        out = self.engine.run_decode(DecodeInputs(tokens, positions, SlotSampling.of(params, seeds)))
        now = time.perf_counter()
        for i, s in enumerate(self._slots):
            if s is not None:
                self._on_token(s, out, i, now, None)

    def _on_token(self, s: Sequence, out: StepOutputs, row: int, now: float, prompt_lps) -> None:
        tok = int(out.tokens[row])
        s.generated.append(tok)
        if s.first_token_at is None:
            s.first_token_at = now
        self.metrics.on_token(s, now)
        s.last_token_at = now
        info = (_token_info(out, row, tok, s.params.logprobs),)
        p = s.params
        reason = None
        if (tok in self._eos and not p.ignore_eos) or tok in p.stop_token_ids:
            # The stop token counts as generated but is part of neither the text nor the logprobs.
            text, info = s.stream.finish(), ()
            reason = "stop"
        else:
            text, stopped = s.stream.add(tok)
            if stopped:
                reason = "stop"
            elif len(s.generated) >= p.max_tokens or s.length >= self.info.max_seq_len:
                text += s.stream.finish()
                reason = "length"
        event = Event(text=text, tokens=info, finish_reason=reason, num_prompt_tokens=len(s.prompt),
                      num_generated=len(s.generated), prompt_logprobs=prompt_lps)
        if reason is None:
            _deliver(s, event)
        else:
            self._release(s)
            self.metrics.on_finish(s, reason, now)
            _deliver(s, event)
            s.finished = True

    def _finish(self, s: Sequence, reason: str, error: str | None, now: float) -> None:
        if s.finished:
            return
        self._release(s)
        s.finished = True
        self.metrics.on_finish(s, reason, now)
        _deliver(s, Event(text="", tokens=(), finish_reason=reason, num_prompt_tokens=len(s.prompt),
                          num_generated=len(s.generated), error=error or None))

    def _release(self, s: Sequence) -> None:
        if 0 <= s.slot < len(self._slots) and self._slots[s.slot] is s:
            self._slots[s.slot] = None
            self._freed += 1

    def _fail_all(self, message: str) -> None:
        """After an engine error the cache may be lost: every running sequence fails."""
        now = time.perf_counter()
        for s in [s for s in self._slots if s is not None]:
            self._finish(s, "error", message, now)
        reset = getattr(self.engine, "reset", None)
        if reset is not None:
            try:
                reset()
            except Exception:
                log.exception("engine reset failed")

    def _abort_everything(self) -> None:
        now = time.perf_counter()
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for s in waiting + [s for s in self._slots if s is not None]:
            self._finish(s, "abort", "the server is shutting down", now)


_IDLE = SamplingParams(max_tokens=1, temperature=0.0)


def _deliver(s: Sequence, event: Event) -> None:
    try:
        s.sink(event)
    except Exception:  # a consumer that went away must not stop the engine
        log.exception("delivering an event for sequence %d failed", s.id)


def _token_info(out: StepOutputs, row: int, tok: int, n_top: int | None) -> TokenInfo:
    if n_top is None:
        return TokenInfo(tok)
    top = tuple((int(i), float(v)) for i, v in zip(out.top_ids[row, :n_top], out.top_logprobs[row, :n_top]))
    return TokenInfo(tok, float(out.logprobs[row]), top)


def _prompt_logprobs(out: StepOutputs, row: int, s: Sequence) -> tuple[TokenInfo, ...]:
    n_top = s.params.logprobs or 0
    res = []
    for t in range(len(s.prompt) - 1):
        top = tuple((int(i), float(v)) for i, v in
                    zip(out.prompt_top_ids[row, t, :n_top], out.prompt_top_logprobs[row, t, :n_top]))
        res.append(TokenInfo(s.prompt[t + 1], float(out.prompt_logprobs[row, t]), top))
    return tuple(res)
