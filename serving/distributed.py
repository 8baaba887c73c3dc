"""Multi-host serving on JAX's distributed runtime: one process per host, one mesh over all of them.

Every process must run the same programs in the same order, so process 0 alone serves HTTP and
schedules, and broadcasts each step's inputs (one fixed-size int32 array, serving/wire.py) to the
others, which replay it. Idle, it sends heartbeats; any failed or stuck step ends the process. See
docs/engine.md, "In a multi-process group"."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable

import numpy as np

from serving import watchdog
from serving.group_steps import (ENCODE, FEATURES, IDLE, RAGGED, RESET, SHUTDOWN, SPANS,
                                  KIND_NAMES, broadcasts, decode_step, encode_step, step_capacity)
from jax_platform import GroupFormationError, ProcessGroup, exit_group_not_formed
from serving.watchdog import StepLimits, describe, step_key

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 3  # exit status when the process group breaks


# The group's settings and how a process joins it are process set-up, shared with eval:
# `jax_platform` (ProcessGroup, add_group_arguments, group_from, join_process_group).

def _key(kind: int, inputs) -> tuple:
    """A step's watchdog key (`watchdog.step_key`; image work says what decides its programs)."""
    watch = getattr(inputs, "watch", None)
    return step_key(KIND_NAMES[kind], inputs, **(watch() if watch is not None else {}))


def _run(runner, kind: int, inputs):
    """Runs a received step on the local engine, as process 0 ran it on its own (a ragged
    step of the overlapped loop: `Follower`)."""
    if kind == RESET:
        return runner.reset()
    return runner.run_step(inputs) if kind == RAGGED else None


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

    def __call__(self, buf: np.ndarray | int | None) -> np.ndarray:
        """Process 0's words to every process; the others pass None (a step broadcast) or the
        size they expect (a piece of features)."""
        if buf is None or isinstance(buf, int):
            buf = np.zeros(self.capacity if buf is None else buf, np.int32)
        return np.asarray(self._bcast(buf))


