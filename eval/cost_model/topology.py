"""A link-level model of one AllReduce on a TPU slice (or an emulated torus): the transfers of
each step on each link, and the prefill predictions per topology."""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

from eval import torus
from eval.reports import format_columns
from eval.cost_model.prefill import allreduces_per_prefill
from eval.cost_model.tpu import (INT8_EXTRA_HBM_BYTES_PER_ELEMENT_HOP, PAPER, TPU_V5E, Accelerator,
                                 prefill_flops)


# Link rates, peak figures and the assumptions (which slices wrap, 2 us a step, 50% MFU), with
# their sources: docs/native_kernel.md#cost-model-per-topology-predictions-not-measurements.


@dataclasses.dataclass(frozen=True)
class Topology:
    """Chips on a grid `dims`, one full-duplex link of `link_bytes_s` per direction between
    grid neighbours (and between the ends of an axis when `wrap`); `alpha_s` per step."""

    name: str
    dims: tuple[int, ...]
    wrap: bool
    link_bytes_s: float
    alpha_s: float = 2e-6
    acc: "Accelerator | None" = None

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    def route(self, src: int, dst: int) -> list[tuple[int, int]]:
        """Directed links (u, v) a message from src to dst crosses (dimension order)."""
        return torus.route(src, dst, self.dims, self.wrap)


Transfer = tuple  # (source chip, destination chip, bytes)


def step_link_s(topo: Topology, transfers: Iterable[Transfer], rate: float | None = None
                ) -> float:
    """Seconds the busiest directed link needs for one step's concurrent transfers."""
    load: dict = {}
    for src, dst, nbytes in transfers:
        for link in topo.route(src, dst):
            load[link] = load.get(link, 0.0) + nbytes
    return max(load.values(), default=0.0) / (rate or topo.link_bytes_s)


def steps_time_s(topo: Topology, steps: Sequence[Sequence[Transfer]]) -> float:
    """Sequential steps, each alpha plus its busiest link's time."""
    return sum(topo.alpha_s + step_link_s(topo, s) for s in steps if s)


def ring_order(topo: Topology) -> list[int]:
    """A cycle through every chip, consecutive chips (and the last and the first) grid
    neighbours where the grid allows: the snake order on a torus; on a 2D mesh with an even
    number of rows, rows snake over columns 1.. and column 0 is the way back."""
    dims = topo.dims
    if not topo.wrap and len(dims) == 2 and dims[0] % 2 == 0 and dims[1] > 1 and topo.size > 2:
        rows, cols = dims
        order = []
        for r in range(rows):
            cs = range(1, cols) if r % 2 == 0 else reversed(range(1, cols))
            order += [torus.index((r, c), dims) for c in cs]
        return order + [torus.index((r, 0), dims) for r in reversed(range(rows))]
    return torus.snake_order(dims)


def ring_steps(topo: Topology, order: Sequence[int], n_elements: float, width: float,
               bidirectional: bool = True) -> list[list[Transfer]]:
    """A ring AllReduce (RS then AG, N-1 hops each) over `order`: every hop every chip sends
    its shard (width bytes a value) to the next chip, or half of it each way."""
    n = len(order)
    if n < 2:
        return []
    shard = n_elements / n * width
    dirs = (+1, -1) if bidirectional and n > 2 else (+1,)
    hop = [(order[i], order[(i + s) % n], shard / len(dirs)) for i in range(n) for s in dirs]
    return [list(hop) for _ in range(2 * (n - 1))]


def multi_axis_steps(topo: Topology, n_elements: float, width: float
                     ) -> list[list[Transfer]]:
    """equarx.multi_axis's schedule with full-loop (both directions) rings on every axis: the
    message cut into k parts (k axes larger than 1), part p reduce-scattering along the axes in
    the order rotated to start at axis p, so the k parts use k different axes at every stage;
    the all-gather mirrors it. Parts move in lockstep (hop j of a stage: every part with a
    j-th hop sends), exact when the axes are equally long."""
    axes = [a for a, d in enumerate(topo.dims) if d > 1]
    k = len(axes)
    if k == 0:
        return []
    part = n_elements / k
    stages = []  # per stage: [(axis, buffer elements before the stage)] for each part
    for t in range(k):
        stage = []
        for p in range(k):
            order = [axes[(p + s) % k] for s in range(k)]
            before = part / math.prod(topo.dims[order[s]] for s in range(t))
            stage.append((order[t], before))
        stages.append(stage)
    rs = []
    for stage in stages:
        for j in range(max(topo.dims[a] - 1 for a, _ in stage)):
            step = []
            for a, buf in stage:
                n = topo.dims[a]
                if j >= n - 1:
                    continue
                dirs = (+1, -1) if n > 2 else (+1,)
                for i in range(topo.size):
                    for s in dirs:
                        step.append((i, torus.neighbour(i, topo.dims, a, s),
                                     buf / n * width / len(dirs)))
            rs.append(step)
    return rs + rs[::-1]


