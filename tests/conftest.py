"""Test session set-up: 8 virtual CPU devices on the CPU backend, asked for (through
`serving.jax_platform`, the same set-up the CLI and eval use) before any test starts JAX."""
import gc

import pytest

from serving import jax_platform


def pytest_configure(config):
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax_platform.request_cpu_devices(8)  # 8 devices on 2 cores: with the longer collective timeout


@pytest.fixture(autouse=True, scope="module")
def _release_memory_between_modules():
    """Each module loads its own models; drop their compiled programs and buffers before the next
    one so the whole suite fits a 24 GiB CI machine."""
    yield
    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()
