"""Test session set-up: 8 virtual CPU devices on the CPU backend, asked for (through
`serving.jax_platform`, the same set-up the CLI and eval use) before any test starts JAX."""
import gc

import pytest

from serving import jax_platform


_CACHE_ENV = "GEMMA3_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    import os
    import tempfile

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax_platform.request_cpu_devices(8)  # 8 devices on 2 cores: with the longer collective timeout
    # One compilation cache for the session, shared by the xdist workers (they inherit the
    # controller's environment): a program several files compile alike is compiled once. It
    # starts empty, so nothing outlives the session or depends on an earlier run.
    if not hasattr(config, "workerinput"):
        config._compilation_cache = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jax-cache-")
        # The native CPU kernel (equarx.native_cpu) is built there too, once for the session.
        os.environ["EQUARX_CACHE_DIR"] = os.path.join(os.environ[_CACHE_ENV], "equarx")
    jax_platform.enable_compilation_cache(os.environ[_CACHE_ENV])


def pytest_unconfigure(config):
    import shutil

    directory = getattr(config, "_compilation_cache", None)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_memory_between_modules():
    """Each module loads its own models; drop their compiled programs and buffers before the next
    one so the whole suite fits a 24 GiB CI machine."""
    yield
    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


# Files that take longest (compiles of the real 270M, or waits on other processes) run first,
# longest first (as measured on 2 cores): with two xdist workers taking a whole file
# at a time, a long file started last would leave one worker idle while the other finishes it.
LONG_FILES_FIRST = (
    "models/test_hf_checkpoint.py", "serving/test_multihost.py", "models/test_parity.py",
    "eval/test_quality.py", "equarx/test_collective.py", "serving/test_group_formation.py",
    "serving/test_batch_invariance.py", "eval/test_quality_scaling.py",
    "serving/test_structured_e2e.py", "equarx/test_pallas.py", "serving/test_server_e2e.py",
    "models/test_program_cache.py", "eval/test_bench_engine.py", "serving/test_soak.py",
    "models/test_weights_cache.py", "models/test_model.py", "serving/test_tools.py",
    "equarx/test_token_local.py", "models/test_model_checkpoint.py",
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return LONG_FILES_FIRST.index(path) if path in LONG_FILES_FIRST else len(LONG_FILES_FIRST)

    items.sort(key=rank)  # stable: the order inside a file, and of the other files, is kept
