"""Helpers shared by test modules (importable from any test file: pytest puts tests/ on sys.path
through its conftest). Test modules never import each other; what two of them need lives here."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_NPZ = ROOT / "tests" / "golden" / "gemma3_270m.npz"  # the official `gemma` package's
HF_GOLDEN_NPZ = ROOT / "tests" / "golden" / "gemma3_270m_hf.npz"  # transformers'
VISION_GOLDEN_NPZ = ROOT / "tests" / "golden" / "gemma3_vision_tiny_hf.npz"  # transformers, tiny multimodal
PATTERN_GOLDEN_NPZ = ROOT / "tests" / "golden" / "tiny_pattern_hf.npz"  # transformers, 1 global : 2 local


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """The real HTTP app on the server `gemma3-serve` builds (serving.http_server: its protocol,
    timeouts and connection cap from `config`) in a thread, on a free loopback port, over
    `runner`. uvicorn_kwargs: e.g. log_config=None to send its records to pytest's caplog."""

    def __init__(self, config, runner, load: bool = True, background_compile: bool = False,
                 **uvicorn_kwargs):
        import dataclasses

        import uvicorn

        from serving.api import create_app
        from serving.http_server import uvicorn_config
        from serving.runtime import Runtime

        # Off unless asked for: the other step programs would compile beside every test.
        config = dataclasses.replace(config, background_compile=background_compile,
                                     host="127.0.0.1", port=free_port())
        self.runtime = Runtime(config, runner_factory=lambda c, p: runner)
        self.runner = runner
        self.port = config.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(self.runtime)
        self.server = uvicorn.Server(uvicorn_config(self.app, config,
                                                    **{"log_level": "warning", **uvicorn_kwargs}))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        if load:
            self.runtime.load()

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.runtime.shutdown()


class Collector:
    """A sequence's sink for the engine core: keeps its events; `wait` until the last one."""

    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if event.finish_reason is not None:
            self.done.set()

    def wait(self, timeout=10.0):
        assert self.done.wait(timeout), "sequence did not finish"
        return self

    @property
    def text(self):
        return "".join(e.text for e in self.events)

    @property
    def tokens(self):
        """The TokenInfo of every generated token, in order."""
        return [t for e in self.events for t in e.tokens]

    @property
    def finish(self):
        return self.events[-1].finish_reason

    @property
    def error(self):
        return self.events[-1].error


@contextlib.contextmanager
def running_core(engine, core=None, **options):
    """`core` when given (left running), else an EngineCore(engine, **options) of its own,
    started, and shut down on leaving."""
    if core is not None:
        yield core
        return
    from serving.engine_core import EngineCore

    core = EngineCore(engine, **options).start()
    try:
        yield core
    finally:
        core.shutdown()


def finish_all(core, requests, timeout=120.0) -> list[Collector]:
    """Submits each request ((prompt, SamplingParams[, images])) to `core` on its own, all before
    any is awaited; waits for every one to finish and returns their Collectors in order."""
    sinks = [Collector() for _ in requests]
    for (prompt, params, *images), sink in zip(requests, sinks):
        core.submit([(prompt, params, sink, *images)])
    return [sink.wait(timeout) for sink in sinks]


def wait_group_ready(url: str, procs, timeout: float) -> None:
    """Wait until the server at `url` answers /health with 200; fail with a process's log tail as
    soon as one of `procs` ((Popen, log file) pairs) exits, or after `timeout` seconds."""
    import httpx
    import pytest

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, (p, log) in enumerate(procs):
            if p.poll() is not None:
                pytest.fail(f"process {i} exited with {p.returncode}: {Path(log.name).read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server at {url} did not become ready within {timeout:.0f}s")


def stop_processes(procs) -> None:
    """Kill what is still running of `procs` ((Popen, log file) pairs) and close the logs."""
    for p, log in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()


def assert_same_bits(got, want, wire: tuple | None = None, err_msg: str = "") -> None:
    """The codec's promise across backends (equarx.groups, "NaN"), checked against `want`, the
    pure-JAX form's result: a NaN where `want` has one (of any payload and sign) and every other
    value bit for bit (a zero's sign too). Integer arrays compare exactly; with
    wire=(piece_shape, g, code) they are `groups.encode`'s bytes, whose non-finite runs (step
    byte NOT_FINITE: they decode as NaN) may hold any codes."""
    import jax.numpy as jnp
    import numpy as np

    got, want = np.asarray(got), np.asarray(want)
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (
        f"{got.shape} {got.dtype} against {want.shape} {want.dtype} {err_msg}")
    if wire is not None:
        from equarx import codec_spec

        # Plain slices: numpy's, not an eager jax program per slice and shape.
        (codes, steps, exps), (want_codes, want_steps, want_exps) = (
            codec_spec.wire_parts(w, *wire) for w in (got, want))
        np.testing.assert_array_equal(steps, want_steps, err_msg=f"step bytes {err_msg}")
        np.testing.assert_array_equal(exps, want_exps, err_msg=f"exponent bytes {err_msg}")
        finite = np.repeat(want_steps.view(np.uint8) != codec_spec.NOT_FINITE,
                           codes.shape[-1] // steps.shape[-1], axis=-1)
        np.testing.assert_array_equal(codes[finite], want_codes[finite],
                                      err_msg=f"codes of finite runs {err_msg}")
        return
    if not jnp.issubdtype(got.dtype, jnp.floating):
        np.testing.assert_array_equal(got, want, err_msg=err_msg)
        return
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan,
                                  err_msg=f"where the NaNs are {err_msg}")
    bits = np.dtype(f"u{got.dtype.itemsize}")
    np.testing.assert_array_equal(got.view(bits)[~nan], want.view(bits)[~nan],
                                  err_msg=f"the bits of the values other than NaN {err_msg}")


