"""Speed of Google DeepMind's official `gemma` package on the real Gemma 3 270M, for comparison with
this project's figures on the same machine and dtype.

Measures prefill tokens/s (one forward pass over a 512-token prompt, last-token logits, as the
official Sampler's prefill does) and decode tokens/s of `gm.text.Sampler` at batch 1 and 8 (greedy).
Decode speed is taken from the difference between two runs of different lengths, so prefill and
the fixed per-call overhead cancel out; end-of-sequence tokens are forbidden so every run decodes
exactly the number of tokens asked for. Compilation happens in untimed warm-up calls.

Run in the official package's virtualenv (see make_golden.py for how to make it):

    JAX_PLATFORMS=cpu /some/where/gemma-ref/bin/python tests/golden/official_speed.py
    JAX_PLATFORMS=cpu /some/where/gemma-ref/bin/python tests/golden/official_speed.py --cache-length 1024

Measured (gemma 4.0.1, jax 0.12.0.1, bfloat16, the 2-core CPU VM otherwise idle):

    | run                              | prefill 512 tok | decode b=1 | decode b=8 |
    | default (cache_length 4096)      | 933 tok/s       | 19.6 tok/s | 29.5 tok/s |
    | --cache-length 1024              | 855 tok/s       | 24.6 tok/s | 83.0 tok/s |

(Earlier runs on the same VM under load average 7-11 gave 2-3x lower and erratic figures.)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import gemma  # noqa: E402
import numpy as np  # noqa: E402
from gemma import gm  # noqa: E402

from models.gemma3.gguf import default_gguf_path, load_gguf_params  # noqa: E402
from models.gemma3.tokenizer import Tokenizer  # noqa: E402


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--short", type=int, default=8, help="new tokens in the short decode run")
    ap.add_argument("--long", type=int, default=72, help="new tokens in the long decode run")
    ap.add_argument("--cache-length", type=int, default=4096, help="Sampler cache_length (its default: 4096)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)

    tok_path = Path(tempfile.mkdtemp()) / "tokenizer.model"
    tok_path.write_bytes(Tokenizer.from_gguf(default_gguf_path()).serialized_model())
    tokenizer = gm.text.Gemma3Tokenizer(path=str(tok_path))
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), load_gguf_params(default_gguf_path()))
    model = gm.nn.Gemma3_270M(dtype=dtype)
    print(f"gemma {gemma.__version__} jax {jax.__version__} devices {jax.devices()} "
          f"dtype {args.dtype}", flush=True)

    # Prefill: one batch-1 forward over prefill_len tokens.
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(np.concatenate([[2], rng.integers(1000, 200_000, args.prefill_len - 1)])[None], jnp.int32)
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t, return_last_only=True).logits)
    forward(params, tokens).block_until_ready()
    t = best_time(lambda: forward(params, tokens).block_until_ready(), args.repeats + 1)
    print(f"prefill {args.prefill_len} tokens: {t * 1e3:.0f} ms = {args.prefill_len / t:.0f} tokens/s", flush=True)

    sampler = gm.text.Sampler(
        model=model, params=params, tokenizer=tokenizer, cache_length=args.cache_length,
        max_out_length=max(args.long, 128),
        forbidden_tokens=[tokenizer.special_tokens.EOS, tokenizer.special_tokens.END_OF_TURN,
                          tokenizer.special_tokens.BEGIN_OF_TOOL_RESPONSE])
    for batch in args.batch_sizes:
        prompts = ["The capital of France is"] * batch

        def run(n: int):
            out = sampler.sample(prompts, max_new_tokens=n, return_state=True)
            jax.block_until_ready(out.state)
            return out

        out = run(args.long)  # compiles prefill and the sampling loop; max_new_tokens is dynamic
        n_new = int(out.state.step)
        t_short = best_time(lambda: run(args.short), args.repeats)
        t_long = best_time(lambda: run(args.long), args.repeats)
        rate = batch * (args.long - args.short) / (t_long - t_short)
        print(f"decode batch {batch}: {rate:.1f} tokens/s ({rate / batch:.1f} per sequence); "
              f"{args.long} new tokens end to end in {t_long:.2f}s = {batch * args.long / t_long:.1f} tokens/s "
              f"(cache_length {args.cache_length}, steps seen {n_new})", flush=True)


if __name__ == "__main__":
    main()
