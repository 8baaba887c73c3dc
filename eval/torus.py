"""An emulated torus (or ring) of CPU processes: one network namespace per process, one shaped
veth link per neighbour, routes so that neighbour traffic takes its own link.

eval.multiproc's plain mode puts every process in one namespace whose loopback is shaped: one
token bucket shared by all traffic, which is a bus, not a torus. Here process i of a torus of
`dims` (row-major coordinates) lives in namespace NAME-i with address 10.99.0.(i+1) on its
loopback, and for every torus neighbour j a veth pair i <-> j whose two ends are each shaped
(egress, `tc tbf`) to the link rate: a full-duplex link per neighbour, as a TPU chip has an ICI
link per torus neighbour. Routes:
  - a neighbour's address goes out of the veth to it (source address the node's own);
  - any other address is routed dimension by dimension (first differing axis, shorter way
    round), through the neighbours, which forward (ip_forward=1), so a two-hop message loads
    two links, as it would on a torus.
A ring is the torus of one axis (`dims=(n,)`). An axis of size 2 gives one neighbour (its +1
and -1 are the same device) and one link, as on a 2x2 TPU slice.

gloo binds the address its host name resolves to, so each namespace gets an /etc/netns/NAME/hosts
(bind-mounted over /etc/hosts by `ip netns exec`) that maps the host name to the node's address.

Needs root, `ip` and `tc`; everything is removed afterwards. Check a torus by hand:
    python -m eval.torus --dims 2x2 --link-gbit 1
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from typing import Iterator


def parse_dims(text: str) -> tuple[int, ...]:
    """'2x2' -> (2, 2); '4' -> (4,)."""
    dims = tuple(int(v) for v in text.lower().split("x"))
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"bad torus dimensions {text!r}")
    return dims


def coords(i: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(dims):
        out.append(i % d)
        i //= d
    return tuple(reversed(out))


def index(c: tuple[int, ...], dims: tuple[int, ...]) -> int:
    i = 0
    for v, d in zip(c, dims):
        i = i * d + v
    return i


def neighbours(i: int, dims: tuple[int, ...]) -> list[int]:
    """Node i's torus neighbours (each once), axis by axis, +1 before -1."""
    c = coords(i, dims)
    out = []
    for a, d in enumerate(dims):
        for step in (1, -1):
            if d == 1:
                continue
            j = index(c[:a] + ((c[a] + step) % d,) + c[a + 1:], dims)
            if j != i and j not in out:
                out.append(j)
    return out


def links(dims: tuple[int, ...]) -> list[tuple[int, int]]:
    n = math.prod(dims)
    return sorted({(min(i, j), max(i, j)) for i in range(n) for j in neighbours(i, dims)})


def next_hop(i: int, dst: int, dims: tuple[int, ...]) -> int:
    """Dimension-order routing: move along the first differing axis, the shorter way round."""
    a_c, b_c = coords(i, dims), coords(dst, dims)
    for a, d in enumerate(dims):
        if a_c[a] != b_c[a]:
            fwd = (b_c[a] - a_c[a]) % d
            step = 1 if fwd <= d - fwd else -1
            return index(a_c[:a] + ((a_c[a] + step) % d,) + a_c[a + 1:], dims)
    raise ValueError("no hop to oneself")


def hops(i: int, dst: int, dims: tuple[int, ...]) -> int:
    n = 0
    while i != dst:
        i, n = next_hop(i, dst, dims), n + 1
    return n


def snake_order(dims: tuple[int, ...]) -> list[int]:
    """A ring through every node of a 2D torus in which consecutive nodes (and the last and the
    first) are neighbours: rows left to right and right to left in turn (boustrophedon). For an
    even number of rows the last node is the first one's neighbour."""
    if len(dims) == 1:
        return list(range(dims[0]))
    if len(dims) != 2:
        raise ValueError("snake order is defined here for 1 or 2 axes")
    rows, cols = dims
    order = []
    for r in range(rows):
        cs = range(cols) if r % 2 == 0 else reversed(range(cols))
        order += [index((r, c), dims) for c in cs]
    return order


def address(i: int) -> str:
    return f"10.99.{(i + 1) // 256}.{(i + 1) % 256}"


@dataclasses.dataclass(frozen=True)
class Torus:
    dims: tuple[int, ...]
    link_gbit: float | None  # None: unshaped veths
    namespaces: tuple[str, ...]

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program as node i."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def address(self, i: int) -> str:
        return address(i)


