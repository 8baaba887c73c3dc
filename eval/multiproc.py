"""A Python function run as N processes on JAX's distributed runtime (CPU, gloo over TCP), one
CPU device each, so that a collective's bytes cross a socket; optionally on a shaped loopback
or an emulated torus (eval.torus). Usage: docs/benchmarks.md#multiproc-one-process-per-device."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

import jax_platform


def run(entry: str, n_processes: int, *, args: Sequence[Any] = (),
        link_gbit: float | None = None, timeout_s: float = 1800.0, malloc_tunables: bool = True,
        torus: Sequence[int] | None = None, burst: str = "256kb") -> list[Any]:
    """`entry` ('module:function') called as entry(*args) in each of n_processes once the runtime
    is up (it sees all N devices); returns its JSON-serialisable values by process id, or raises
    RuntimeError with the failing process's output (workers still alive are killed).
    link_gbit: a shaped loopback (root); torus: the emulated torus of these dims; burst: the
    shaped links' token bucket; malloc_tunables: glibc keeps freed blocks and uses huge pages in
    the workers (XLA:CPU's per-run buffers stop paying page faults)."""
    if ":" not in entry:
        raise ValueError(f"entry must be 'module:function', got {entry!r}")
    if n_processes < 1:
        raise ValueError(f"need >= 1 process, got {n_processes}")
    if torus is not None and math.prod(torus) != n_processes:
        raise ValueError(f"a {torus} torus has {math.prod(torus)} nodes, not {n_processes}")
    from eval import torus as links

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="multiproc-"))
        net = ns = None
        if torus is not None:
            net = stack.enter_context(links.emulated_torus(tuple(torus), link_gbit, burst=burst))
        elif link_gbit is not None:
            ns = stack.enter_context(links.shaped_loopback(link_gbit, burst))
        host = "127.0.0.1" if net is None else links.address(0)
        port = 23456 if ns or net else _free_port()  # a fresh namespace has every port free
        env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu"),
                                             malloc_tunables=malloc_tunables)
        # Whatever the caller can import, the workers can import (entry modules included).
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([p for p in sys.path if p] + [os.getcwd()]))
        procs = []
        try:
            for pid in range(n_processes):
                spec = os.path.join(tmp, f"spec{pid}.json")
                with open(spec, "w") as f:
                    json.dump({"entry": entry, "args": list(args), "process_id": pid,
                               "num_processes": n_processes, "coordinator": f"{host}:{port}",
                               "result": os.path.join(tmp, f"result{pid}.json")}, f)
                prefix = links.netns(net[pid] if net else ns)
                log = open(os.path.join(tmp, f"log{pid}.txt"), "w")  # gloo chats on stdout
                procs.append((subprocess.Popen(prefix + [sys.executable, "-m", "eval.multiproc",
                                                         "--worker", spec], env=env, stdout=log,
                                               stderr=subprocess.STDOUT), log))
            deadline = time.monotonic() + timeout_s
            for pid, (proc, _) in enumerate(procs):
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                    what = f"exited with {code}"
                except subprocess.TimeoutExpired:
                    code, what = None, f"still running after {timeout_s:.0f} s"
                if code != 0:
                    with open(os.path.join(tmp, f"log{pid}.txt"), errors="replace") as f:
                        raise RuntimeError(f"process {pid} {what}: {f.read()[-3000:]}")
            results = []
            for pid in range(n_processes):
                with open(os.path.join(tmp, f"result{pid}.json")) as f:
                    results.append(json.load(f))
            return results
        finally:
            for proc, log in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    jax_platform.request_cpu_devices(1, exact=True)
    import importlib

    import jax

    jax_platform.join_process_group(jax_platform.ProcessGroup(
        spec["coordinator"], spec["num_processes"], spec["process_id"],
        heartbeat_timeout_s=100))  # jax's own default: a loaded machine may stall a worker
    module, _, name = spec["entry"].partition(":")
    result = getattr(importlib.import_module(module), name)(*spec["args"])
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="worker side of eval.multiproc.run")
    parser.add_argument("--worker", required=True, help="path of the JSON spec")
    _worker(parser.parse_args().worker)