def assert_same_bytes(got, want, err_msg: str = "") -> None:
    """got and want (host arrays, or anything np.asarray takes) of one shape and dtype, byte for
    byte. One comparison of the raw bytes: np.testing.assert_array_equal builds several
    temporaries of the arrays' size (seconds a gigabyte of weights), so it runs only to
    describe a mismatch."""
    import numpy as np

    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (
        f"{got.shape} {got.dtype} against {want.shape} {want.dtype} {err_msg}")
    got, want = got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
    if not np.array_equal(got, want):
        np.testing.assert_array_equal(got, want, err_msg=err_msg)


# The native kernels' instruction-set builds on x86-64: each build's -march and the processor
# features (/proc/cpuinfo's names) it needs. x86-64-v4 runs the AVX-512 butterflies (with the
# integer bfloat16 rounding; the default build on a processor with AVX512-BF16 runs its one
# instruction), x86-64-v3 the AVX2 ones, x86-64 the plain loops.
_X86_64_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe")
NATIVE_BUILDS = {
    "x86-64-v4": _X86_64_V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "x86-64-v3": _X86_64_V3, "x86-64": ()}


def native_build_targets(arch: str, prefix: str) -> tuple[str, ...]:
    """equarx.native_cpu's kernels built for `-march=arch` (NATIVE_BUILDS) and registered under
    names ending in prefix + arch: their FFI targets, as native_cpu.TARGETS orders them. Skips
    the calling test where this processor cannot run that build."""
    import platform

    import pytest

    from equarx import native_cpu

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the instruction-set builds are x86-64's")
    flags = native_cpu._cpu_flags().partition(":")[2].split()
    missing = [f for f in NATIVE_BUILDS[arch] if f not in flags]
    if missing:
        pytest.skip(f"this processor cannot run the {arch} build: it lacks {' '.join(missing)}")
    lib = native_cpu.build(native_cpu.compiler(), arch=arch)
    return native_cpu.register(lib, f"{prefix}{arch.replace('-', '_')}")


def vision_golden_model(golden: dict, path: Path, tp: int = 1):
    """The tiny multimodal golden loaded as a float32 model with the f32 AllReduce (its
    checkpoint written at `path`)."""
    from equarx import AllReduceConfig
    from models.gemma3 import load_model

    return load_model(str(vision_golden_checkpoint(golden, path)), tp=tp, dtype="float32",
                      allreduce=AllReduceConfig(method="f32"))


def vision_golden_checkpoint(golden: dict, path: Path) -> Path:
    """The tiny multimodal golden's state dict and config (VISION_GOLDEN_NPZ, made by
    tests/golden/make_vision_golden.py) as a Hugging Face directory at `path`."""
    from models.gemma3.hf_checkpoint import CONFIG_FILE, write_safetensors

    tensors = {k[2:]: v for k, v in golden.items() if k.startswith("w:")}
    write_safetensors(path / "model.safetensors", tensors, metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(str(golden["config"]))
    return path


def vision_golden_images(m, golden: dict, k: int):
    """The k-image golden prompt's images as the engine takes them (`SeqImage`s: each one's
    16-token soft span, pixels and a content key)."""
    import numpy as np

    from serving.sequence import SeqImage

    ids = golden[f"ids_{k}"]
    soft = np.flatnonzero(ids == m.vision.tokens.soft)
    return tuple(SeqImage(spans=((int(a), int(a) + 16),), pixels=golden[f"pixels_{k}"][j:j + 1],
                          key=f"img{k}-{j}") for j, a in enumerate(soft[::16]))


def stream_beside_an_image(engine, golden: dict, images, probe, stream_tokens: int):
    """Through a real engine core over `engine`: a greedy text stream (the golden's 0-image
    prompt) and, once it has 3 tokens, the 2-image golden prompt for 8 greedy tokens. Returns
    (the image request's tokens, probe() taken at each of the stream's tokens)."""
    import threading

    from serving.engine_core import EngineCore
    from serving.sampling import SamplingParams

    core = EngineCore(engine).start()
    seen, results = [], [[], []]
    done = [threading.Event(), threading.Event()]

    def sink(i):
        def on(e):
            results[i].extend(t.id for t in e.tokens)
            if i == 0:
                seen.extend(probe() for _ in e.tokens)
            if e.finish_reason is not None:
                assert e.error is None, e.error
                done[i].set()
        return on

    try:
        core.submit([(golden["ids_0"].tolist(), SamplingParams(
            max_tokens=stream_tokens, temperature=0.0, ignore_eos=True), sink(0), ())])
        while len(results[0]) < 3:
            threading.Event().wait(0.01)
        core.submit([(golden["ids_2"].tolist(), SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True), sink(1), images)])
        assert done[0].wait(120) and done[1].wait(120)
    finally:
        core.shutdown()
    return results[1], seen
