"""Helpers shared by test modules (importable from any test file: pytest puts tests/ on sys.path
through its conftest). Test modules never import each other; what two of them need lives here."""
from __future__ import annotations

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
    """The real HTTP app on a real uvicorn server in a thread (loopback port) over `runner`."""

    def __init__(self, config, runner, load: bool = True):
        import uvicorn

        from serving.api import create_app
        from serving.runtime import Runtime

        self.runtime = Runtime(config, runner_factory=lambda c, p: runner)
        self.runner = runner
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.runtime), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
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

        (codes, steps, exps), (want_codes, want_steps, want_exps) = (
            [np.asarray(p) for p in codec_spec.wire_parts(jnp.asarray(w), *wire)]
            for w in (got, want))
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
