"""An alpha-beta cost model of tensor-parallel prefill with each AllReduce method.

Per AllReduce:  t_comm = alpha x messages + beta x bytes on the medium (+ the method's
quantization compute, measured, not modelled). Per prefill:

    T(method, link) = T_nolink(method) + n_allreduce x t_comm(method, message, link)

where T_nolink is the same program measured in one process with virtual devices (there a
collective is a memcpy, so that time is the model's compute plus the quantization compute of
the method) and the link is described by three numbers fitted from collective-only
measurements (`fit_link`):
  alpha         seconds per message each device sends (collective-permute, or psum step),
  efficiency    achieved fraction of the nominal link rate for the ring's traffic,
  psum_penalty  extra factor on the bytes of XLA's own bf16 psum. On gloo bfloat16 moves at
                about half the bytes/s of other dtypes; on TPU this factor is 1.

`shared=True` describes the shaped loopback used for emulation: every device's bytes go through
one token bucket, so the medium carries N x bytes_per_device. A TPU ring has its own links per
device (`shared=False`).

The same model with TPU v5e published figures (`TPU_V5E`) predicts the paper's Gemma 3 prefill
configurations; those are predictions, and the assumptions they rest on are printed with them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

from equarx import plan_for, plan_layout, resolved_variant
from equarx.config import QUANTIZED
from equarx.codec_spec import wire_bytes_per_value
from equarx.quantize import SCALE_ROWS, TILE_ELEMENTS
from eval.quality import mode_config

# ---------------------------------------------------------------------------------------------
# What each method sends


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One AllReduce as seen by one device: how many messages it sends (one collective-permute
    each, or one psum step), how many of those follow one another when concurrent chains overlap
    (`steps`), and how many bytes it sends in total. `xla_psum` marks XLA's own psum."""

    messages: int
    steps: int
    bytes_per_device: float
    xla_psum: bool = False


def ring_hops(variant: str, n_devices: int) -> tuple[int, int]:
    """(sequential hops of one phase, sum of the hops of all chains of one phase)."""
    n = n_devices
    if variant == "full":
        return n - 1, n - 1  # two concurrent chains, each with half the minishards
    left = (n - 1) // 2
    right = n - 1 - left
    return right, right + left  # two chains, every minishard on both


