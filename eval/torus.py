"""Emulated links between CPU processes (root, `ip` and `tc`), removed afterwards: a namespace
whose loopback is shaped (`shaped_loopback`), or a torus of namespaces, a shaped veth pair per
neighbour and dimension-order routes (`emulated_torus`); and the grid arithmetic both the
emulation and the cost model's topologies route with. More: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from typing import Iterator, Sequence


def parse_dims(text: str) -> tuple[int, ...]:
    """'2x2' -> (2, 2); '4' -> (4,)."""
    dims = tuple(int(v) for v in text.lower().split("x"))
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"bad torus dimensions {text!r}")
    return dims


def coords(i: int, dims: Sequence[int]) -> tuple[int, ...]:
    """Node i's grid coordinates, row-major."""
    out = []
    for d in reversed(dims):
        out.append(i % d)
        i //= d
    return tuple(reversed(out))


def index(c: Sequence[int], dims: Sequence[int]) -> int:
    i = 0
    for v, d in zip(c, dims):
        i = i * d + v
    return i


def neighbour(i: int, dims: Sequence[int], axis: int, step: int) -> int:
    """Node i moved `step` along `axis`, round the end."""
    c = list(coords(i, dims))
    c[axis] = (c[axis] + step) % dims[axis]
    return index(c, dims)


def neighbours(i: int, dims: Sequence[int]) -> list[int]:
    """Node i's torus neighbours (each once), axis by axis, +1 before -1."""
    out = []
    for a in range(len(dims)):
        for j in (neighbour(i, dims, a, 1), neighbour(i, dims, a, -1)):
            if j != i and j not in out:
                out.append(j)
    return out


def links(dims: tuple[int, ...]) -> list[tuple[int, int]]:
    return sorted({(min(i, j), max(i, j)) for i in range(math.prod(dims)) for j in neighbours(i, dims)})


def next_hop(i: int, dst: int, dims: Sequence[int], wrap: bool = True) -> int:
    """Dimension-order routing: along the first differing axis, the shorter way round (ties:
    +1) where the axis wraps (an axis of 2 has one link), straight along a line otherwise."""
    a_c, b_c = coords(i, dims), coords(dst, dims)
    for a, d in enumerate(dims):
        if a_c[a] != b_c[a]:
            fwd = (b_c[a] - a_c[a]) % d
            if wrap or d == 2:
                return neighbour(i, dims, a, 1 if fwd <= d - fwd else -1)
            return neighbour(i, dims, a, 1 if b_c[a] > a_c[a] else -1)
    raise ValueError("no hop to oneself")


def route(src: int, dst: int, dims: Sequence[int], wrap: bool = True) -> list[tuple[int, int]]:
    """The directed links (u, v) a message from src to dst crosses (`next_hop`'s)."""
    out = []
    while src != dst:
        out.append((src, next_hop(src, dst, dims, wrap)))
        src = out[-1][1]
    return out


def hops(i: int, dst: int, dims: tuple[int, ...]) -> int:
    return len(route(i, dst, dims))


def snake_order(dims: Sequence[int]) -> list[int]:
    """A ring through a torus whose consecutive nodes are neighbours: the first axis' slices in
    turn, each in snake order, forwards and backwards in turn (for an even number of slices the
    last node neighbours the first)."""
    if len(dims) == 1:
        return list(range(dims[0]))
    inner, n = snake_order(dims[1:]), math.prod(dims[1:])
    return [v * n + j for v in range(dims[0]) for j in (inner if v % 2 == 0 else inner[::-1])]


def address(i: int) -> str:
    return f"10.99.{(i + 1) // 256}.{(i + 1) % 256}"


def netns(ns: str | None) -> list[str]:
    """The command prefix that runs a program in namespace `ns` (None: where we are)."""
    return ["ip", "netns", "exec", ns] if ns else []


def _sh(*cmd: str, ns: str | None = None) -> None:
    subprocess.run(netns(ns) + list(cmd), check=True, capture_output=True, text=True)


def _shape(dev: str, ns: str, gbit: float, burst: str) -> None:
    _sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit", "burst", burst,
        "latency", "50ms", ns=ns)


