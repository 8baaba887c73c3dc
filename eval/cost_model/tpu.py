"""Predictions for TPU v5e from published figures: the paper's Gemma 3 prefill configurations."""
from __future__ import annotations

import dataclasses

from equarx import resolved_variant
from equarx.config import QUANTIZED
from equarx.ring import ring_hops
from equarx.schedule import V5E_HOP_S, V5E_LINK_BYTES_PER_S
from eval.cost_model.link import LinkModel
from eval.cost_model.prefill import allreduces_per_prefill
from eval.cost_model.schedule import allreduce_schedule
from eval.quality import mode_config
from eval.reports import format_columns


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
    # The link and the step latency are equarx's (equarx.schedule says where they come from).
    link_bytes_s=V5E_LINK_BYTES_PER_S, ring_links=2, alpha_s=V5E_HOP_S, mfu=0.5,
    source="197 TFLOP/s bf16 and 819 GB/s HBM per chip from Google Cloud's TPU v5e system "
           "architecture page; 45 GB/s per ICI link and direction from the JAX scaling book "
           "(equarx.schedule.V5E_LINK_BYTES_PER_S), a bidirectional ring drives 2 links; "
           "assumed, not published: 2 us per ring step, 50% MFU for the prefill matmuls")

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
    x = lambda k: lambda r: f"{r[k]:.2f}x"  # noqa: E731
    return "\n".join([
        f"# PREDICTIONS for {acc.name} from the cost model (not measurements).", f"# {acc.source}",
        format_columns(rows, [
            ("model", "<11", lambda r: r["model"]), ("tp", ">3", lambda r: r["tp"]),
            ("tokens", ">6", lambda r: r["tokens"]), ("method", "<14", lambda r: r["method"]),
            ("bf16 ms", ">8", lambda r: f"{r['bf16_ms']:.1f}"),
            ("int8 ms", ">8", lambda r: f"{r['int8_ms']:.1f}"),
            ("comm %", ">7", lambda r: f"{100 * r['comm_share_bf16']:.0f}%"),
            ("predicted", ">10", x("predicted_speedup")),
            ("(quant exposed)", ">16", x("predicted_speedup_quant_exposed")),
            ("paper", ">6", x("paper_speedup"))])])