def allreduce_schedule(label: str, n_elements: int, n_devices: int, minishards: int = 4,
                       dtype_bytes: int = 2, pipelined: bool = True,
                       topology: str | None = None) -> Schedule:
    """What one device sends for one AllReduce of `n_elements` values of `dtype_bytes` bytes.

    Mirrors equarx's layout (padding to shards x minishards x 8x128 tiles, float32 scales per
    minishard) and messages (pipelined: one collective-permute per minishard per chain and hop;
    else one per chain and hop); XLA's psum is counted as a bandwidth-optimal ring of 2 (N-1)
    steps, as equarx's accounting does.
    """
    if n_elements < 1 or n_devices < 1:
        raise ValueError(f"need n_elements >= 1 and n_devices >= 1, got {n_elements}, {n_devices}")
    n = n_devices
    if n == 1:
        return Schedule(0, 0, 0.0)
    cfg = mode_config(label)  # None: the naive strawman
    if cfg is None:  # all-gather of int8 values plus one float32 scale per device
        return Schedule(n - 1, n - 1, (n - 1) * (n_elements + 4))
    method, variant, phases = cfg.method, cfg.variant, cfg.phases
    if method in ("f32", "bf16"):
        width = 4 if method == "f32" else 2
        steps = 2 * (n - 1)
        return Schedule(steps, steps, 2 * (n - 1) / n * n_elements * width, xla_psum=True)
    cfg = dataclasses.replace(cfg, minishards=minishards, pipelined=pipelined,
                              topology=topology or cfg.topology)
    variant = resolved_variant(cfg, n, n_elements * dtype_bytes)
    if method == "bf16_ring" or cfg.blocks == "group":
        return _token_schedule(cfg, variant, n_elements, n, dtype_bytes)
    layout = plan_layout(n_elements, n, minishards)
    m, k = layout.minishards, layout.tiles
    seq_hops, all_hops = ring_hops(variant, n)
    if cfg.blocks == "hadamard":  # a float32 scale per 128 values
        int8_bytes = k * (TILE_ELEMENTS + TILE_ELEMENTS // 32)
    else:
        int8_bytes = (k + SCALE_ROWS) * TILE_ELEMENTS  # payload rows + 4 rows of scale bytes
    plain_bytes = k * TILE_ELEMENTS * (2 if method == "bf16_ring" else dtype_bytes)

    def phase(quantized: bool) -> float:
        return all_hops * m * (int8_bytes if quantized else plain_bytes)

    if method == "bf16_ring":
        total = 2 * phase(False)
    else:
        total = phase(phases in ("both", "rs")) + phase(phases in ("both", "ag"))
    if variant == "semi":  # every chain carries every minishard
        messages = 2 * all_hops * (m if pipelined else 1)
    else:  # two chains (one if m == 1) share the minishards
        messages = 2 * seq_hops * (m if pipelined else min(m, 2))
    return Schedule(messages, 2 * seq_hops, total)


def _token_schedule(cfg, variant: str, n_elements: int, n: int, dtype_bytes: int) -> Schedule:
    """The token layout's sends (equarx.layout.TokenLayout, one row of n_elements values: the
    column padding of a real [tokens, d_model] message is at most a group per shard and row)."""
    layout = plan_for(cfg, (n_elements,), n, variant)
    shard = layout.padded_elements / n
    pieces = layout.pieces if cfg.pipelined else 1
    if cfg.method == "bf16_ring":
        rs_width = ag_width = 2.0
    else:
        quantized = wire_bytes_per_value(cfg.group_size, cfg.method, layout.width)
        rs_width = quantized if cfg.phases in ("both", "rs") else dtype_bytes
        ag_width = quantized if cfg.phases in ("both", "ag") else dtype_bytes
    total = (n - 1) * shard * (rs_width + ag_width)
    if variant == "twoshot":  # N-1 direct sends per phase, all at once
        return Schedule(2 * (n - 1) * pieces, 2, total)
    seq_hops, all_hops = ring_hops(variant, n)
    if variant == "semi":
        return Schedule(2 * all_hops * pieces, 2 * seq_hops, total)
    return Schedule(2 * seq_hops * (pieces if cfg.pipelined else min(layout.pieces, 2)),
                    2 * seq_hops, total)


# ---------------------------------------------------------------------------------------------
# The link


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """alpha-beta model of one medium. rate_bytes_s: nominal rate; see the module docstring.

    per_step: charge alpha per sequential step (asynchronous collectives whose concurrent
    chains overlap, as on TPU) instead of per message (gloo runs them one by one)."""

    alpha_s: float
    rate_bytes_s: float
    efficiency: float = 1.0
    psum_penalty: float = 1.0
    shared: bool = False
    per_step: bool = False

    def comm_time(self, s: Schedule, n_devices: int) -> float:
        """Seconds one AllReduce spends on the link (compute excluded)."""
        on_medium = s.bytes_per_device * (n_devices if self.shared else 1)
        penalty = self.psum_penalty if s.xla_psum else 1.0
        latency = self.alpha_s * (s.steps if self.per_step else s.messages)
        return latency + on_medium * penalty / (self.rate_bytes_s * self.efficiency)


def gbit_to_bytes_s(gbit: float) -> float:
    return gbit * 1e9 / 8


@dataclasses.dataclass(frozen=True)
class Fit:
    alpha_s: float
    efficiency: float
    psum_penalty: float
    r2: float
    n_points: int
    max_rel_error: float

    def link(self, gbit: float, shared: bool = True) -> LinkModel:
        return LinkModel(self.alpha_s, gbit_to_bytes_s(gbit), self.efficiency,
                         self.psum_penalty, shared)

    def describe(self) -> str:
        return (f"alpha = {self.alpha_s * 1e6:.1f} us/message, link efficiency = "
                f"{self.efficiency:.3f} of nominal, XLA bf16 psum byte penalty = "
                f"{self.psum_penalty:.2f}x; R^2 = {self.r2:.4f} over {self.n_points} points, "
                f"max |relative error| = {self.max_rel_error:.1%}")


@dataclasses.dataclass(frozen=True)
class CommSample:
    """One measured AllReduce: method label, message elements (bf16), devices, link Gbit/s,
    and the seconds it spent communicating (multi-process time minus one-process time)."""

    label: str
    n_elements: int
    n_devices: int
    link_gbit: float
    comm_s: float
    minishards: int = 4
    pipelined: bool = True


def fit_link(samples: Sequence[CommSample], shared: bool = True) -> Fit:
    """Least-squares fit of alpha, 1/efficiency and the psum penalty to measured samples.

    Linear in the unknowns: t = alpha x messages + g_ring x bytes/rate [ring] + g_psum x
    bytes/rate [XLA psum]; efficiency = 1/g_ring, penalty = g_psum/g_ring. Residuals are
    weighted by 1/t, so small and large messages count alike (relative error).
    """
    import numpy as np

    if len(samples) < 3:
        raise ValueError(f"need at least 3 samples to fit 3 parameters, got {len(samples)}")
    rows, target = [], []
    for smp in samples:
        s = allreduce_schedule(smp.label, smp.n_elements, smp.n_devices, smp.minishards,
                               pipelined=smp.pipelined)
        per_byte = s.bytes_per_device * (smp.n_devices if shared else 1) / gbit_to_bytes_s(
            smp.link_gbit)
        rows.append([s.messages, 0.0 if s.xla_psum else per_byte, per_byte if s.xla_psum else 0.0])
        target.append(smp.comm_s)
    a, t = np.array(rows, float), np.array(target, float)
    has_psum = bool(a[:, 2].any())
    has_ring = bool(a[:, 1].any())
    if not has_ring:
        raise ValueError("need at least one ring (bf16_ring or int8) sample")
    cols = [0, 1, 2] if has_psum else [0, 1]
    w = 1.0 / np.maximum(np.abs(t), 1e-9)
    coef, *_ = np.linalg.lstsq(a[:, cols] * w[:, None], t * w, rcond=None)
    coef = dict(zip(cols, coef))
    pred = a[:, cols] @ np.array([coef[c] for c in cols])
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2)) or 1.0
    g_ring = coef[1]
    if g_ring <= 0:
        raise ValueError("fit gave a non-positive byte cost: samples do not depend on bytes")
    return Fit(alpha_s=max(float(coef[0]), 0.0), efficiency=1.0 / g_ring,
               psum_penalty=(coef[2] / g_ring) if has_psum else 1.0, r2=1.0 - ss_res / ss_tot,
               n_points=len(samples),
               max_rel_error=float(np.max(np.abs(pred - t) / np.maximum(np.abs(t), 1e-12))))


