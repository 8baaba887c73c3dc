"""How a model's KL to the float32 AllReduce follows the AllReduce's error: a noise sweep and
each mode's measured error, on the same model and text.

The reference is the model with an exact float32 AllReduce (`eval.quality`'s). Beside it, at
every tensor-parallel reduction (the model's reduction hook):
  noise:EPS  the float32 psum plus Gaussian noise of rms EPS x that row's rms, rounded to the
             model's dtype. The noise is drawn from the bits of the sum itself, so it is
             token-local, the same on every device and the same on every call: a controlled
             error and nothing else (noise:0 is the reference's own output). In a bfloat16
             model a small EPS moves only the values it pushes across a rounding boundary, each
             by a whole bf16 step, so the error delivered is larger than EPS there;
  a label    any AllReduce label, as `equarx.all_reduce` runs it (a codec's rotation, if any,
             at run time, as eval.quality's ":unfolded" modes: the error is the codec's, not
             the folded weights' rounding).
With --group-stats the reference's own reductions (noise:0) also measure what a code of the
sum could gain by spending its bits unevenly over a row's runs of 32 (the default codec's,
rotated as it rotates them): the ratio of the arithmetic to the geometric mean of the runs'
variances (what an ideal allocation gains in mean squared error: reverse water-filling, at high
rate, fractional bits), the gain of the best whole widths (2-16 bits) within each piece a
two-shot owner encodes, and the partial sums' energy against their sum's.
For each variant: the relative rms error of its reductions against the exact sum as the
reference delivers it (rounded to the model's dtype), over every reduction of every scored
window (sum of squared errors / sum of squared sums, on the model's real partial sums), and
KL / top-1 against the reference.

Why: a bfloat16 model hands any change of the AllReduce's output, even a few values moved by
one bf16 step, through its later layers' own bf16 roundings into the logits, so its KL to the
reference has a floor that a smaller error does not lower; above the floor a mode's KL grows
with its error squared, as a float32 model's does from zero. The sweep shows both, and where
each mode's measured error puts it (docs/quality.md).

  python -m eval.quality_sensitivity --dtype bfloat16 --modes bf16_ring-full,int8 --tokens 1024
"""
from __future__ import annotations

import argparse
import math
import threading
import time

import numpy as np

from equarx import AllReduceConfig
from eval import corpus
from eval.quality import (REFERENCE, add_scoring_args, collective_configs, comma_list,
                          load_reference, score_windows)
from eval.reports import format_columns, show_and_write

NOISE = "noise:"
DEFAULT_NOISE = (0.0, 1e-4, 3e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)


class ErrorMeter:
    """Sums of squared errors and of squared exact sums, fed from inside the compiled programs
    (`jax.debug.callback`); read after `jax.effects_barrier()`. The devices' callbacks run on
    several threads at once, hence the lock (unlocked, sums lost updates between runs)."""

    def __init__(self):
        self.err2 = 0.0
        self.ref2 = 0.0
        self._lock = threading.Lock()

    def add(self, err2, ref2) -> None:
        err2, ref2 = float(err2), float(ref2)
        with self._lock:
            self.err2 += err2
            self.ref2 += ref2

    @property
    def relative(self) -> float | None:
        return math.sqrt(self.err2 / self.ref2) if self.ref2 > 0 else None


class GroupStats:
    """What a code of the reductions' sums could gain by spending a row's bits unevenly over its
    runs, from the reference's own reductions: each run's mean square and largest square after
    the codec's rotation (`run_squares`, kept from device 0: the sum is the same on every
    device), and the partial sums' energy against the sum's."""

    def __init__(self, group_size: int = 32):
        self.group_size = group_size
        self.runs: list[np.ndarray] = []  # [2, rows, runs] per reduction
        self.energy = [0.0, 0.0]
        self._lock = threading.Lock()

    def add(self, squares, parts2, sum2, device) -> None:
        if int(device) != 0:
            return
        squares = np.asarray(squares, np.float64)
        with self._lock:
            self.runs.append(squares.reshape(2, -1, squares.shape[-1]))
            self.energy[0] += float(parts2)
            self.energy[1] += float(sum2)

    def report(self, pieces: int) -> dict | None:
        if not self.runs or self.energy[1] <= 0:
            return None
        var, max2 = (np.concatenate([r[i] for r in self.runs]) for i in (0, 1))
        am = var.mean(axis=1)
        live = am > 0
        # A run far below its row's mean (an all-zero one) is floored at 1e-6 of it, where an
        # allocation would give it no bits anyway.
        gm = np.exp(np.log(np.maximum(var[live], 1e-6 * am[live, None])).mean(axis=1))
        runs = var.shape[1]
        per_piece = runs // pieces if runs % pieces == 0 else runs
        # How Gaussian the rotated runs are: the rms over runs of (largest / rms), beside the
        # same for runs of standard normal values (the rate-distortion bound's case).
        g = self.group_size
        z = np.square(np.random.default_rng(0).standard_normal((1 << 16, g)))
        nonzero = var > 0
        return {"reductions": len(self.runs), "runs_per_row": runs,
                "run_var_am_over_gm": float(am[live].sum() / gm.sum()),
                "ideal_allocation_rms_gain": float(math.sqrt(am[live].sum() / gm.sum())),
                "runs_per_piece": per_piece,
                "integer_allocation_rms_gain": allocation_gain(max2.reshape(-1, per_piece)),
                "partials_energy_over_sum": self.energy[0] / self.energy[1],
                "run_peak_to_rms": float(np.sqrt(np.mean(max2[nonzero] / var[nonzero]))),
                "gaussian_run_peak_to_rms": float(np.sqrt(np.mean(z.max(1) / z.mean(1))))}


