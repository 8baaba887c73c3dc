"""XLA compiles as the eval tools count them: one `jax.monitoring` event per program compiled
(a persistent-cache hit sends none), with its seconds."""
from __future__ import annotations

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def record_compiles(durations: list[float]) -> None:
    """From now on append each compile's seconds to `durations` (imports jax: call it in a
    process that runs JAX anyway)."""
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: durations.append(seconds) if event == BACKEND_COMPILE else None)