def _sh(*cmd: str, ns: str | None = None) -> None:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    subprocess.run(full, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def emulated_torus(dims: tuple[int, ...], link_gbit: float | None, *, burst: str = "256kb",
                   latency: str = "50ms", sysctls: dict[str, str] | None = None
                   ) -> Iterator[Torus]:
    """Build the torus, yield it, tear it down (namespaces, veths, hosts files). link_gbit None
    leaves the veths unshaped: the same processes, routes and per-message costs without the link
    rate (what eval.cost_model --emulated adds its link term to)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise RuntimeError("an emulated torus needs root and the `ip` and `tc` tools")
    if link_gbit is not None and link_gbit <= 0:
        raise ValueError(f"link_gbit must be positive, got {link_gbit}")
    n = math.prod(dims)
    # SIGTERM (timeout, kill) would end the process without the `finally` below and leave the
    # namespaces behind: turn it into SystemExit while the torus exists.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    tag = uuid.uuid4().hex[:6]
    names = tuple(f"tor-{tag}-{i}" for i in range(n))
    host = socket.gethostname()
    made: list[str] = []
    try:
        for i, ns in enumerate(names):
            subprocess.run(["ip", "netns", "add", ns], check=True)
            made.append(ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{address(i)} {host}\n")
            _sh("ip", "link", "set", "lo", "up", ns=ns)
            _sh("ip", "addr", "add", f"{address(i)}/32", "dev", "lo", ns=ns)
            for key, value in {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0",
                               "net.ipv4.conf.default.rp_filter": "0",
                               **(sysctls or {})}.items():
                _sh("sysctl", "-q", "-w", f"{key}={value}", ns=ns)
        for i, j in links(dims):
            a, b = f"t{tag}{i}-{j}", f"t{tag}{j}-{i}"
            subprocess.run(["ip", "link", "add", a, "netns", names[i], "type", "veth", "peer",
                            "name", b, "netns", names[j]], check=True)
            for ns, dev in ((names[i], a), (names[j], b)):
                _sh("ip", "link", "set", dev, "up", ns=ns)
                _sh("sysctl", "-q", "-w", f"net.ipv4.conf.{dev}.rp_filter=0", ns=ns)
                if link_gbit is not None:
                    _sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                        f"{link_gbit}gbit", "burst", burst, "latency", latency, ns=ns)
        for i in range(n):
            for dst in range(n):
                if dst == i:
                    continue
                hop = next_hop(i, dst, dims)
                dev = f"t{tag}{i}-{hop}"
                if hop == dst:
                    _sh("ip", "route", "add", f"{address(dst)}/32", "dev", dev, "src",
                        address(i), ns=names[i])
                else:
                    _sh("ip", "route", "add", f"{address(dst)}/32", "via", address(hop), "dev",
                        dev, "onlink", "src", address(i), ns=names[i])
        yield Torus(tuple(dims), link_gbit, names)
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def describe(dims: tuple[int, ...]) -> str:
    n = math.prod(dims)
    lines = [f"torus {'x'.join(map(str, dims))}: {n} nodes, {len(links(dims))} links"]
    for i in range(n):
        far = {dst: hops(i, dst, dims) for dst in range(n) if dst != i}
        lines.append(f"  node {i} {coords(i, dims)} {address(i)}: neighbours "
                     f"{neighbours(i, dims)}, hops {far}")
    return "\n".join(lines)


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


def check(torus: Torus, mib: int = 8) -> list[dict]:
    """Send `mib` MiB from node 0 to every other node, one at a time, and time it: a neighbour
    gets about the link rate, a node two hops away too (two links in series)."""
    import sys

    recv = [subprocess.Popen(torus.prefix(j) + [sys.executable, "-c", _RECEIVER, address(j)],
                             stdout=subprocess.PIPE, text=True) for j in range(torus.size)]
    try:
        for r in recv:
            r.stdout.readline()
        out = []
        for j in range(1, torus.size):
            res = subprocess.run(torus.prefix(0) + [sys.executable, "-c", _SENDER, address(j),
                                                    str(mib)],
                                 capture_output=True, text=True, check=True)
            secs = float(res.stdout.strip())
            out.append({"to": j, "hops": hops(0, j, torus.dims), "seconds": secs,
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
    print(describe(dims))
    with emulated_torus(dims, None if args.unshaped else args.link_gbit) as torus:
        for j in range(1, torus.size):
            route = subprocess.run(torus.prefix(0) + ["ip", "route", "get", address(j)],
                                   capture_output=True, text=True).stdout.split("\n")[0]
            print(f"0 -> {j}: {route.strip()}")
        for r in check(torus, args.mib):
            print(f"0 -> {r['to']} ({r['hops']} hops): {args.mib} MiB in {r['seconds']:.3f} s "
                  f"= {r['gbit_s']:.2f} Gbit/s")


if __name__ == "__main__":
    main()
