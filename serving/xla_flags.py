"""XLA flags for CPU runs on virtual devices. No jax import here: XLA reads its flags when its
backend starts, so callers set them before that."""
from __future__ import annotations

_TIMEOUT_FLAG = "xla_cpu_collective_call_terminate_timeout_seconds"


def with_collective_timeout(flags: str, seconds: int = 600) -> str:
    """`flags` plus a longer wait for a collective's device threads, unless they set one.

    Virtual devices share the host's cores, and XLA:CPU aborts the process when a collective's
    device threads have not all met after 40 s (its default), which an oversubscribed machine
    can exceed."""
    if _TIMEOUT_FLAG in flags:
        return flags
    return f"{flags} --{_TIMEOUT_FLAG}={seconds}".strip()
