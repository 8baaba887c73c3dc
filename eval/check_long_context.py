"""A long prompt through the paged engine's ragged steps against a one-shot prefill of the same
tokens: the last token's logits, max relative difference (max |paged - one-shot| / max
|one-shot|). The real Gemma 3 270M in float32 with the f32 AllReduce, split over --tp virtual
CPU devices, so that the only differences are float sums in another order.

Not part of the test suite (minutes on 2 cores):

    python -m eval.check_long_context                        # 8,192 tokens, tp=2
    python -m eval.check_long_context --tokens 32000         # vs one-shot, 32,000 tokens
    python -m eval.check_long_context --tokens 32000 --reference chunked

The one-shot reference is one prefill program over the whole prompt; past 1,024 tokens it
attends in query chunks of 1,024 (the prompt right-padded to a multiple), so 32,000 tokens need
[1,024, 32,768] scores a layer, not [32,000, 32,000] (16 GiB). `--reference chunked` is the
model's own chunked prefill (`prefill_chunk` / `write_chunk`: programs of their own, a contiguous
cache with ring buffers for the sliding-window layers, chunks of 256), a second reference and a
faster one.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import jax_platform
from eval.reports import write_json


def paged_last_logits(model, prompt: list[int], budget: int, chunk: int) -> tuple[np.ndarray, int]:
    """The prompt through the paged engine's scheduler and ragged steps (pieces of `budget`
    tokens: a lone prompt), returning the last token's float32 logits [V] and the step count."""
    import jax

    from models.gemma3.ragged import RaggedBatch
    from serving import PagedRunner, step_inputs
    from serving import PagedScheduler
    from serving import SamplingParams
    from serving import Sequence

    engine = PagedRunner(model, max_num_seqs=1, max_seq_len=len(prompt) + 1, page_size=16,
                         chunk_size=chunk, max_num_batched_tokens=budget, prefix_caching=False,
                         model_name="check")
    sched = PagedScheduler(engine.info)
    sched.add([Sequence(id=0, prompt=list(prompt), params=SamplingParams(max_tokens=1), seed=0)])
    steps, logits = 0, None
    while logits is None:
        plan = sched.schedule()
        inputs = step_inputs(plan, sched.kv, engine.info)
        out, engine.pages = model.ragged_step(engine.pages, RaggedBatch(**inputs.batch),
                                                     logits=inputs.buckets.logits)
        # One step at a time: a long prompt's steps read nothing back, and more than 32 of
        # them queued wedge XLA:CPU's multi-device runtime (serving/dispatch_window.py).
        jax.block_until_ready(engine.pages)
        steps += 1
        if plan.pieces[0].sample:
            logits = np.asarray(out, np.float32)[0]
    return logits, steps


def one_shot_last_logits(model, prompt: list[int]) -> np.ndarray:
    """One prefill program over the whole prompt (the model's `prefill`, into a one-row cache).
    Past `PROMPT_CHUNK` tokens the prompt is right-padded to a multiple of it, so the prefill
    attends in query chunks ([chunk, T] scores, not [T, T]); padding after the last token
    changes none of its logits (causal attention)."""
    from models.gemma3.model import PROMPT_CHUNK

    n = len(prompt)
    t = n if n <= PROMPT_CHUNK else -(-n // PROMPT_CHUNK) * PROMPT_CHUNK
    tokens = np.zeros((1, t), np.int32)
    tokens[0, :n] = prompt
    logits, _ = model.prefill(model.init_cache(1, n), tokens, np.asarray([n], np.int32),
                              np.zeros(1, np.int32))
    return np.asarray(logits, np.float32)[0]


def chunked_last_logits(model, prompt: list[int], chunk: int = 256) -> np.ndarray:
    """The model's chunked prefill into a one-row cache: chunk after chunk, each reading
    the cache and then written into it."""
    import jax

    n = len(prompt)
    cache = model.init_cache(1, n)
    logits = None
    for start in range(0, n, chunk):
        part = prompt[start:start + chunk]
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :len(part)] = part
        logits, kv = model.prefill_chunk(cache, tokens, start, len(part), 0)
        cache = jax.block_until_ready(model.write_chunk(cache, kv, start, len(part), 0))
    return np.asarray(logits, np.float32)[0]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--budget", type=int, default=256, help="the paged step's token budget")
    ap.add_argument("--reference", choices=("one-shot", "chunked", "none"), default="one-shot")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    jax_platform.request_cpu_devices(args.tp)
    jax_platform.keep_freed_memory()
    from equarx import AllReduceConfig
    from eval.bench_engine import _text_ids
    from models.gemma3 import load_model

    model = load_model("gemma3-270m", tp=args.tp, dtype="float32", max_seq_len=args.tokens + 1,
                       allreduce=AllReduceConfig.from_label("f32"))
    tok = model.tokenizer
    prompt = [tok.bos_id] + _text_ids(tok, args.tokens - 1, 7)
    t0 = time.perf_counter()
    paged, steps = paged_last_logits(model, prompt, args.budget, 16)
    res = {"tokens": args.tokens, "tp": args.tp, "paged_steps": steps,
           "paged_s": time.perf_counter() - t0}
    print(f"paged: {args.tokens} tokens in {steps} steps, {res['paged_s']:.0f} s")
    if args.reference != "none":
        t0 = time.perf_counter()
        ref = (one_shot_last_logits(model, prompt) if args.reference == "one-shot"
               else chunked_last_logits(model, prompt))
        res["reference"] = args.reference
        res["reference_s"] = time.perf_counter() - t0
        res["max_rel_diff"] = float(np.max(np.abs(paged - ref)) / np.max(np.abs(ref)))
        res["same_argmax"] = bool(np.argmax(paged) == np.argmax(ref))
        print(f"{args.reference}: {res['reference_s']:.0f} s; last-token logits max relative "
              f"difference {res['max_rel_diff']:.2e}, same argmax: {res['same_argmax']}")
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
