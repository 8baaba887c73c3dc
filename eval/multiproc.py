"""Run a Python function as N processes on JAX's distributed runtime (CPU, gloo over TCP).

Single-process "devices" share memory, so a collective between them is a memcpy. To measure a
collective over a real link, each device must be its own process and the bytes must cross a
socket. This launcher starts N processes on 127.0.0.1, each with one CPU device (or more),
joined by `jax.distributed.initialize` with gloo collectives, and optionally puts them all in a
private network namespace whose loopback is shaped with `tc tbf` to X Gbit/s, so that the link
is the bottleneck. The shaped loopback is shared: N processes sending at once split the rate.

Usage:
    from eval import multiproc
    results = multiproc.run("mypkg.mymod:entry", 4, args=(16,), link_gbit=2.0)

`entry` is "module:function"; the function is called in every process as `fn(*args, **kwargs)`
after the runtime is up (it sees `jax.process_index()`, `jax.process_count()` and all N
devices in `jax.devices()`), and must return something JSON-serialisable. `run` returns the
list of return values ordered by process id, or raises RuntimeError with the failing
process's output. The namespace (needs root, `ip` and `tc`) is always deleted afterwards and
worker processes that are still alive on failure are killed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Iterator, Sequence

import jax_platform


def run(
    entry: str,
    n_processes: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    link_gbit: float | None = None,
    devices_per_process: int = 1,
    timeout_s: float = 1800.0,
    env: dict | None = None,
    sysctls: dict[str, str] | None = None,
    malloc_tunables: bool = True,
    torus: Sequence[int] | None = None,
    burst: str = "256kb",
) -> list[Any]:
    """Run `entry(*args, **kwargs)` in `n_processes` JAX processes; see the module docstring.

    link_gbit: if set, all processes run inside a fresh network namespace whose loopback is
      shaped to this rate (token bucket: `burst`, queue latency 50 ms).
    devices_per_process: CPU devices each process contributes to the global device list.
    timeout_s: wall-clock limit for the whole run; the workers are killed when it passes.
    env: extra environment variables for the workers.
    sysctls: kernel settings applied inside the namespace only (needs link_gbit), e.g.
      {"net.ipv4.tcp_slow_start_after_idle": "0"}.
    malloc_tunables: start the workers with glibc's malloc keeping freed blocks and using
      transparent huge pages (`jax_platform`): XLA:CPU's per-execution buffers then
      stop paying page faults on every run.
    torus: dimensions of an emulated torus (eval.torus; needs root): process i runs as node i,
      in its own namespace, with one veth link shaped to link_gbit per torus neighbour (left
      unshaped when link_gbit is None), instead of all processes sharing one shaped loopback.
    burst: the token bucket's size (`tc tbf burst`): that much leaves an idle link at once,
      unshaped, before the rate applies.
    """
    if ":" not in entry:
        raise ValueError(f"entry must be 'module:function', got {entry!r}")
    if n_processes < 1 or devices_per_process < 1:
        raise ValueError(f"need >= 1 process and device, got {n_processes}, {devices_per_process}")
    if link_gbit is not None and link_gbit <= 0:
        raise ValueError(f"link_gbit must be positive, got {link_gbit}")
    if sysctls and link_gbit is None and torus is None:
        raise ValueError("sysctls apply to the private namespace: they need link_gbit")
    if torus is not None:
        if math.prod(torus) != n_processes:
            raise ValueError(f"a {torus} torus has {math.prod(torus)} nodes, not {n_processes}")
    with (tempfile.TemporaryDirectory(prefix="multiproc-") as tmp,
          _network(link_gbit, sysctls or {}, torus, burst) as (ns, net)):
        port = _free_port() if ns is None and net is None else 23456  # fresh namespaces
        host = "127.0.0.1" if net is None else net.address(0)

        def prefix(pid: int) -> list[str]:
            if net is not None:
                return net.prefix(pid)
            return [] if ns is None else ["ip", "netns", "exec", ns]

        # Not the parent's virtual device count: each worker asks for its own.
        worker_env = jax_platform.child_environment(
            dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})), malloc_tunables=malloc_tunables)
        # Whatever the caller can import, the workers can import (entry modules included).
        paths = [p for p in sys.path if p] + [os.getcwd()]
        worker_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        procs = []
        try:
            for pid in range(n_processes):
                spec = {
                    "entry": entry, "args": list(args), "kwargs": kwargs or {},
                    "process_id": pid, "num_processes": n_processes,
                    "coordinator": f"{host}:{port}",
                    "devices_per_process": devices_per_process,
                    "result": os.path.join(tmp, f"result{pid}.json"),
                }
                spec_path = os.path.join(tmp, f"spec{pid}.json")
                with open(spec_path, "w") as f:
                    json.dump(spec, f)
                # stdout too: gloo prints connection chatter there.
                log = open(os.path.join(tmp, f"log{pid}.txt"), "w")
                cmd = prefix(pid) + [sys.executable, "-m", "eval.multiproc", "--worker", spec_path]
                procs.append((subprocess.Popen(cmd, env=worker_env, stdout=log,
                                               stderr=subprocess.STDOUT), log))
            deadline = time.monotonic() + timeout_s
            for pid, (proc, _) in enumerate(procs):
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"process {pid} still running after {timeout_s:.0f} s: "
                                       + _tail(os.path.join(tmp, f"log{pid}.txt")))
                if code != 0:
                    raise RuntimeError(f"process {pid} exited with {code}: "
                                       + _tail(os.path.join(tmp, f"log{pid}.txt")))
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


def _tail(path: str, n: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _network(link_gbit, sysctls, torus, burst):
    """(shared namespace or None, eval.torus.Torus or None)."""
    if torus is None:
        with _namespace(link_gbit, sysctls, burst) as ns:
            yield ns, None
        return
    from eval.torus import emulated_torus

    with emulated_torus(tuple(torus), link_gbit, burst=burst, sysctls=sysctls) as net:
        yield None, net


@contextlib.contextmanager
def _namespace(link_gbit: float | None, sysctls: dict[str, str],
               burst: str) -> Iterator[str | None]:
    """A private network namespace with its loopback shaped to `link_gbit`, or None."""
    if link_gbit is None:
        yield None
        return
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise RuntimeError("a shaped link needs root and the `ip` and `tc` tools")
    name = f"mp-{uuid.uuid4().hex[:10]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
                        "tbf", "rate", f"{link_gbit}gbit", "burst", burst, "latency", "50ms"],
                       check=True)
        for key, value in sysctls.items():
            subprocess.run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", f"{key}={value}"],
                           check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _worker(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    jax_platform.request_cpu_devices(spec["devices_per_process"], exact=True)
    import importlib

    import jax

    jax_platform.join_process_group(jax_platform.ProcessGroup(
        spec["coordinator"], spec["num_processes"], spec["process_id"],
        heartbeat_timeout_s=100))  # jax's own default: a loaded machine may stall a worker
    module, _, name = spec["entry"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    result = fn(*spec["args"], **spec["kwargs"])
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="worker side of eval.multiproc.run")
    parser.add_argument("--worker", required=True, help="path of the JSON spec")
    _worker(parser.parse_args().worker)
