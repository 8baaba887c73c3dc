"""How the AllReduce's error grows with the number of devices: real activations, emulated axes.

The paper's flagship runs at tp=16; this machine runs the 270M at tp=4. To see each schedule's
error at 8 and 16 devices on real activations, the model runs at tp=4 with a reduction hook
(`Gemma3Model(reduction=...)`) that, at every tensor-parallel reduction:
  1. gathers the 4 real partial sums (exactly, in float32);
  2. splits each into k = N/4 random parts that sum to it (each part = partial / k + noise,
     the noise summing to zero over the k parts and sized so that a part's rms is the
     partial's / sqrt(k), as independent contributions of 1/N of the heads or FFN would be);
     the same fixed key on every device, so every device builds the same N parts;
  3. runs the real `equarx.all_reduce` over an axis of N emulated devices (`jax.vmap` with an
     axis name: the same schedules, codecs, ppermutes and additions as on N devices) and keeps
     emulated device 0's result (every replica is identical).
With k = 1 (N = 4) step 2 leaves the real partials, so the N = 4 row is the real tp=4 result.
The metrics are eval.quality's, against the same model with an exact float32 AllReduce.

  python -m eval.quality_scaling --devices 4,8,16 --modes int8,int8-full,int8-semi --tokens 1024
"""
from __future__ import annotations

import argparse
import math
import time

from equarx import AllReduceConfig
from eval import corpus
from eval.quality import (REFERENCE, add_scoring_args, collective_configs, comma_list,
                          load_reference, score_windows)
from eval.reports import format_columns, show_and_write

TP = 4
SPLIT_SEED = 20250617


def split_parts(partials, k: int, key):
    """partials f32[4, ...] -> f32[4 k, ...]: each real partial split into k parts summing to
    it (see the module docstring). k = 1 returns the partials themselves."""
    import jax
    import jax.numpy as jnp

    if k == 1:
        return partials
    noise = jax.random.normal(key, (partials.shape[0], k) + partials.shape[1:], jnp.float32)
    noise = noise - noise.mean(axis=1, keepdims=True)
    # Per row (token): a part's variance = partial's / k  ->  noise var = var (1/k - 1/k^2).
    rms = jnp.sqrt(jnp.mean(partials**2, axis=-1, keepdims=True))[:, None]
    parts = partials[:, None] / k + noise * rms * math.sqrt(1 / k - 1 / k**2)
    return parts.reshape((-1,) + partials.shape[1:])


def emulated_reduction(config: AllReduceConfig, n_devices: int):
    """A model reduction hook (x, axis) -> x: the all-reduce of `config` over `n_devices`
    emulated devices built from the real partials (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from equarx import all_reduce

    if n_devices % TP:
        raise ValueError(f"emulated devices must be a multiple of {TP}, got {n_devices}")
    k = n_devices // TP

    def reduce(x, axis):
        partials = lax.all_gather(x.astype(jnp.float32), axis)  # [4, ...], the same everywhere
        parts = split_parts(partials, k, jax.random.PRNGKey(SPLIT_SEED)).astype(x.dtype)
        out = jax.vmap(lambda p: all_reduce(p, "emulated", config), axis_name="emulated")(parts)
        return out[0]

    return reduce


def run(model: str, devices: list[int], modes: list[str], n_tokens: int, window: int,
        dtype: str, log=print) -> dict:
    configs = collective_configs(modes)
    base, windows = load_reference(model, TP, dtype, n_tokens, window)
    variants = {(m, n): base.with_allreduce(AllReduceConfig(REFERENCE),
                                            reduction=emulated_reduction(configs[m], n))
                for m in modes for n in devices}
    sums, _ = score_windows(base, variants, windows, log=lambda msg: log(f"  {msg}"))
    rows = []
    for (m, n), s in sums.items():
        rows.append({"mode": m, "devices": n, "emulated": n != TP,
                     "variant": variant_at(configs[m], n, window * base.config.d_model * 4),
                     "kl_to_f32": s["kl"] / s["count"], "top1_agree_f32": s["agree"] / s["count"],
                     "perplexity": math.exp(s["nll"] / s["count"]), "tokens": s["count"]})
    for r in rows:
        at_tp = next(x for x in rows if x["mode"] == r["mode"] and x["devices"] == TP)
        r["kl_vs_4"] = r["kl_to_f32"] / at_tp["kl_to_f32"] if at_tp["kl_to_f32"] else None
    return {"model": model, "dtype": dtype, "corpus": corpus.SOURCE, "window": window,
            "tokens_scored": rows[0]["tokens"] if rows else 0, "devices": devices,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}


def variant_at(config: AllReduceConfig, n: int, message_bytes: int) -> str:
    from equarx import resolved_variant

    return resolved_variant(config, n, message_bytes)


def format_table(rows: list[dict]) -> str:
    return format_columns(rows, [
        ("mode", "<16", lambda r: r["mode"]), ("N", ">3", lambda r: str(r["devices"])),
        ("schedule", "<8", lambda r: r["variant"]),
        ("KL to f32", ">10", lambda r: f"{r['kl_to_f32']:.2e}"),
        ("x N=4", ">6", lambda r: "-" if r["kl_vs_4"] is None else f"{r['kl_vs_4']:.2f}"),
        ("top-1 = f32", ">11", lambda r: f"{100 * r['top1_agree_f32']:.2f}%")])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scoring_args(p, tokens=1024, dtype="float32")
    p.add_argument("--devices", default="4,8,16", help="emulated axis sizes (multiples of 4)")
    p.add_argument("--modes", default="int8,int8-full,int8-semi,bf16_ring",
                   help="comma list of AllReduce labels")
    args = p.parse_args(argv)
    from jax_platform import ensure_cpu_devices

    ensure_cpu_devices(TP)
    report = run(args.model, [int(v) for v in comma_list(args.devices)], comma_list(args.modes),
                 args.tokens, args.window, args.dtype)
    title = (f"# {report['model']} ({report['dtype']}) at tp={TP}, {report['tokens_scored']} "
             f"predictions; N > 4 emulated from the real partials (eval/quality_scaling.py)")
    return show_and_write(report, title, format_table(report["rows"]), args.out)


if __name__ == "__main__":
    main()
