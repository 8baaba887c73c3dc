"""Test session set-up: 8 virtual CPU devices, configured before anything imports jax."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# 8 virtual devices share 2 cores: XLA:CPU aborts the process when a collective's device threads
# have not all arrived after 40 s (its default), which an oversubscribed machine can exceed.
if "collective_call_terminate_timeout" not in _flags:
    _flags += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
os.environ["XLA_FLAGS"] = _flags.strip()


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_memory_between_modules():
    """Each module loads its own models; drop their compiled programs and buffers before the next
    one so the whole suite fits a 24 GiB CI machine."""
    yield
    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()