class LeaderRunner:
    """Process 0's model runner: the engine core drives it exactly like the local runner it
    wraps; each step is broadcast to the other processes first. Idle heartbeats keep the
    workers' watchdogs quiet.

    Its steps are also dispatched without waiting (`dispatch_step`), so that the
    engine core runs its overlapped loop in a group too: step N+1 is broadcast and dispatched
    before step N's tokens reach the host, and the rows it takes from step N's sampled tokens
    on the device travel as indices (`StepInputs.feed`), which every worker resolves against
    its own device's tokens of step N (`Follower`).

    Images (serving/group_images.py): the encoder runs here alone, between steps, under an
    ENCODE step; each image's features go to the others in a FEATURES step before any step
    names it; image spans' stages run everywhere, each `advance_spans` a SPANS step.

    broadcast(words) -> words: how a step, or a piece of features, reaches the others
    (default: jax's broadcast from process 0); exit(status): how a broken group ends this
    process (default: at once)."""

    watches_steps = True  # its watchdog ends the group: the engine core needs none of its own

    def __init__(self, runner, settings: ProcessGroup,
                 broadcast: Callable[[np.ndarray], np.ndarray] | None = None,
                 exit: Callable[[int], None] = os._exit):
        self.runner = runner
        self.info = runner.info
        self.tokenizer = runner.tokenizer
        self.settings = settings
        self.capacity = step_capacity(self.info)
        self._bcast = broadcast or _Broadcaster(self.capacity)
        self._exit = exit
        # One step at a time: broadcasts must keep their order. A wait for a dispatched step's
        # outputs holds it too, so that the heartbeat never re-arms the watchdog under it.
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = False
        self._watchdog = Watchdog(settings.step_timeout_s, "running a step on process 0", exit)
        self._limits = StepLimits(settings.step_timeout_s, settings.compile_timeout_s)
        self._peer_limit = self._limits.compile_s  # the others may still run the last step this long
        self._stop = threading.Event()
        self._images = None  # group_images.LeaderImages, made with the first image work
        self._heartbeat = threading.Thread(target=self._beat, name="step-heartbeat", daemon=True)
        self._heartbeat.start()

    @property
    def model(self):
        return self.runner.model

    def run_step(self, inputs):
        with self._lock:
            self._share(inputs.images)
            return self._step(RAGGED, inputs)

    def dispatch_step(self, inputs, prev: "_InFlight | None" = None) -> "_InFlight":
        """The overlapped loop's ragged step (the class docstring): broadcast, then dispatched
        here fed from `prev`, the step still in flight; returns before its outputs reach the
        host. Its `result()` waits under the group's watchdog: a peer lost mid-step ends the
        group as a lost peer does in `run_step`."""
        with self._lock:
            self._share(inputs.images)
            # Dispatching compiles a shape's programs the first time it runs.
            key, limit, pending = self._watched(
                RAGGED, inputs, "dispatching",
                lambda: self.runner.dispatch_step(inputs, None if prev is None else prev.pending))
            self._peer_limit = limit  # the others may run it that long before the next broadcast
            return _InFlight(self, pending, key, limit)

    def reset(self) -> None:
        with self._lock:
            self._step(RESET, None)

    # ---- images (serving/group_images.py) ----

    def image_features(self, image):
        """An image's features here, the others sent them too (the engine reads them in steps;
        chat_images checks that an engine has this)."""
        with self._lock:
            self._share([image])
            return self.runner.image_features(image)

    @property
    def images_encoded(self) -> int:
        return self.runner.images_encoded

    def image_ready(self, key: str) -> bool:
        return self.runner.image_ready(key)

    def span_written(self, job) -> bool:
        return self.runner.span_written(job)

    def advance_images(self, wanted, bounded: bool = True, spent: float = 0.0) -> float:
        """Process 0's encoder work between steps (the others wait through an ENCODE step),
        then the features it finished, sent to the others."""
        from serving.group_images import EncodeWork

        with self._lock:
            self._image_work()
            flops = self._step(ENCODE, EncodeWork(len(wanted), bounded),
                               lambda: self.runner.advance_images(wanted, bounded, spent))
            self._share(())
            return flops

    def advance_spans(self, jobs, kv, bounded: bool = True) -> float:
        """Image spans' stages between steps, run by every process (a SPANS step)."""
        with self._lock:
            self._share([job.image for job in jobs])
            work = self._image_work().span_work(jobs, kv, bounded)
            return self._step(SPANS, work,
                              lambda: self.runner.advance_spans(jobs, kv, bounded))

    def _image_work(self):
        if self._images is None:
            from serving.group_images import LeaderImages

            self._images = LeaderImages(self.runner)
        return self._images

    def _share(self, images) -> None:
        """(The lock held.) Before a step that names `images`: the features the others lack
        (and any process 0 stored since it last sent), each in a FEATURES step; then the step
        names them (`group_images.SharedFeatures`)."""
        if not images and self._images is None:
            return
        group = self._image_work()
        missing = group.missing(images)
        if missing:  # process 0's cache dropped them: encoded again, as one process would
            from serving.group_images import EncodeWork

            self._step(ENCODE, EncodeWork(len(missing), False),
                       lambda: [self.runner.image_features(im) for im in missing])
        for header, words in group.to_send(images):
            self._step(FEATURES, header, lambda: self._send_pieces(words))
        if images:
            group.shared.name(im.key for im in images)

    def _send_pieces(self, words: np.ndarray) -> None:
        from serving.group_images import piece_words

        size = piece_words(self.runner.model)
        for i in range(0, len(words), size):
            piece = np.zeros(size, np.int32)
            piece[:len(words[i:i + size])] = words[i:i + size]
            self._bcast(piece)

    def close(self) -> None:
        """Ends the workers' loops (they exit 0) and stops the heartbeat."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._send(SHUTDOWN, None)
            self._closed = True
        self._watchdog.close()

    def _step(self, kind: int, inputs, call: Callable[[], object] | None = None):
        """(The lock held.) Sends the step, then runs it here exactly as the workers do
        (`_run`, or `call`)."""
        key, limit, out = self._watched(kind, inputs, "running",
                                        call or (lambda: _run(self.runner, kind, inputs)))
        self._limits.done(key)
        self._peer_limit = limit
        return out

    def _watched(self, kind: int, inputs, verb: str, call):
        """Sends the step, then `call()`s it here under the watchdog (the lock held): returns
        (its step key, its time limit, what the call returned)."""
        if self._closed:
            raise RuntimeError("the process group has shut down")
        self._send(kind, inputs)
        key = _key(kind, inputs)
        limit = self._limits.limit(key)
        # The workers ran (or failed) the same step; nothing keeps the group in step now.
        return key, limit, self._guarded(f"{verb} a {describe(key)} on process 0", limit,
                                         f"{KIND_NAMES[kind]} step failed", call)

    def _guarded(self, what: str, limit: float, failure: str, call):
        """call() under the group's watchdog (`what`, at most `limit` seconds); an error in it
        ends the group (`failure` says what failed)."""
        self._watchdog.arm(what, limit)
        try:
            return call()
        except Exception as e:
            fatal(f"{failure}: {type(e).__name__}: {e}", self._exit)
            raise
        finally:
            self._watchdog.disarm()

    def _send(self, kind: int, inputs) -> None:
        words = encode_step(kind, inputs, self.capacity)
        # Every process must join the broadcast: the others may still be running the last step.
        name = KIND_NAMES[kind]
        self._guarded(f"broadcasting the {name} step",
                      max(self._peer_limit, self._limits.limit("broadcast")),
                      f"broadcasting the {name} step failed (a process has died?)",
                      lambda: [self._bcast(words[i:i + self.capacity])
                               for i in range(0, len(words), self.capacity)])
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


class _InFlight:
    """A ragged step process 0 dispatched (`LeaderRunner.dispatch_step`): its sampled tokens on
    the device (`tokens`, to feed the next step) and its outputs on `result()`, waited for
    under the group's watchdog."""

    def __init__(self, leader: LeaderRunner, pending, key: tuple, limit: float):
        self.leader, self.pending, self.key, self.limit = leader, pending, key, limit
        self.tokens = pending.tokens

    def result(self):
        leader = self.leader
        with leader._lock:
            out = leader._guarded(f"running a {describe(self.key)} on process 0", self.limit,
                                  "ragged step failed", self.pending.result)
            leader._limits.done(self.key)
        return out