def run_squares(rows, g: int):
    """f32[..., d] (d a multiple of g) -> f32[2, T, d / g]: each run's mean square and largest
    square after `groups.rotate` (unnormalized: both scale alike, and only ratios are used)."""
    import jax.numpy as jnp

    from equarx import groups

    d = rows.shape[-1]
    if d % g:
        raise ValueError(f"rows of {d} values do not split into runs of {g}")
    r = jnp.square(groups.rotate(rows.reshape(-1, d), g).reshape(-1, d // g, g))
    return jnp.stack([jnp.mean(r, axis=-1), jnp.max(r, axis=-1)])


def allocation_gain(max2: np.ndarray, bits: int = 8, low: int = 2, high: int = 16) -> float:
    """The rms error of a uniform code of `bits` bits on every run (a step of max / (2^(bits-1)
    - 1), (step^2 / 12) a value) over that of the best whole widths from `low` to `high` bits
    that keep each row's total (max2 f32[rows, runs], each run's largest square): bits moved
    one at a time from the run that loses least to the one that gains most, while that lowers
    the row's error (optimal, the error being convex in the width)."""
    def err(b):
        return max2 / np.square(np.exp2(b - 1.0) - 1.0)

    b = np.full(max2.shape, bits)
    uniform = err(b).sum()
    rows = np.arange(len(b))
    for _ in range((high - low) * max2.shape[1]):
        gain = np.where(b < high, err(b) - err(b + 1), -np.inf)
        loss = np.where(b > low, err(b - 1) - err(b), np.inf)
        i, j = gain.argmax(axis=1), loss.argmin(axis=1)
        move = (gain[rows, i] > loss[rows, j]) & (i != j)
        if not move.any():
            break
        b[rows[move], i[move]] += 1
        b[rows[move], j[move]] -= 1
    return float(math.sqrt(uniform / err(b).sum())) if uniform > 0 else 1.0


def _as_delivered(exact, dtype):
    """Float32 values rounded to `dtype` (as the reference hands its exact sum on).
    reduce_precision, not a round trip through astype: XLA drops a float32 -> bfloat16 ->
    float32 pair of converts where it may keep the excess precision, and would then compare
    with (or hand on) values the model's dtype cannot hold."""
    import jax.numpy as jnp
    from jax import lax

    if jnp.dtype(dtype) == jnp.float32:
        return exact
    info = jnp.finfo(dtype)
    return lax.reduce_precision(exact, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def row_noise(exact, eps: float):
    """Noise for `exact` (f32[..., d]): standard normal values drawn from each value's bits
    (a hash, then Box-Muller), times eps x the rms of its row."""
    import jax.numpy as jnp
    from jax import lax

    bits = lax.bitcast_convert_type(exact, jnp.uint32)
    h = (bits * jnp.uint32(2654435761)) ^ (bits >> 13)
    h = (h * jnp.uint32(2246822519)) ^ (h >> 16)
    u1 = ((h & 0xFFFF).astype(jnp.float32) + 0.5) / 65536.0
    u2 = (h >> 16).astype(jnp.float32) / 65536.0
    z = jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(2.0 * math.pi * u2)
    rms = jnp.sqrt(jnp.mean(exact * exact, axis=-1, keepdims=True))
    return eps * rms * z


def measured_reduction(meter: ErrorMeter, config: AllReduceConfig | None = None,
                       eps: float | None = None, stats: GroupStats | None = None,
                       group_size: int = 32):
    """A model reduction hook (x, axis) -> x: `config`'s all_reduce, or (eps) the exact sum plus
    `row_noise`; either way its error against the delivered exact sum goes to `meter`, and with
    `stats` the exact sum's `run_squares` and the partials' energy go there."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from equarx import all_reduce

    if (config is None) == (eps is None):
        raise ValueError("give exactly one of a config and a noise size, not both or neither")

    def reduce(x, axis):
        exact = lax.psum(x.astype(jnp.float32), axis)
        out = (all_reduce(x, axis, config) if config is not None
               else _as_delivered(exact + row_noise(exact, eps), x.dtype).astype(x.dtype))
        err = out.astype(jnp.float32) - _as_delivered(exact, x.dtype)
        jax.debug.callback(meter.add, jnp.sum(err * err), jnp.sum(exact * exact))
        if stats is not None:
            x32 = x.astype(jnp.float32)
            jax.debug.callback(stats.add, run_squares(exact, group_size),
                               lax.psum(jnp.sum(x32 * x32), axis), jnp.sum(exact * exact),
                               lax.axis_index(axis))
        return out

    return reduce


def parse_noise(text: str) -> list[float]:
    values = [float(v) for v in comma_list(text)]
    if any(not (v >= 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"noise sizes must be finite numbers >= 0, got {text!r}")
    return values


def run(model: str, tp: int, modes: list[str], noise: list[float], n_tokens: int, window: int,
        dtype: str, log=print, group_stats: bool = False) -> dict:
    import jax

    configs = collective_configs(modes)
    stats = GroupStats() if group_stats else None
    if stats is not None and 0.0 not in noise:
        noise = [0.0, *noise]
    base, windows = load_reference(model, tp, dtype, n_tokens, window)
    meters, variants = {}, {}
    for name, cfg, eps in ([(m, configs[m], None) for m in modes]
                           + [(f"{NOISE}{e:g}", None, e) for e in noise]):
        meters[name] = ErrorMeter()
        variants[name] = base.with_allreduce(
            AllReduceConfig(REFERENCE), reduction=measured_reduction(
                meters[name], cfg, eps, stats=stats if eps == 0 else None))
    sums, _ = score_windows(base, variants, windows, log=lambda msg: log(f"  {msg}"))
    jax.effects_barrier()
    rows = [{"variant": name, "noise": name.startswith(NOISE),
             "allreduce_rel_error": meters[name].relative,
             "kl_to_f32": s["kl"] / s["count"], "top1_agree_f32": s["agree"] / s["count"],
             "perplexity": math.exp(s["nll"] / s["count"]), "tokens": s["count"]}
            for name, s in sums.items()]
    return {"model": model, "dtype": dtype, "tp": tp, "corpus": corpus.SOURCE, "window": window,
            "tokens_scored": rows[0]["tokens"] if rows else 0, "reference": REFERENCE,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows,
            "group_stats": stats.report(tp) if stats is not None else None}


def format_table(rows: list[dict]) -> str:
    def error(r):
        return "-" if r["allreduce_rel_error"] is None else f"{r['allreduce_rel_error']:.2e}"

    return format_columns(rows, [
        ("variant", "<16", lambda r: r["variant"]), ("AllReduce error", ">15", error),
        ("KL to f32", ">10", lambda r: f"{r['kl_to_f32']:.2e}"),
        ("top-1 = f32", ">11", lambda r: f"{100 * r['top1_agree_f32']:.2f}%")])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scoring_args(p, tokens=1024, dtype="bfloat16")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--modes", default="bf16_ring-full,int8",
                   help="comma list of AllReduce labels (may be empty)")
    p.add_argument("--noise", default=",".join(f"{e:g}" for e in DEFAULT_NOISE),
                   help="comma list of noise sizes, relative to each row's rms")
    p.add_argument("--group-stats", action="store_true",
                   help="also measure the reference's runs of 32: how unequal their variances "
                        "are within a row, and the partials' energy against the sum's")
    args = p.parse_args(argv)
    modes = comma_list(args.modes)
    noise = parse_noise(args.noise)
    from jax_platform import ensure_cpu_devices

    ensure_cpu_devices(args.tp)
    report = run(args.model, args.tp, modes, noise, args.tokens, args.window, args.dtype,
                 group_stats=args.group_stats)
    title = (f"# {report['model']} ({report['dtype']}) at tp={args.tp}, "
             f"{report['tokens_scored']} predictions; error: rms of (output - exact sum in the "
             f"model's dtype) / rms of the sum, over every reduction")
    table = format_table(report["rows"])
    if report["group_stats"]:
        gs = report["group_stats"]
        table += (f"\n{gs['runs_per_row']} rotated runs of 32 a row, over {gs['reductions']} "
                  f"reductions: AM/GM of their variances {gs['run_var_am_over_gm']:.3f} (an ideal "
                  f"allocation of a row's bits: {gs['ideal_allocation_rms_gain']:.3f}x less rms "
                  f"error); whole widths over a piece's {gs['runs_per_piece']} runs, a uniform "
                  f"code's error / the best's: {gs['integer_allocation_rms_gain']:.3f}; the "
                  f"partials' energy / the sum's: {gs['partials_energy_over_sum']:.3f}; a run's "
                  f"largest / its rms (rms over runs) {gs['run_peak_to_rms']:.3f}, Gaussian "
                  f"runs' {gs['gaussian_run_peak_to_rms']:.3f}")
    return show_and_write(report, title, table, args.out)


if __name__ == "__main__":
    main()