# ---------------------------------------------------------------------------------------------
# Prefill


def allreduces_per_prefill(num_layers: int) -> int:
    """Two per layer: after the attention output projection and after the MLP down projection."""
    return 2 * num_layers


def predict_prefill_s(nolink_s: float, label: str, *, tokens: int, d_model: int, num_layers: int,
                      n_devices: int, link: LinkModel, minishards: int = 4,
                      embed_psum: bool = True, pipelined: bool = True,
                      base_link: LinkModel | None = None) -> float:
    """Prefill seconds on `link`: measured no-link time plus the modelled communication.

    embed_psum: the model's vocabulary-parallel embedding lookup ends with one exact XLA psum
    of the same [tokens, d_model] shape, in every method's program.
    base_link: `nolink_s` was measured on this link rather than without one; its modelled
    communication is taken out.
    """
    s = allreduce_schedule(label, tokens * d_model, n_devices, minishards, pipelined=pipelined)
    embed = allreduce_schedule("bf16", tokens * d_model, n_devices)

    def comm(lk: LinkModel) -> float:
        t = allreduces_per_prefill(num_layers) * lk.comm_time(s, n_devices)
        if embed_psum and n_devices > 1:
            t += lk.comm_time(embed, n_devices)
        return t

    return nolink_s + comm(link) - (comm(base_link) if base_link is not None else 0.0)


def link_for_comm_share(share: float, nolink_s: float, label: str, *, tokens: int, d_model: int,
                        num_layers: int, n_devices: int, fit: "Fit", minishards: int = 4,
                        pipelined: bool = True) -> float:
    """The link rate (Gbit/s, shared loopback) at which communication is `share` of the
    predicted prefill time of `label`: solves comm / (nolink + comm) = share for the rate."""
    if not 0 < share < 1:
        raise ValueError(f"share must be in (0, 1), got {share}")
    want = share / (1 - share) * nolink_s  # seconds of communication
    fast, slow = fit.link(1e6), fit.link(1.0)  # latency only / latency + 1 Gbit/s of bytes
    kw = dict(tokens=tokens, d_model=d_model, num_layers=num_layers, n_devices=n_devices,
              minishards=minishards, pipelined=pipelined)
    latency = predict_prefill_s(0.0, label, link=fast, **kw)
    per_gbit = predict_prefill_s(0.0, label, link=slow, **kw) - latency  # seconds x Gbit/s
    if want <= latency:
        raise ValueError("latency alone exceeds that share: no link rate gives it")
    return per_gbit / (want - latency)


