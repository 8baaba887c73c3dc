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


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """The real HTTP app on a real uvicorn server in a thread (loopback port) over `engine`."""

    def __init__(self, config, engine, load: bool = True):
        import uvicorn

        from serving.api import create_app
        from serving.runtime import Runtime

        self.runtime = Runtime(config, engine_factory=lambda c, p: engine)
        self.engine = engine
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
