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
from typing import Iterable, Sequence

from equarx import plan_for, plan_layout, resolved_variant
from equarx.config import QUANTIZED
from equarx.groups import wire_bytes_per_value
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
        quantized = wire_bytes_per_value(cfg.group_size, cfg.method)
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
