"""Prefill time on a link: the one-process time plus every AllReduce's fitted link time."""
from __future__ import annotations

from typing import Iterable, Sequence

from eval.cost_model.link import Fit, LinkModel
from eval.cost_model.schedule import allreduce_schedule


def allreduces_per_prefill(num_layers: int) -> int:
    """Two per layer: after the attention output projection and after the MLP down projection."""
    return 2 * num_layers


def predict_prefill_s(nolink_s: float, label: str, *, tokens: int | Sequence[int], d_model: int,
                      num_layers: int, n_devices: int, link: LinkModel, minishards: int = 4,
                      embed_psum: bool = True, pipelined: bool = True,
                      base_link: LinkModel | None = None) -> float:
    """Prefill seconds on `link`: measured no-link time plus the modelled communication.
    tokens: the prefill's tokens, or each step's (the server's pieces): each step AllReduces
    [its tokens, d_model] per layer, and a step that samples nothing two fewer (XLA drops its
    last layer's unused attention output and MLP). embed_psum: the embedding lookup's one
    exact psum of that shape. base_link: `nolink_s` was measured on this link (its modelled
    communication is taken out)."""
    steps = [tokens] if isinstance(tokens, int) else list(tokens)
    schedules = [(allreduce_schedule(label, n * d_model, n_devices, minishards,
                                     pipelined=pipelined),
                  allreduce_schedule("bf16", n * d_model, n_devices)) for n in steps]

    def comm(lk: LinkModel) -> float:
        t = 0.0
        for i, (s, embed) in enumerate(schedules):
            layers = num_layers if i == len(schedules) - 1 else num_layers - 1
            t += allreduces_per_prefill(layers) * lk.comm_time(s, n_devices)
            if embed_psum and n_devices > 1:
                t += lk.comm_time(embed, n_devices)
        return t

    return nolink_s + comm(link) - (comm(base_link) if base_link is not None else 0.0)


def predict_rows(rows: Iterable[dict], nolink_ms: dict, fit: Fit, link_gbit: float, *,
                 d_model: int, num_layers: int, minishards: int = 4,
                 pipelined: bool = True, baseline: str = "bf16",
                 base_gbit: float | None = None) -> list[dict]:
    """Add predicted_ms and predicted_speedup_vs_bf16 to benchmark rows.

    nolink_ms maps (length, method) to the one-process median of the same prompt, or with
    base_gbit to its median on a link of that rate. An AllReduce carries a step's padded tokens
    (the row's `step_tokens`, else its length) x d_model values.
    """
    link = fit.link(link_gbit, shared=True)
    base_link = fit.link(base_gbit, shared=True) if base_gbit is not None else None
    out = []
    pred_ms = {}
    rows = list(rows)
    for r in rows:
        key = (r["length"], r["method"])
        if key in nolink_ms:
            tokens = r.get("step_tokens", r["length"])
            pred_ms[key] = 1e3 * predict_prefill_s(
                nolink_ms[key] / 1e3, r["method"], tokens=tokens, d_model=d_model,
                num_layers=num_layers, n_devices=r["tp"], link=link, minishards=minishards,
                pipelined=pipelined, base_link=base_link)
    for r in rows:
        r = dict(r)
        key = (r["length"], r["method"])
        base = pred_ms.get((r["length"], baseline))
        r["predicted_ms"] = pred_ms.get(key)
        r["predicted_speedup_vs_bf16"] = (base / pred_ms[key]) if key in pred_ms and base else None
        out.append(r)
    return out
