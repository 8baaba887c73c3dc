"""Virtual CPU devices for one-process runs (must be requested before JAX's backend starts)."""
from __future__ import annotations

import os


def ensure_cpu_devices(n: int) -> None:
    """Make at least `n` CPU devices visible to this process, or raise a clear error.

    If the count was already fixed (XLA_FLAGS=--xla_force_host_platform_device_count=N, or the
    backend has started), only checks it.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    # Virtual devices share the host's cores: give a collective's device threads longer than
    # XLA:CPU's default 40 s to meet before it aborts (read when the backend starts).
    if n > 1 and "collective_call_terminate_timeout" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_call_terminate_timeout_seconds=600".strip()
    import jax

    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        try:
            jax.config.update("jax_num_cpu_devices", max(n, 1))
        except RuntimeError:  # the backend is already up: keep what it has
            pass
    have = jax.device_count()
    if have < n:
        raise RuntimeError(f"need {n} devices, this process has {have}; set XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={n} before starting Python")
