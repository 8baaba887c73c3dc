"""Virtual CPU devices for one-process runs (must be requested before JAX's backend starts)."""
from __future__ import annotations

import os

from serving.xla_flags import with_collective_timeout


def ensure_cpu_devices(n: int) -> None:
    """Make at least `n` CPU devices visible to this process, or raise a clear error.

    If the count was already fixed (XLA_FLAGS=--xla_force_host_platform_device_count=N, or the
    backend has started), only checks it.
    """
    if n > 1:
        os.environ["XLA_FLAGS"] = with_collective_timeout(os.environ.get("XLA_FLAGS", ""))
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