def predict_rows(rows: Iterable[dict], nolink_ms: dict, fit: Fit, link_gbit: float, *,
                 d_model: int, num_layers: int, minishards: int = 4,
                 pipelined: bool = True, baseline: str = "bf16",
                 base_gbit: float | None = None) -> list[dict]:
    """Add predicted_ms and predicted_speedup_vs_bf16 to benchmark rows.

    nolink_ms maps (length, batch, method) to the one-process median of the same program, or
    with base_gbit to the median of the same program on a link of that rate.
    An AllReduce carries batch x bucket (the padded length) x d_model values.
    """
    link = fit.link(link_gbit, shared=True)
    base_link = fit.link(base_gbit, shared=True) if base_gbit is not None else None
    out = []
    pred_ms = {}
    rows = list(rows)
    for r in rows:
        key = (r["length"], r["batch"], r["method"])
        if key in nolink_ms:
            tokens = r.get("bucket", r["length"]) * r["batch"]
            pred_ms[key] = 1e3 * predict_prefill_s(
                nolink_ms[key] / 1e3, r["method"], tokens=tokens, d_model=d_model,
                num_layers=num_layers, n_devices=r["tp"], link=link, minishards=minishards,
                pipelined=pipelined, base_link=base_link)
    for r in rows:
        r = dict(r)
        key = (r["length"], r["batch"], r["method"])
        base = pred_ms.get((r["length"], r["batch"], baseline))
        r["predicted_ms"] = pred_ms.get(key)
        r["predicted_speedup_vs_bf16"] = (base / pred_ms[key]) if key in pred_ms and base else None
        out.append(r)
    return out


# ---------------------------------------------------------------------------------------------
# TPU v5e predictions


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float          # bf16 FLOP/s per chip
    hbm_bytes_s: float         # HBM bandwidth per chip
    link_bytes_s: float        # one ICI link, one direction
    ring_links: int            # links a bidirectional ring drives out of each chip at once
    alpha_s: float             # latency of one sequential ring step (assumed)
    mfu: float                 # achieved fraction of peak for the prefill matmuls (assumed)
    source: str


TPU_V5E = Accelerator(
    name="TPU v5e", peak_flops=197e12, hbm_bytes_s=819e9,
    # 1,600 Gbit/s of ICI per chip over 4 links (2D torus): 400 Gbit/s = 50 GB/s a link.
    link_bytes_s=1600e9 / 8 / 4, ring_links=2, alpha_s=2e-6, mfu=0.5,
    source="figures from Google Cloud's TPU v5e system architecture page: 197 TFLOP/s bf16 and "
           "819 GB/s HBM per chip, 1,600 Gbit/s ICI per chip over 4 links of a 2D torus (taken "
           "as 50 GB/s per link and direction, a bidirectional ring drives 2); assumed, not "
           "published: 2 us per ring step, 50% MFU for the prefill matmuls")

# HBM bytes per element per reduce-scatter hop that the int8 ring adds over a bf16 ring: the
# float32 partial written by dequantize+add+Qp1 and read back by Qp2 (4 + 4), less the bf16
# bytes saved on the incoming int8 payload and the outgoing one (1 + 1). The all-gather adds
# none (int8 in, bf16 out, once per hop). Whether this traffic hides behind the link
# (the paper's pipelining) is not known, so predictions are given both ways.
INT8_EXTRA_HBM_BYTES_PER_ELEMENT_HOP = 6.0


