"""Test session set-up: 8 virtual CPU devices on the CPU backend, asked for (through
`jax_platform`, the same set-up the CLI and eval use) before any test starts JAX."""
import gc
import threading

import pytest

import jax_platform


_CACHE_ENV = "GEMMA3_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    import os
    import tempfile

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _no_numpy_huge_pages()
    # The servers the tests start (child processes read it) compile no step program in the
    # background beside the suite: tests/serving/test_background_compile.py turns it on.
    os.environ.setdefault("GEMMA3_BACKGROUND_COMPILE", "0")
    # ... and compile only the warm-up's before they are ready: test_background_compile.py and
    # test_precompile.py check what compiles after ready.
    os.environ.setdefault("GEMMA3_PRECOMPILE", "warmup")
    jax_platform.request_cpu_devices(8)  # 8 devices on 2 cores: with the longer collective timeout
    # One compilation cache for the session, shared by the xdist workers (they inherit the
    # controller's environment): a program several files compile alike is compiled once. It
    # starts empty, so nothing outlives the session or depends on an earlier run.
    if not hasattr(config, "workerinput"):
        config._compilation_cache = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jax-cache-")
        # The native CPU kernel (equarx.native_cpu) is built there too, once for the session.
        os.environ["EQUARX_CACHE_DIR"] = os.path.join(os.environ[_CACHE_ENV], "equarx")
    jax_platform.enable_compilation_cache(os.environ[_CACHE_ENV])
    if not hasattr(config, "workerinput"):
        config._native_build = threading.Thread(target=_build_native_cpu_kernels, daemon=True)
        config._native_build.start()


def _no_numpy_huge_pages():
    """numpy asks for transparent huge pages for its large arrays (madvise); where the kernel
    compacts memory for them on a fault (defrag=madvise), a fresh gigabyte of arrays took
    1-7 s of system time against 0.4 s without. Off for the suite's processes and the child
    processes they start (numpy reads the variable at import)."""
    import os
    import sys

    os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")
    if "numpy" in sys.modules and os.environ["NUMPY_MADVISE_HUGEPAGE"] == "0":
        from numpy._core import multiarray

        multiarray._set_madvise_hugepage(False)


def _build_native_cpu_kernels():
    """Build equarx.native_cpu's kernels into the session's cache once, in the controller while
    the workers start and collect, rather than in the processes that first need them: those
    came several at once (a multi-host test's two servers and the worker computing its
    reference: three C++ builds side by side, ~20 s of that test), and a file's first child
    process paid for one. The tests wait for it (`pytest_collection_finish`); a failure is left
    to the processes that load the kernels to report (they try to build them themselves)."""
    import os

    try:
        from equarx import native_cpu

        if os.environ.get("EQUARX_NATIVE_CPU", "1") != "0" and native_cpu.compiler():
            native_cpu.build(native_cpu.compiler())
    except Exception:  # the processes that load the kernels report it
        pass
    finally:
        os.makedirs(os.environ["EQUARX_CACHE_DIR"], exist_ok=True)
        open(os.path.join(os.environ["EQUARX_CACHE_DIR"], _BUILT), "w").close()


_BUILT = "session-build-done"


def pytest_collection_finish(session):
    """Before the first test: wait for the controller's build of the native kernels."""
    import os
    import time

    build = getattr(session.config, "_native_build", None)
    if build is not None:  # this process is the controller (no xdist)
        build.join()
        return
    marker = os.path.join(os.environ["EQUARX_CACHE_DIR"], _BUILT)
    deadline = time.monotonic() + 300
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.1)


def pytest_unconfigure(config):
    import shutil

    build = getattr(config, "_native_build", None)
    if build is not None:
        build.join()  # before its directory goes
    directory = getattr(config, "_compilation_cache", None)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_memory_between_modules():
    """Each module loads its own models; drop their compiled programs and buffers before the next
    one so the whole suite fits a 24 GiB CI machine. One collection, after the caches are
    cleared, frees what they held and what was already garbage (a full collection costs
    0.2-0.5 s a module)."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def vision_golden():
    """The tiny multimodal golden (testkit.VISION_GOLDEN_NPZ: transformers' outputs on a tiny
    random Gemma3ForConditionalGeneration) as a dict of arrays."""
    import numpy as np

    from testkit import VISION_GOLDEN_NPZ

    return dict(np.load(VISION_GOLDEN_NPZ))


# Files that take longest run first, longest first (`rank s` of `python -m pytest -p
# tests.suite_profile` then `python -m tests.suite_profile`: each file's CPU seconds with its
# children, or 0.7 x its wall time where it mostly waits; a whole-suite run, 2026-12-04, with
# test_precompile.py placed by a run of its own, 2026-12-05): with
# two xdist workers taking a whole file at a time, a long file started last leaves one worker
# idle while the other finishes it. Every file of more than ~8 s is listed, so the files left
# for the end are short.
LONG_FILES_FIRST = (
    "equarx/test_pallas.py", "serving/test_multihost.py", "models/test_hf_checkpoint.py",
    "models/test_parity.py", "serving/test_paged_runner.py", "models/test_quantization.py",
    "serving/test_structured_e2e.py", "eval/test_bench_engine.py", "serving/test_server_e2e.py",
    "eval/test_quality.py", "equarx/test_codec_conformance.py", "models/test_paged.py",
    "equarx/test_collective.py", "serving/test_cli_generate.py", "serving/test_group_formation.py",
    "models/test_weights_cache.py",
    "serving/test_background_compile.py", "equarx/test_triton_codecs.py",
    "eval/test_bench_serving.py", "serving/test_watchdog.py", "serving/test_long_prompts.py",
    "models/test_model.py", "models/test_kv_quantization.py",
    "serving/test_batch_invariance.py", "serving/test_precompile.py",
    "models/test_paged_images.py",
    "models/test_tp_mesh.py", "models/test_model_checkpoint.py",
    "serving/test_structured_output.py", "equarx/test_mse.py", "serving/test_image_encoder.py",
    "models/test_gguf.py", "equarx/test_multi_axis.py", "models/test_program_cache.py",
    "serving/test_llm.py", "serving/test_overlap.py", "equarx/test_token_local.py",
    "equarx/test_native_cpu.py", "eval/test_bench_codec.py",
    "serving/test_chat_images.py", "equarx/test_hlo.py", "serving/test_hostile_http.py",
    "serving/test_never_generate.py", "test_docker.py", "serving/test_serving_units.py",
    "serving/test_tools.py", "equarx/test_multiproc.py", "models/test_hf_layouts.py",
    "serving/test_image_spans.py", "serving/test_paged_runner_images.py",
    "models/test_model_hlo.py", "eval/test_bench_prefill.py",
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return LONG_FILES_FIRST.index(path) if path in LONG_FILES_FIRST else len(LONG_FILES_FIRST)

    items.sort(key=rank)  # stable: the order inside a file, and of the other files, is kept
