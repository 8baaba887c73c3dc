"""The step watchdog, one implementation for the single-process server and multi-process groups.

A step that never returns blocks its thread in native code, where no timeout reaches it, so a
`Watchdog` thread calls `on_stuck` once an armed wait outlasts its limit; the caller decides what
follows. `StepLimits` gives a step `compile_s` until its kind and shapes have run once, then
`step_s`. See docs/deployment.md, "Stuck steps"."""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Hashable


log = logging.getLogger(__name__)

# Exit status of a server that ends with its engine thread stuck (it cannot shut down cleanly).
EXIT_STUCK = 5


class StepStuck(BaseException):
    """The watchdog declared the step stuck before it returned: its results must not be used and
    its thread must leave. Not an Exception, so that the handlers that keep an engine thread
    serving after a failed step let it through."""


class Watchdog:
    """Calls `on_stuck(what, limit_s)` on its own thread when a wait armed with `arm` has not been
    disarmed within its limit (once per arming). `disarm` tells the waiting thread which came
    first: exactly one of the two owns what follows the wait."""

    def __init__(self, on_stuck: Callable[[str, float], None], timeout_s: float | None = None,
                 what: str = "a step", name: str = "step-watchdog"):
        self.on_stuck = on_stuck
        self.timeout_s = timeout_s  # the default limit of `arm`
        self.what = what
        self._cond = threading.Condition()
        self._armed: tuple[str, float, float] | None = None  # (what, since, limit)
        self._tripped = False  # the watchdog fired for the latest arming
        self._wake = math.inf  # when the watching thread wakes up next
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    def arm(self, what: str | None = None, timeout_s: float | None = None) -> None:
        """Starts watching a wait (replaces the one armed before, if any)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        if limit is None:
            raise ValueError("arm needs a limit: give timeout_s here or to the constructor")
        with self._cond:
            now = time.monotonic()
            self._armed = (what or self.what, now, limit)
            self._tripped = False
            if now + limit < self._wake:  # else the thread wakes in time and re-reads the arming
                self._cond.notify()

    def disarm(self) -> bool:
        """Stops watching; False if the watchdog fired for the wait armed last (then `on_stuck`
        owns its consequences)."""
        with self._cond:
            self._armed = None
            return not self._tripped

    @property
    def fired(self) -> bool:
        return self._tripped

    def current(self) -> tuple[str, float] | None:
        """(what, seconds armed) of the wait armed now, if any."""
        with self._cond:
            if self._armed is None:
                return None
            what, since, _ = self._armed
            return what, time.monotonic() - since

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    if self._armed is not None:
                        what, since, limit = self._armed
                        if now - since >= limit:
                            self._armed, self._tripped = None, True
                            break
                        self._wake = since + limit
                    else:
                        self._wake = math.inf
                    self._cond.wait(None if self._wake == math.inf else self._wake - now)
            try:  # outside the lock: on_stuck may take its time, or end the process
                self.on_stuck(what, limit)
            except Exception:
                log.exception("the watchdog's action failed")


class StepLimits:
    """A step's limit: `compile_s` until a step of its kind and shapes has completed (its
    programs may compile), then `step_s`."""

    def __init__(self, step_s: float, compile_s: float):
        self.step_s = step_s
        self.compile_s = max(compile_s, step_s)
        self._done: set[Hashable] = set()

    def limit(self, key: Hashable) -> float:
        return self.step_s if key in self._done else self.compile_s

    def done(self, key: Hashable) -> None:
        self._done.add(key)


def step_key(kind: str, inputs=None, **more) -> tuple:
    """(kind, ((name, value), ...)): an engine step's kind and what decides which programs it
    runs: its shape (a ragged step's `StepShape`, image feature rows included), the shapes of
    its logits processing (`more`: anything else, e.g. an overlapped step's feed)."""
    parts = []
    shape = getattr(inputs, "buckets", None)  # a ragged step's shape
    if shape is not None:
        parts.append(("shape", shape.describe()))
    extras = getattr(getattr(inputs, "sampling", None), "extras", None)
    if extras is not None:
        parts.append(("extras", tuple((f, tuple(getattr(v, "shape", ())))
                                      for f, v in zip(extras._fields, extras) if v is not None)))
    parts.extend(sorted(more.items()))
    return kind, tuple(parts)


def describe(key: tuple) -> str:
    """'ragged step (shape T=16 S=8 Q=1 Pg=8 Pl=2 (no logits), feed True)'."""
    kind, parts = key
    text = ", ".join(f"{name} {value}" if name != "extras" else
                     "logits processing " + " ".join(f"{f} {s}" for f, s in value) for name, value in parts)
    return f"{kind} step" + (f" ({text})" if text else "")