class Follower:
    """A worker's runner as process 0 drives it: runs each received step as process 0 ran it.

    Ragged steps are dispatched as process 0 dispatches them in the overlapped loop: a step's
    rows marked in `StepInputs.feed` take this process's own sampled tokens of the ragged step
    before, still on its device. Those equal process 0's: every process samples the same
    gathered logits with the same temperatures, seeds and positions (they travel bit for bit),
    and a fed row never has logits processing (which stays on process 0): the engine core
    drains the step in flight before a step with such a row instead of feeding it. After
    dispatching step N+1 it reads step N's outputs back, as process 0 does, so that at most two
    steps are in flight and the dispatch window (serving/dispatch_window.py) sees them finish.

    Images (serving/group_images.py): an ENCODE step runs nothing here; a FEATURES step's
    pieces are received and kept; a ragged step's images and a SPANS step's spans are read
    from them. receive(n) -> int32 [n]: the next broadcast of n words (process 0's)."""

    def __init__(self, runner, receive: Callable[[int], np.ndarray] | None = None):
        self.runner = runner
        self.receive = receive
        self._in_flight = None  # the last ragged step's PendingStep
        self.ragged = self.fed = 0  # ragged steps run; of them fed from the step before
        self._images = None  # group_images.FollowerImages, made with the first image work
        self.features_received = 0  # images whose features process 0 sent

    def image_summary(self) -> str:
        if self._images is None:
            return "no image work"
        return (f"features of {self.features_received} images received, "
                f"{self.runner.spans.stages_run} image span stages run, "
                f"{self.runner.images_encoded} images encoded")

    def next_step(self, capacity: int) -> tuple[int, object]:
        """The next step process 0 sends, in as many broadcasts of `capacity` words as it takes."""
        first = self.receive(capacity)
        rest = [self.receive(capacity) for _ in range(broadcasts(first) - 1)]
        return decode_step(np.concatenate([first, *rest]) if rest else first)

    def run(self, kind: int, inputs) -> None:
        if kind in (ENCODE, FEATURES, SPANS):
            self._image_step(kind, inputs)
            return
        if kind != RAGGED:
            if kind == RESET:  # fresh pages: nothing in flight feeds a later step
                self._in_flight = None
            _run(self.runner, kind, inputs)
            return
        if inputs.images:
            self._image_step(kind, inputs)
        pending = self.runner.dispatch_step(inputs, self._in_flight)
        self.ragged += 1
        self.fed += inputs.feed is not None
        before, self._in_flight = self._in_flight, pending
        if before is not None:
            before.result()

    def _image_step(self, kind: int, inputs) -> None:
        """A step's image part: FEATURES kept, SPANS run; the images a step names named here
        as on process 0 (`group_images.SharedFeatures`)."""
        from serving.group_images import FollowerImages, piece_words

        if self._images is None:
            self._images = FollowerImages(self.runner)
        images = self._images
        if kind == FEATURES:
            size = piece_words(self.runner.model)
            words = np.concatenate([self.receive(size) for _ in range(-(-inputs.words // size))])
            images.store(inputs, words)
            self.features_received += 1
        elif kind == SPANS:
            images.shared.name(t.image.key for t in inputs.tasks)
            self.runner.advance_spans(images.spans(inputs), None, inputs.bounded)
        elif kind == RAGGED:
            images.shared.name(im.key for im in inputs.images)


def worker_loop(runner, settings: ProcessGroup) -> int:
    """A non-zero process's life after warm-up: run process 0's steps until it says shutdown."""
    info = runner.info
    capacity = step_capacity(info)
    bcast = _Broadcaster(capacity)
    dog = Watchdog(settings.step_timeout_s, "waiting for process 0's next step")
    limits = StepLimits(settings.step_timeout_s, settings.compile_timeout_s)
    wait = limits.compile_s  # process 0 may still be running the last step (or its first broadcast)
    steps = 0
    follower = Follower(runner, bcast)
    while True:
        dog.arm(timeout_s=wait)
        try:
            kind, inputs = follower.next_step(capacity)
            key = _key(kind, inputs)
            wait = limits.limit(key)
            dog.arm(f"running a {describe(key)}", wait)
            follower.run(kind, inputs)
            if kind == SHUTDOWN:
                dog.close()
                log.info("shutdown step received after %d steps (%d ragged, %d of them fed from "
                         "the step before on the device; %s)", steps, follower.ragged,
                         follower.fed, follower.image_summary())
                return 0
        except Exception as e:
            fatal(f"worker step failed (process 0 has died?): {type(e).__name__}: {e}")
            return EXIT_PEER_LOST
        limits.done(key)
        steps += kind == RAGGED


def leader_factory(settings: ProcessGroup):
    """Runtime engine factory for process 0: the usual load and warm-up, then broadcast steps."""
    from serving.runtime import load_runner

    def factory(config, progress):
        try:
            runner = load_runner(config, progress)
        except GroupFormationError as e:
            exit_group_not_formed(e)  # at once: the others' deadlines are running too
        return LeaderRunner(runner, settings)

    return factory


def run_worker(config, settings: ProcessGroup) -> int:
    """A non-zero process: load and warm up exactly as process 0 does (the same programs in the
    same order), then follow its steps. Returns the exit status."""
    from serving.runtime import load_runner

    try:
        runner = load_runner(config, lambda msg: log.info("%s", msg))
    except GroupFormationError as e:
        exit_group_not_formed(e)
    except Exception as e:
        log.exception("loading the model failed")
        print(f"error: loading the model failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    log.info("warmed up; following process 0's steps")
    return worker_loop(runner, settings)
