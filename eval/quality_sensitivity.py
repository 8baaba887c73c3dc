"""How a model's KL to the float32 AllReduce follows the AllReduce's error: a noise sweep and
each mode's measured error, on the same model and text.

The reference is the model with an exact float32 AllReduce (`eval.quality`'s). Beside it, at
every tensor-parallel reduction (the model's reduction hook):
  noise:EPS  the float32 psum plus Gaussian noise of rms EPS x that row's rms, then cast to the
             model's dtype. The noise is drawn from the bits of the sum itself, so it is
             token-local, the same on every device and the same on every call: a controlled
             error of known size and nothing else;
  a label    any AllReduce label, as `equarx.all_reduce` runs it (a codec's rotation, if any,
             at run time, as eval.quality's ":unfolded" modes: the error is the codec's, not
             the folded weights' rounding).
For each variant: the relative rms error of its reductions against the exact sum as the
reference delivers it (rounded to the model's dtype), over every reduction of every scored
window (sum of squared errors / sum of squared sums, on the model's real partial sums), and
KL / top-1 against the reference.

Why: in a bfloat16 model any change of the AllReduce's output, even one bf16 rounding flipped
in a few values, is carried through the later layers' own bf16 roundings into the logits, so
KL has a floor that does not shrink with the error. A mode's KL is that floor plus a term in
its error squared; the sweep shows both and where each mode's error puts it.

  python -m eval.quality_sensitivity --dtype bfloat16 --modes bf16_ring-full,int8 --tokens 1024
"""
from __future__ import annotations

import argparse
import math
import time

from equarx import AllReduceConfig
from eval import corpus
from eval.quality import REFERENCE, mode_config, score_windows
from eval.reports import write_json

NOISE = "noise:"
DEFAULT_NOISE = (1e-4, 3e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)


class ErrorMeter:
    """Sums of squared errors and of squared exact sums, fed from inside the compiled programs
    (`jax.debug.callback`); read after `jax.effects_barrier()`."""

    def __init__(self):
        self.err2 = 0.0
        self.ref2 = 0.0

    def add(self, err2, ref2) -> None:
        self.err2 += float(err2)
        self.ref2 += float(ref2)

    @property
    def relative(self) -> float | None:
        return math.sqrt(self.err2 / self.ref2) if self.ref2 > 0 else None


def _as_delivered(exact, dtype):
    """The exact float32 sum rounded as the reference hands it on. reduce_precision, not a
    round trip through astype: XLA may drop a float32 -> bfloat16 -> float32 pair of converts."""
    import jax.numpy as jnp
    from jax import lax

    if dtype == jnp.bfloat16:
        return lax.reduce_precision(exact, exponent_bits=8, mantissa_bits=7)
    return exact


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
                       eps: float | None = None):
    """A model reduction hook (x, axis) -> x: `config`'s all_reduce, or (eps) the exact sum plus
    `row_noise`; either way its error against the delivered exact sum goes to `meter`."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from equarx import all_reduce

    if (config is None) == (eps is None):
        raise ValueError("give a config or a noise size, not both")

    def reduce(x, axis):
        exact = lax.psum(x.astype(jnp.float32), axis)
        out = (all_reduce(x, axis, config) if config is not None
               else (exact + row_noise(exact, eps)).astype(x.dtype))
        err = out.astype(jnp.float32) - _as_delivered(exact, x.dtype)
        jax.debug.callback(meter.add, jnp.sum(err * err), jnp.sum(exact * exact))
        return out

    return reduce


def parse_noise(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if any(not (v > 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"noise sizes must be positive numbers, got {text!r}")
    return values


def run(model: str, tp: int, modes: list[str], noise: list[float], n_tokens: int, window: int,
        dtype: str, log=print) -> dict:
    import jax

    from models.gemma3 import load_model

    configs = {m: mode_config(m) for m in modes}
    if any(c is None for c in configs.values()):
        raise ValueError("the naive strawman is not measured here; leave it out")
    base = load_model(model, tp=tp, allreduce=AllReduceConfig(REFERENCE), dtype=dtype,
                      max_seq_len=window)
    tok = base.tokenizer
    windows = corpus.token_windows(tok.encode, n_tokens, window, tok.bos_id)
    meters, variants = {}, {}
    for name, cfg, eps in ([(m, configs[m], None) for m in modes]
                           + [(f"{NOISE}{e:g}", None, e) for e in noise]):
        meters[name] = ErrorMeter()
        variants[name] = base.with_allreduce(
            AllReduceConfig(REFERENCE), reduction=measured_reduction(meters[name], cfg, eps))
    sums, _ = score_windows(base, variants, windows, log=lambda msg: log(f"  {msg}"))
    jax.effects_barrier()
    rows = [{"variant": name, "noise": name.startswith(NOISE),
             "allreduce_rel_error": meters[name].relative,
             "kl_to_f32": s["kl"] / s["count"], "top1_agree_f32": s["agree"] / s["count"],
             "perplexity": math.exp(s["nll"] / s["count"]), "tokens": s["count"]}
            for name, s in sums.items()]
    return {"model": model, "dtype": dtype, "tp": tp, "corpus": corpus.SOURCE, "window": window,
            "tokens_scored": rows[0]["tokens"] if rows else 0, "reference": REFERENCE,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}


def format_table(rows: list[dict]) -> str:
    head = f"{'variant':<16} {'AllReduce error':>15} {'KL to f32':>10} {'top-1 = f32':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        err = "-" if r["allreduce_rel_error"] is None else f"{r['allreduce_rel_error']:.2e}"
        lines.append(f"{r['variant']:<16} {err:>15} {r['kl_to_f32']:>10.2e} "
                     f"{100 * r['top1_agree_f32']:>10.2f}%")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--modes", default="bf16_ring-full,int8",
                   help="comma list of AllReduce labels (may be empty)")
    p.add_argument("--noise", default=",".join(f"{e:g}" for e in DEFAULT_NOISE),
                   help="comma list of noise sizes, relative to each row's rms")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    noise = parse_noise(args.noise)
    from serving.jax_platform import ensure_cpu_devices

    ensure_cpu_devices(args.tp)
    report = run(args.model, args.tp, modes, noise, args.tokens, args.window, args.dtype)
    print(f"# {report['model']} ({report['dtype']}) at tp={args.tp}, {report['tokens_scored']} "
          f"predictions; error: rms of (output - exact sum in the model's dtype) / rms of the "
          f"sum, over every reduction (eval/quality_sensitivity.py)")
    print(format_table(report["rows"]))
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
