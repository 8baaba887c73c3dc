"""The link: alpha, efficiency and the psum penalty, fitted from collective-only measurements."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from eval.cost_model.schedule import Schedule, allreduce_schedule


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """alpha-beta model of one medium (docs/benchmarks.md#cost_model-predictions). shared: every
    device's bytes pass one medium (a shaped loopback); per_step: alpha per sequential step
    (concurrent chains overlap, as on TPU) instead of per message (gloo runs them one by one)."""

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
