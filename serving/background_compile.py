"""Compiling the engine's remaining step programs on a low-priority thread once it serves.

The warm-up compiles what every server meets first; the other step shapes would each stall every
running stream when first needed. This thread compiles them one at a time while the engine is idle,
at the lowest CPU priority, so serving comes first; a step that needs a program being compiled waits
for that compile. See docs/engine.md, "Background compile"."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Sequence

log = logging.getLogger(__name__)


IDLE_POLL_S = 0.05


class BackgroundCompiler:
    def __init__(self, keys: Sequence, compile_one: Callable[[object], None],
                 idle: Callable[[], bool] = lambda: True):
        self.keys = list(keys)
        self.compiled = 0
        self._compile = compile_one
        self._idle = idle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="background-compile", daemon=True)

    def start(self) -> "BackgroundCompiler":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> bool:
        """Stops after the program being compiled; returns whether the thread ended (a compile
        left running while the process exits could crash it)."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every program is compiled (or the thread stopped)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        _lowest_priority()
        t0 = time.perf_counter()
        for key in self.keys:
            while not self._idle() and not self._stop.wait(IDLE_POLL_S):
                pass
            if self._stop.is_set():
                break
            try:
                self._compile(key)
            except Exception:  # a step that needs it compiles it then, and says why it fails
                log.exception("background compile of %s failed; stopping", key)
                break
            self.compiled += 1
        log.info("background compile: %d of %d step programs in %.0fs", self.compiled,
                 len(self.keys), time.perf_counter() - t0)


def _lowest_priority() -> None:
    """nice 19 for the calling thread (Linux applies setpriority to a thread id); elsewhere
    the thread keeps the process's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