def rs_element_hops(topo: Topology, n_elements: float, method: str) -> float:
    """Values each chip dequantizes, adds and re-quantizes in the reduce-scatter (the int8
    ring's extra HBM work): (N-1)/N of the message for a 1D ring and, the stages'
    sum telescoping, for the multi-axis schedule too."""
    if method == "multi-axis":
        axes = [d for d in topo.dims if d > 1]
        k = len(axes)
        total = 0.0
        for p in range(k):
            buf = n_elements / k
            for t in range(k):
                n = axes[(p + t) % k]
                total += (n - 1) / n * buf
                buf /= n
        return total
    return (topo.size - 1) / topo.size * n_elements


# The default codec as the TPU kernel moves it (equarx.pallas_codecs): int8 and a bfloat16 scale
# per 32 values. (The ppermute form packs the same scale in a byte per run and a byte per row,
# wire_bytes_per_value: 1 + 1/32 + 1/W; the kernel does not yet.)
INT8_WIRE_BYTES = 1.0 + 2.0 / 32

# method: (schedule, bytes per value). "xla-bf16" is XLA's all-reduce modelled as the best
# schedule the torus allows (every axis, both directions: the multi-axis one) in bf16, or the
# 1D bidirectional ring where that is faster (topology_allreduce_s).
TOPOLOGY_METHODS = {
    "xla-bf16": ("multi-axis", 2.0),
    "bf16-ring-1d": ("ring-bidi", 2.0),
    "int8-1d-uni": ("ring-uni", INT8_WIRE_BYTES),
    "int8-1d-bidi": ("ring-bidi", INT8_WIRE_BYTES),
    "int8-multi-axis": ("multi-axis", INT8_WIRE_BYTES),
}


def topology_steps(topo: Topology, method: str, n_elements: float) -> list[list[Transfer]]:
    schedule, width = TOPOLOGY_METHODS[method]
    if schedule == "multi-axis":
        return multi_axis_steps(topo, n_elements, width)
    return ring_steps(topo, ring_order(topo), n_elements, width,
                      bidirectional=schedule == "ring-bidi")


def topology_allreduce_s(topo: Topology, method: str, n_elements: float) -> float:
    """Seconds of link time (alpha per step included) of one AllReduce of n_elements values.
    XLA's bf16 all-reduce is given the better of the multi-axis schedule and the 1D
    bidirectional ring (on a mesh an axis of 4 is a line, where a ring runs at half a torus
    axis' rate, and a Hamiltonian 1D ring can be the better choice: 2x4)."""
    t = steps_time_s(topo, topology_steps(topo, method, n_elements))
    if method == "xla-bf16":
        t = min(t, steps_time_s(topo, topology_steps(topo, "bf16-ring-1d", n_elements)))
    return t


TPU_V6E = Accelerator(
    name="TPU v6e", peak_flops=918e12, hbm_bytes_s=1638e9, link_bytes_s=800e9 / 4 / 2,
    ring_links=2, alpha_s=2e-6, mfu=0.5,
    source="Google Cloud's TPU v6e page: 918 TFLOP/s bf16, 1638 GB/s HBM, 800 GB/s "
           "bidirectional ICI per chip over 4 ports (100 GB/s per link and direction)")
TPU_V5P = Accelerator(
    name="TPU v5p", peak_flops=459e12, hbm_bytes_s=2765e9, link_bytes_s=1200e9 / 6 / 2,
    ring_links=2, alpha_s=2e-6, mfu=0.5,
    source="Google Cloud's TPU v5p page: 459 TFLOP/s bf16, 2765 GB/s HBM, 1200 GB/s "
           "bidirectional ICI per chip, 3D torus (6 links: 100 GB/s per link and direction)")


def tpu_topology(acc: Accelerator, dims: tuple[int, ...], wrap: bool) -> Topology:
    name = f"{acc.name.removeprefix('TPU ')} {'x'.join(map(str, dims))}"
    return Topology(name + (" torus" if wrap else " mesh"), tuple(dims), wrap,
                    acc.link_bytes_s, acc.alpha_s, acc)


TOPOLOGIES = {
    "v5e-2x2": tpu_topology(TPU_V5E, (2, 2), wrap=False),
    "v5e-2x4": tpu_topology(TPU_V5E, (2, 4), wrap=False),
    "v5e-4x4": tpu_topology(TPU_V5E, (4, 4), wrap=False),
    "v6e-4x4": tpu_topology(TPU_V6E, (4, 4), wrap=False),
    "v5p-4x4x4": tpu_topology(TPU_V5P, (4, 4, 4), wrap=True),
}


