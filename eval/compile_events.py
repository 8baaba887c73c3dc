"""XLA compiles as the eval tools count them, from `jax.monitoring`'s events: one per program
compiled, with its seconds; a program read back from the persistent compilation cache is a hit,
not a compile.

JAX times a persistent-cache read as a backend compile too (the same duration event, its seconds
those of the read), after a `cache_hits` event on the same thread: a thread's hit event marks
its next compile event as a read."""
from __future__ import annotations

import threading

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


def record_compiles(durations: list[float], hits: list[float] | None = None) -> None:
    """From now on append each compile's seconds to `durations`, and each persistent-cache
    read's to `hits` if given (imports jax: call it in a process that runs JAX anyway)."""
    import jax.monitoring

    reading = threading.local()

    def on_event(event: str, **_) -> None:
        if event == CACHE_HIT:
            reading.hit = True

    def on_duration(event: str, seconds: float, **_) -> None:
        if event != BACKEND_COMPILE:
            return
        if getattr(reading, "hit", False):
            reading.hit = False
            if hits is not None:
                hits.append(seconds)
        else:
            durations.append(seconds)

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