def prefill_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of a prefill of `tokens` tokens (one sequence), logits of the last token.

    Projections and MLP: 2 x params x tokens. Attention: 4 x T x context x heads x head_dim per
    layer (QK^T and PV), causal: a global layer's average context is T/2, a local layer's is
    bounded by the sliding window.
    """
    d, h, f = cfg.d_model, cfg.head_dim, cfg.ffn_hidden
    per_layer = (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * d * h + 3 * d * f
    total = 2.0 * per_layer * cfg.num_layers * tokens
    for i in range(cfg.num_layers):
        if cfg.is_global(i):
            ctx = (tokens + 1) / 2
        else:
            w = min(cfg.sliding_window, tokens)
            ctx = w - (w * (w - 1) / 2) / tokens  # the first w positions see fewer keys
        total += 4.0 * tokens * ctx * cfg.num_heads * h
    return total + 2.0 * d * cfg.vocab_size


def predict_accelerator(cfg, tp: int, tokens: int, label: str, acc: Accelerator = TPU_V5E,
                        minishards: int = 4) -> dict:
    """Predicted prefill milliseconds on `acc`: compute, communication and the int8 ring's
    extra HBM traffic (`quant_ms`, to be added or not: see INT8_EXTRA_HBM_BYTES...)."""
    compute = prefill_flops(cfg, tokens) / tp / (acc.peak_flops * acc.mfu)
    n_el = tokens * cfg.d_model
    s = allreduce_schedule(label, n_el, tp, minishards, topology="ring")
    link = LinkModel(acc.alpha_s, acc.link_bytes_s * acc.ring_links, per_step=True)
    comm = link.comm_time(s, tp)
    quant = 0.0
    ar = mode_config(label)  # None: the naive strawman
    if ar is not None and ar.method in QUANTIZED and ar.phases in ("both", "rs"):
        variant = resolved_variant(dataclasses.replace(ar, topology="ring"), tp, n_el * 2)
        all_hops = tp - 1 if variant == "twoshot" else ring_hops(variant, tp)[1]
        quant = all_hops * (n_el / tp) * INT8_EXTRA_HBM_BYTES_PER_ELEMENT_HOP / acc.hbm_bytes_s
    n_ar = allreduces_per_prefill(cfg.num_layers)
    return {"tokens": tokens, "tp": tp, "method": label, "compute_ms": compute * 1e3,
            "comm_ms": n_ar * comm * 1e3, "quant_ms": n_ar * quant * 1e3,
            "total_ms": (compute + n_ar * comm) * 1e3}


# The paper's measured speedups (int8 vs bf16 AllReduce, Gemma 3 prefill on TPU v5e). For 12B
# the paper gives "about 1.10x" (full-loop) without a per-length table.
PAPER = {
    ("27b", 16, "int8-semi+tile"): {2048: 1.28, 4096: 1.25, 8192: 1.22},
    ("12b", 4, "int8-full+tile"): {2048: 1.10, 4096: 1.10, 8192: 1.10},
}


def tpu_predictions(acc: Accelerator = TPU_V5E) -> list[dict]:
    """Predicted int8 / bf16 prefill speedups for the paper's configurations, with the paper's."""
    from models.gemma3 import get_config

    out = []
    for (size, tp, label), paper in PAPER.items():
        cfg = get_config(size)
        for tokens, paper_x in paper.items():
            bf16 = predict_accelerator(cfg, tp, tokens, "bf16", acc)
            q = predict_accelerator(cfg, tp, tokens, label, acc)
            out.append({"model": cfg.name, "tp": tp, "tokens": tokens, "method": label,
                        "bf16_ms": bf16["total_ms"], "int8_ms": q["total_ms"],
                        "int8_quant_ms": q["quant_ms"],
                        "comm_share_bf16": bf16["comm_ms"] / bf16["total_ms"],
                        "predicted_speedup": bf16["total_ms"] / q["total_ms"],
                        "predicted_speedup_quant_exposed":
                            bf16["total_ms"] / (q["total_ms"] + q["quant_ms"]),
                        "paper_speedup": paper_x})
    return out


def format_tpu_predictions(rows: list[dict], acc: Accelerator = TPU_V5E) -> str:
    head = (f"{'model':<11} {'tp':>3} {'tokens':>6} {'method':<10} {'bf16 ms':>8} "
            f"{'int8 ms':>8} {'comm %':>7} {'predicted':>10} {'(quant exposed)':>16} "
            f"{'paper':>6}")
    lines = [f"# PREDICTIONS for {acc.name} from the cost model (not measurements).",
             f"# {acc.source}", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<11} {r['tp']:>3} {r['tokens']:>6} {r['method']:<10} "
                     f"{r['bf16_ms']:>8.1f} {r['int8_ms']:>8.1f} "
                     f"{100 * r['comm_share_bf16']:>6.0f}% {r['predicted_speedup']:>9.2f}x "
                     f"{r['predicted_speedup_quant_exposed']:>15.2f}x "
                     f"{r['paper_speedup']:>5.2f}x")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Topologies: a link-level model of one AllReduce on a TPU slice (or an emulated torus)
#
# Published figures (Google Cloud TPU documentation, the "System architecture" tables of
# cloud.google.com/tpu/docs/v5e, /v6e and /v5p, read 2026-11-25):
#   v5e: 197 TFLOP/s bf16, 819 GB/s HBM, 400 GB/s bidirectional ICI per chip, 4 ICI ports,
#        2D torus (a 256-chip pod);
#   v6e: 918 TFLOP/s bf16, 1638 GB/s HBM, 800 GB/s bidirectional ICI per chip, 4 ICI ports,
#        2D torus (a 256-chip pod);
#   v5p: 459 TFLOP/s bf16, 2765 GB/s HBM, 1200 GB/s bidirectional ICI per chip, 3D torus;
#        "all 4x4x4 and larger slices (one cube) have full 3D torus" connectivity.
# Derived (an assumption: the per-chip figure is spread evenly over the ports and the two
# directions): v5e 400 / 4 / 2 = 50 GB/s per link and direction, v6e 100 GB/s, v5p
# 1200 / 6 / 2 = 100 GB/s. (The JAX scaling book quotes 45 GB/s for v5e; equarx.schedule uses
# that rounded figure.) Assumed, not published: wraparound links on v5e/v6e only on a full
# 16-chip axis, so the 2x2, 2x4 and 4x4 slices are meshes (an axis of 4 is a line); the v5p cube
# is a torus. An axis of 2 has one link between its two chips (as eval.torus builds it).


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

    def coords(self, i: int) -> tuple[int, ...]:
        out = []
        for d in reversed(self.dims):
            out.append(i % d)
            i //= d
        return tuple(reversed(out))

    def index(self, c: Sequence[int]) -> int:
        i = 0
        for v, d in zip(c, self.dims):
            i = i * d + v
        return i

    def route(self, src: int, dst: int) -> list[tuple[int, int]]:
        """Directed links (u, v) a message from src to dst crosses: dimension order, the
        shorter way round where the axis wraps (ties: +1), straight along a line otherwise."""
        cur, goal = list(self.coords(src)), self.coords(dst)
        links = []
        for a, d in enumerate(self.dims):
            while cur[a] != goal[a]:
                fwd = (goal[a] - cur[a]) % d
                if self.wrap or d == 2:
                    step = 1 if fwd <= d - fwd else -1
                else:
                    step = 1 if goal[a] > cur[a] else -1
                nxt = list(cur)
                nxt[a] = (cur[a] + step) % d
                links.append((self.index(cur), self.index(nxt)))
                cur = nxt
        return links

    def neighbour(self, i: int, axis: int, step: int) -> int:
        c = list(self.coords(i))
        c[axis] = (c[axis] + step) % self.dims[axis]
        return self.index(c)


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
    neighbours where the grid allows: boustrophedon over the axes on a torus; on a 2D mesh
    with an even number of rows, rows snake over columns 1.. and column 0 is the way back."""
    dims = [d for d in topo.dims]
    if len(dims) == 1 or topo.size <= 2:
        return list(range(topo.size))
    if not topo.wrap and len(dims) == 2 and dims[0] % 2 == 0 and dims[1] > 1:
        rows, cols = dims
        order = []
        for r in range(rows):
            cs = range(1, cols) if r % 2 == 0 else reversed(range(1, cols))
            order += [topo.index((r, c)) for c in cs]
        return order + [topo.index((r, 0)) for r in reversed(range(rows))]

    def snake(shape: list[int]) -> list[tuple[int, ...]]:
        if len(shape) == 1:
            return [(v,) for v in range(shape[0])]
        inner = snake(shape[1:])
        out = []
        for v in range(shape[0]):
            out += [(v,) + c for c in (inner if v % 2 == 0 else inner[::-1])]
        return out

    return [topo.index(c) for c in snake(dims)]


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
                        step.append((i, topo.neighbour(i, a, s), buf / n * width / len(dirs)))
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
    lines = ["# PREDICTIONS from the link-level cost model (not measurements). Link rates: "
             "Google Cloud TPU docs (bidirectional ICI per chip / ports / 2); assumed: 2 us a "
             "step, 50% MFU, v5e/v6e slices under 16x16 without wraparound (meshes), the v5p "
             "cube a torus; XLA's bf16 all-reduce = the better of the multi-axis schedule "
             "(every axis, both directions) and the 1D bidirectional ring, in bf16. Speedup: XLA bf16 prefill / method's prefill (in "
             "brackets: int8's extra HBM traffic not hidden).",
             "# one AllReduce of tokens x d_model bf16 values, microseconds:"]
    head = f"{'model':<11} {'topology':<10} {'tp':>3} {'tokens':>6} " + " ".join(
        f"{m:>15}" for m in methods)
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<11} {r['topology']:<10} {r['tp']:>3} {r['tokens']:>6} "
                     + " ".join(f"{r[m]['allreduce_us']:>15.1f}" for m in methods))
    lines += ["", "# prefill: XLA bf16 ms (comm share), then each method's predicted speedup:"]
    head = (f"{'model':<11} {'topology':<10} {'tp':>3} {'tokens':>6} {'bf16 ms':>8} "
            f"{'comm':>5} " + " ".join(f"{m:>15}" for m in methods[1:]) + f" {'paper':>6}")
    lines += [head, "-" * len(head)]
    for r in rows:
        base = r["xla-bf16"]
        cells = " ".join(f"{r[m]['speedup']:>6.3f}x" + (
            f" [{r[m]['speedup_quant_exposed']:.2f}]" if m.startswith("int8") else " " * 7)
            for m in methods[1:])
        paper = f"{r['paper_speedup']:.2f}x" if r["paper_speedup"] else "-"
        lines.append(f"{r['model']:<11} {r['topology']:<10} {r['tp']:>3} {r['tokens']:>6} "
                     f"{base['total_ms']:>8.1f} {100 * base['comm_ms'] / base['total_ms']:>4.0f}% "
                     f"{cells} {paper:>6}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Calibration against the emulated torus (eval.torus, eval.bench_collective --torus)


def program_transfers(program, partition_to_node: Sequence[int]) -> list[list[Transfer]]:
    """The compiled program's collective-permutes, each as one step of (source chip,
    destination chip, bytes) transfers; partition p of the program runs on chip
    partition_to_node[p]. Other collectives (XLA's psum) are not included."""
    import re

    from equarx import accounting as acc

    steps = []
    for line in acc.hlo_text(program).splitlines():
        found = acc._INSTR.match(line)
        if not found or found.group("op") != "collective-permute":
            continue
        shapes = acc._shapes(found.group("shape"))
        if found.group("start"):
            shapes = shapes[:1]
        size = sum(acc._nbytes(s) for s in shapes)
        pairs = acc._PAIRS.search(line)
        if not pairs:
            continue
        steps.append([(partition_to_node[int(a)], partition_to_node[int(b)], size)
                      for a, b in re.findall(r"\{(\d+),(\d+)\}", "{" + pairs.group(1) + "}")])
    return steps


def emulated_link_terms(methods: Sequence[str], sizes: Sequence[int], dims: tuple[int, ...],
                        minishards: int = 4, pipelined: bool = False,
                        row_width: int = 4096) -> dict:
    """For each (size, method) of an eval.bench_collective --torus run: the collective-permute
    steps of the very program it runs (compiled here on len(dims) virtual devices, device i
    = torus node i), as {"steps": n, "link_bytes": [busiest directed link's bytes per step]}.
    Needs jax with prod(dims) CPU devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from equarx import all_reduce
    from eval.bench_collective import _meshes, parse_method, split_method

    topo = Topology("emulated", tuple(dims), wrap=True, link_bytes_s=1.0)
    kinds = {m: split_method(m)[1] for m in methods}
    meshes = _meshes(list(dict.fromkeys(kinds.values())), tuple(dims))
    out = {}
    for size in sizes:
        n_el = size // 2
        width = row_width if n_el % row_width == 0 else n_el
        for m in methods:
            mesh, axes = meshes[kinds[m]]
            cfg = parse_method(m, minishards, pipelined)
            reduce_over = axes[0] if len(axes) == 1 else axes
            f = jax.jit(jax.shard_map(lambda a, c=cfg, r=reduce_over: all_reduce(a, r, c),
                                      mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
            x = jax.ShapeDtypeStruct((jax.device_count() * (n_el // width), width),
                                     jnp.bfloat16, sharding=NamedSharding(mesh, P(axes)))
            program = f.lower(x).compile()
            nodes = [d.id for d in mesh.devices.flat]
            steps = program_transfers(program, nodes)
            out[(size, m)] = {"steps": len(steps),
                              "link_bytes": [step_link_s(topo, s) for s in steps]}
    return out


def predict_emulated(run: dict, base: dict, terms: dict, alpha_s: float = 0.0,
                     efficiency: float = 1.0) -> list[dict]:
    """Predicted seconds of each row of an eval.bench_collective --torus run: a base term plus,
    for every collective-permute in turn (XLA:CPU runs them one at a time), alpha plus its
    busiest link's bytes at the link rate. The base term is the median of the same method and
    size in `base`, either
      - a one-process run on as many virtual devices (codec compute only: its collectives are
        memcpys; it leaves out gloo's per-message costs and four processes sharing the cores), or
      - the same torus with unshaped veths (`--torus DIMS --unshaped`): compute, per-message
        costs and process skew as the shaped run has them, so only the link rate is modelled
        (the unshaped veths' own transfer time is counted twice, a few percent).
    XLA's psum rows get no prediction (gloo's own algorithm)."""
    rate = gbit_to_bytes_s(run["link_gbit"]) * efficiency
    one = {(r["size_bytes"], r["method"]): r["median"] for r in base["rows"]}
    out = []
    for r in run["rows"]:
        key = (r["size_bytes"], r["method"])
        t = terms.get(key)
        row = {"size_bytes": r["size_bytes"], "method": r["method"], "measured_s": r["median"],
               "compute_s": one.get(key)}
        if t is not None and t["steps"] and key in one:
            link = sum(t["link_bytes"]) / rate
            row.update(link_s=link, alpha_total_s=alpha_s * t["steps"], steps=t["steps"],
                       predicted_s=one[key] + link + alpha_s * t["steps"])
            row["error"] = row["predicted_s"] / r["median"] - 1
        out.append(row)
    return out


def base_kind(base: dict, run: dict) -> str:
    """What an --emulated base run measured (see predict_emulated), or a ValueError when it
    cannot serve as the base of `run`."""
    if base.get("torus"):
        if list(base["torus"]) != list(run["torus"]) or base.get("link_gbit") is not None:
            raise ValueError("a torus base run must be the same torus with --unshaped veths")
        return "unshaped torus"
    if base.get("processes", 0) > 0:
        raise ValueError("the base run must be one process (--devices N --mesh DIMS) or the "
                         "unshaped torus (--torus DIMS --unshaped)")
    return "one process"


def format_emulated(rows: list[dict], base: str = "compute") -> str:
    head = (f"{'size':>9} {'method':<16} {'measured ms':>11} {base + ' ms':>10} "
            f"{'link ms':>8} {'steps':>5} {'predicted':>9} {'error':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "predicted_s" not in r:
            lines.append(f"{r['size_bytes'] >> 20:>5} MiB {r['method']:<16} "
                         f"{1e3 * r['measured_s']:>11.1f}   (not modelled: XLA psum on gloo)")
            continue
        lines.append(f"{r['size_bytes'] >> 20:>5} MiB {r['method']:<16} "
                     f"{1e3 * r['measured_s']:>11.1f} {1e3 * r['compute_s']:>10.1f} "
                     f"{1e3 * r['link_s']:>8.1f} {r['steps']:>5} "
                     f"{1e3 * r['predicted_s']:>9.1f} {100 * r['error']:>6.0f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(description="cost model tables")
    p.add_argument("--topologies", action="store_true",
                   help="predicted AllReduce and prefill times per TPU topology and method")
    p.add_argument("--tokens", default="2048,4096,8192")
    p.add_argument("--emulated", nargs=2, metavar=("TORUS.json", "BASE.json"),
                   help="predict an eval.bench_collective --torus run from a base run of the "
                        "same methods and sizes: the unshaped torus (--torus DIMS --unshaped) "
                        "or one process (--devices N --mesh DIMS), and compare")
    p.add_argument("--alpha-us", type=float, default=0.0,
                   help="per collective-permute latency for --emulated")
    args = p.parse_args(argv)
    if args.topologies:
        tokens = [int(t) for t in args.tokens.split(",")]
        print(format_topology_predictions(topology_predictions(tokens)))
    if args.emulated:
        from jax_platform import ensure_cpu_devices

        with open(args.emulated[0]) as f:
            run = json.load(f)
        with open(args.emulated[1]) as f:
            base = json.load(f)
        try:
            kind = base_kind(base, run)
        except ValueError as e:
            p.error(str(e))
        dims = tuple(run["torus"])
        ensure_cpu_devices(math.prod(dims), exact=True)
        s = run["settings"]
        terms = emulated_link_terms([m for m in s["methods"] if not m.startswith("bf16:")],
                                    s["sizes"], dims, s["minishards"], s["pipelined"],
                                    s.get("row_width", 4096))
        print(f"# {run['mode']}; measured {run['time']}; base: {kind}, {base['time']}")
        print(format_emulated(predict_emulated(run, base, terms, args.alpha_us * 1e-6),
                              "base"))


if __name__ == "__main__":
    main()