@contextlib.contextmanager
def _namespaces(n: int) -> Iterator[tuple[str, ...]]:
    """n fresh namespaces, deleted afterwards (a SIGTERM meanwhile becomes SystemExit, so
    that they are)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise RuntimeError("emulated links need root and the `ip` and `tc` tools")
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    tag, made = uuid.uuid4().hex[:6], []
    try:
        for i in range(n):
            subprocess.run(["ip", "netns", "add", f"tor-{tag}-{i}"], check=True)
            made.append(f"tor-{tag}-{i}")
            _sh("ip", "link", "set", "lo", "up", ns=made[-1])
        yield tuple(made)
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def shaped_loopback(link_gbit: float, burst: str = "256kb") -> Iterator[str]:
    """A namespace whose loopback is shaped to link_gbit (shared by all traffic in it)."""
    if link_gbit <= 0:
        raise ValueError(f"link_gbit must be positive, got {link_gbit}")
    with _namespaces(1) as (ns,):
        _shape("lo", ns, link_gbit, burst)
        yield ns


@contextlib.contextmanager
def emulated_torus(dims: tuple[int, ...], link_gbit: float | None, *, burst: str = "256kb"
                   ) -> Iterator[tuple[str, ...]]:
    """Node i's namespace for each node: a namespace per node (node i at 10.99.0.(i+1), its /etc/hosts naming that address, which
    gloo binds), a veth pair per neighbour with each end shaped to `link_gbit` (None: unshaped,
    the same routes and per-message costs without the rate), dimension-order routes through
    neighbours, which forward (a two-hop message loads two links)."""
    if link_gbit is not None and link_gbit <= 0:
        raise ValueError(f"link_gbit must be positive, got {link_gbit}")
    n, host = math.prod(dims), socket.gethostname()
    with _namespaces(n) as names:
        tag = names[0].split("-")[1]
        for i, ns in enumerate(names):
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{address(i)} {host}\n")
            _sh("ip", "addr", "add", f"{address(i)}/32", "dev", "lo", ns=ns)
            for key in ("ip_forward", "conf.all.rp_filter", "conf.default.rp_filter"):
                _sh("sysctl", "-q", "-w", f"net.ipv4.{key}={int(key == 'ip_forward')}", ns=ns)
        for i, j in links(dims):
            a, b = f"t{tag}{i}-{j}", f"t{tag}{j}-{i}"
            subprocess.run(["ip", "link", "add", a, "netns", names[i], "type", "veth", "peer",
                            "name", b, "netns", names[j]], check=True)
            for ns, dev in ((names[i], a), (names[j], b)):
                _sh("ip", "link", "set", dev, "up", ns=ns)
                _sh("sysctl", "-q", "-w", f"net.ipv4.conf.{dev}.rp_filter=0", ns=ns)
                if link_gbit is not None:
                    _shape(dev, ns, link_gbit, burst)
        for i in range(n):
            for dst in set(range(n)) - {i}:
                hop = next_hop(i, dst, dims)
                via = [] if hop == dst else ["via", address(hop)]
                _sh("ip", "route", "add", f"{address(dst)}/32", *via, "dev", f"t{tag}{i}-{hop}",
                    *(["onlink"] if via else []), "src", address(i), ns=names[i])
        yield names


_RECEIVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 9009)); s.listen(16); print("ready", flush=True)
while True:
    c, _ = s.accept()
    while c.recv(1 << 20):
        pass
    c.sendall(b"k"); c.close()
"""
_SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 9009), timeout=30)
data = b"x" * (1 << 20); t0 = time.perf_counter()
for _ in range(int(sys.argv[2])):
    c.sendall(data)
c.shutdown(socket.SHUT_WR); c.recv(1); print(time.perf_counter() - t0)
"""


def check(names: tuple[str, ...], dims: tuple[int, ...], mib: int = 8) -> list[dict]:
    """`mib` MiB from node 0 to every other node of the torus `emulated_torus` made, in turn,
    timed: about the link rate to a neighbour, and to a node two hops away (two in series)."""
    recv = [subprocess.Popen(netns(ns) + [sys.executable, "-c", _RECEIVER, address(j)],
                             stdout=subprocess.PIPE, text=True) for j, ns in enumerate(names)]
    try:
        for r in recv:
            r.stdout.readline()
        out = []
        for j in range(1, len(names)):
            res = subprocess.run(netns(names[0]) + [sys.executable, "-c", _SENDER, address(j),
                                                    str(mib)], capture_output=True, text=True, check=True)
            secs = float(res.stdout.strip())
            out.append({"to": j, "hops": hops(0, j, dims), "seconds": secs,
                        "gbit_s": mib * 8 * 2 ** 20 / secs / 1e9})
        return out
    finally:
        for r in recv:
            r.kill()
            r.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="build an emulated torus, check it, remove it")
    p.add_argument("--dims", default="2x2")
    p.add_argument("--link-gbit", type=float, default=1.0)
    p.add_argument("--unshaped", action="store_true", help="leave the veths unshaped")
    p.add_argument("--mib", type=int, default=8, help="MiB sent from node 0 to each node")
    args = p.parse_args(argv)
    dims = parse_dims(args.dims)
    print(f"torus {args.dims}: {math.prod(dims)} nodes, {len(links(dims))} links")
    with emulated_torus(dims, None if args.unshaped else args.link_gbit) as names:
        for r in check(names, dims, args.mib):
            print(f"0 -> {r['to']} ({r['hops']} hops): {args.mib} MiB in {r['seconds']:.3f} s "
                  f"= {r['gbit_s']:.2f} Gbit/s")


if __name__ == "__main__":
    main()
