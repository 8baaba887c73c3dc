"""XLA compiles counted from `jax.monitoring`'s events, with their seconds; a program read back
from the persistent compilation cache is a read, not a compile (JAX times a read as a compile
too, after a `cache_hits` event on the same thread: that event marks the thread's next one)."""
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


def counted_compiles():
    """Starts recording; returns a function that gives the figures so far (compiles, compile_s,
    cache_reads, cache_read_s)."""
    durations, hits = [], []
    record_compiles(durations, hits)
    return lambda: {"compiles": len(durations), "compile_s": float(sum(durations)),
                    "cache_reads": len(hits), "cache_read_s": float(sum(hits))}
