"""Test session set-up: 8 virtual CPU devices, configured before anything imports jax."""
import os

from serving.xla_flags import with_collective_timeout

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = with_collective_timeout(_flags.strip())  # 8 devices on 2 cores


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