def predict_topology(cfg, topo: Topology, tokens: int, method: str) -> dict:
    """Predicted prefill ms of `cfg` at tp = topo.size: compute (as predict_accelerator),
    2 x layers AllReduces of tokens x d_model values, and for int8 the extra HBM traffic of the
    reduce-scatter (quant_ms, reported apart: hidden or not)."""
    acc = topo.acc or TPU_V5E
    tp = topo.size
    compute = prefill_flops(cfg, tokens) / tp / (acc.peak_flops * acc.mfu)
    n_el = tokens * cfg.d_model
    n_ar = allreduces_per_prefill(cfg.num_layers)
    comm = n_ar * topology_allreduce_s(topo, method, n_el)
    quant = 0.0
    if method.startswith("int8"):
        schedule = TOPOLOGY_METHODS[method][0]
        quant = n_ar * rs_element_hops(topo, n_el, schedule) \
            * INT8_EXTRA_HBM_BYTES_PER_ELEMENT_HOP / acc.hbm_bytes_s
    return {"topology": topo.name, "tp": tp, "tokens": tokens, "method": method,
            "compute_ms": compute * 1e3, "comm_ms": comm * 1e3, "quant_ms": quant * 1e3,
            "total_ms": (compute + comm) * 1e3}


TOPOLOGY_CASES = [("12b", "v5e-2x2"), ("27b", "v5e-2x4"), ("27b", "v5e-4x4"),
                  ("27b", "v6e-4x4"), ("27b", "v5p-4x4x4")]


def topology_predictions(tokens: Sequence[int] = (2048, 4096, 8192),
                         cases=TOPOLOGY_CASES) -> list[dict]:
    """Per (model, topology, tokens): every method's predicted prefill and its speedup over
    XLA's bf16 all-reduce, with the paper's measured speedup where it has one (v5e 2x2, 4x4)."""
    from models.gemma3 import get_config

    paper = {("27b", 16): PAPER[("27b", 16, "int8-semi+tile")],
             ("12b", 4): PAPER[("12b", 4, "int8-full+tile")]}
    out = []
    for size, key in cases:
        cfg, topo = get_config(size), TOPOLOGIES[key]
        for t in tokens:
            base = predict_topology(cfg, topo, t, "xla-bf16")
            msg = t * cfg.d_model
            row = {"model": cfg.name, "topology": key, "tp": topo.size, "tokens": t,
                   "compute_ms": base["compute_ms"],
                   "paper_speedup": paper.get((size, topo.size), {}).get(t)
                   if key.startswith("v5e") else None}
            for m in TOPOLOGY_METHODS:
                p = predict_topology(cfg, topo, t, m)
                row[m] = {"total_ms": p["total_ms"], "comm_ms": p["comm_ms"],
                          "quant_ms": p["quant_ms"],
                          "allreduce_us": 1e6 * topology_allreduce_s(topo, m, msg),
                          "speedup": base["total_ms"] / p["total_ms"],
                          "speedup_quant_exposed":
                              base["total_ms"] / (p["total_ms"] + p["quant_ms"])}
            out.append(row)
    return out


def format_topology_predictions(rows: list[dict]) -> str:
    methods = list(TOPOLOGY_METHODS)
    key = [("model", "<11", lambda r: r["model"]), ("topology", "<10", lambda r: r["topology"]),
           ("tp", ">3", lambda r: r["tp"]), ("tokens", ">6", lambda r: r["tokens"])]
    base = lambda r: r["xla-bf16"]  # noqa: E731
    return "\n".join([
        "# PREDICTIONS from the link-level cost model (not measurements). Link rates: v5e the JAX "
        "scaling book's 45 GB/s a link and direction, v6e/v5p Google Cloud TPU docs (bidirectional "
        "ICI per chip / ports / 2); assumed: 2 us a step, 50% MFU, v5e/v6e slices under 16x16 "
        "without wraparound (meshes), the v5p cube a torus; XLA's bf16 all-reduce = the better of "
        "the multi-axis schedule (every axis, both directions) and the 1D bidirectional ring, in "
        "bf16. Speedup: XLA bf16 prefill / method's prefill (in brackets: int8's extra HBM "
        "traffic not hidden).", "# one AllReduce of tokens x d_model bf16 values, microseconds:",
        format_columns(rows, key + [(m, ">15", lambda r, m=m: f"{r[m]['allreduce_us']:.1f}")
                                    for m in methods]),
        "", "# prefill: XLA bf16 ms (comm share), then each method's predicted speedup:",
        format_columns(rows, key + [
            ("bf16 ms", ">8", lambda r: f"{base(r)['total_ms']:.1f}"),
            ("comm", ">5", lambda r: f"{100 * base(r)['comm_ms'] / base(r)['total_ms']:.0f}%")] + [
            (m, ">15", lambda r, m=m: f"{r[m]['speedup']:.3f}x" + (
                f" [{r[m]['speedup_quant_exposed']:.2f}]" if m.startswith("int8") else ""))
            for m in methods[1:]] + [
            ("paper", ">6", lambda r: f"{r['paper_speedup']:.2f}x" if r["paper_speedup"] else "-")])])
