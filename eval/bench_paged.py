"""The paged engine against the slot engine, in-process (the engine core, no HTTP), same model,
same machine, runs alternating:

  lone   one greedy stream (a short prompt, then N tokens): its median inter-token latency.
         A lone request must not pay for a full batch.
  batch  8 concurrent greedy streams: tokens/s of the whole run.
  Both at each --max-seq-len given: the slot engine's decode attends over every slot's whole
  global-layer row, the paged engine's over the pages the sequences hold.
  memory the KV cache each engine allocates for the setting (bytes counted from the arrays).
  step   (`--only step`, not in the default run) one decode step of 8 rows at a 256-token
         context (`--step-context`), engine-level (the model program, sampling and the tokens
         back to the host), the paged engine and the slot engine alternating: the cost of the
         attention itself, without the scheduling and prefill around it.

    python -m eval.bench_paged                                # gemma3-270m bfloat16, tp=1
    python -m eval.bench_paged --max-seq-len 2048,32768 --tokens 48 --repeats 3 --out r.json
    python -m eval.bench_paged --only step --max-seq-len 2048,32768 --repeats 20

Engines: "slots" is the slot engine in its default deterministic mode, "slots-packed" the slot
engine with --no-deterministic (decode over the busy slots only), "paged" the paged engine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from eval.bench_engine import _submit, _text_ids
import jax_platform


def build(model, kind: str, max_seq_len: int, chunk: int):
    from serving.engine import ModelEngine
    from serving.paged_engine import PagedEngine

    if kind == "paged":
        engine = PagedEngine(model, max_num_seqs=8, max_seq_len=max_seq_len, page_size=16,
                             chunk_size=chunk, prefix_caching=False, model_name="bench")
        nbytes = sum(x.nbytes for x in _leaves(engine.pages))
    else:
        engine = ModelEngine(model, num_slots=8, max_seq_len=max_seq_len, chunk_size=chunk,
                             deterministic=kind == "slots", model_name="bench")
        nbytes = sum(x.nbytes for x in _leaves(engine.cache))
    t = engine.warmup(lambda msg: None)
    print(f"  {kind} at max_seq_len {max_seq_len}: warmed up in {t:.0f}s, KV cache "
          f"{nbytes / 2**20:.0f} MiB", file=sys.stderr)
    return engine, nbytes


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def lone_itl(core, prompt, tokens: int) -> float:
    s = _submit(core, prompt, tokens).wait()
    return float(np.median(np.diff(s.times[2:])))


def batch_tok_s(core, prompts, tokens: int) -> float:
    t0 = time.perf_counter()
    streams = [_submit(core, p, tokens) for p in prompts]
    for s in streams:
        s.wait()
    return sum(len(s.times) for s in streams) / (time.perf_counter() - t0)


def step_runners(model, length: int, context: int, rows: int = 8) -> dict:
    """Per engine, a function that runs one decode step of `rows` sequences at position
    `context` (what their caches hold does not matter to the time: zeros) and waits for its
    tokens. The paged rows hold their pages as the allocator gives them out."""
    from serving.engine import DecodeInputs, ModelEngine
    from serving.kv_pages import KVPages
    from serving.paged_engine import PagedEngine, step_inputs
    from serving.paged_scheduler import Piece, StepPlan
    from serving.sampling import IDLE, SlotSampling
    from serving.scheduler import Sequence

    paged = PagedEngine(model, max_num_seqs=rows, max_seq_len=length, page_size=16,
                        prefix_caching=False, model_name="bench")
    info = paged.info
    kv = KVPages(info.page_size, info.num_global_pages, info.num_local_pages,
                 info.sliding_window, info.has_global_layers)
    seqs = [Sequence(id=i, prompt=[2] * (context + 1), params=IDLE, seed=0) for i in range(rows)]
    for s in seqs:
        kv.allocate(s.id, 0, context + 1)
    inputs = step_inputs(StepPlan(tuple(Piece(s, context, context + 1) for s in seqs)), kv, info)
    slots = ModelEngine(model, num_slots=rows, max_seq_len=length, deterministic=True,
                        chunk_size=16,
                        model_name="bench")
    decode = DecodeInputs(np.full(rows, 2, np.int32), np.full(rows, context, np.int32),
                          SlotSampling.of_rows(seqs))
    return {"slots": lambda: slots.run_decode(decode), "paged": lambda: paged.run_step(inputs)}


def step_times(model, lengths: list[int], context: int, repeats: int) -> dict:
    """Median seconds of one 8-row decode step per engine and --max-seq-len (see `step`)."""
    out = {}
    for length in lengths:
        runners = step_runners(model, length, context)
        times = {k: [] for k in runners}
        for run in runners.values():
            run()  # compile
            run()
        for r in range(repeats):
            for kind in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
                t0 = time.perf_counter()
                runners[kind]()
                times[kind].append(time.perf_counter() - t0)
        for kind, ts in times.items():
            out[f"{kind}@{length}"] = {"step_s": ts, "step_median_s": float(np.median(ts))}
            print(f"  {kind:6s} max_seq_len {length:6d}: 8-row decode step at context {context}: "
                  f"{np.median(ts) * 1000:6.1f} ms (quartiles {np.percentile(ts, 25) * 1000:.1f}"
                  f"-{np.percentile(ts, 75) * 1000:.1f})", file=sys.stderr)
        del runners
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-seq-len", default="2048,32768")
    p.add_argument("--engines", default="slots,slots-packed,paged")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--prefill-chunk", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default="serve", help="serve (lone, batch, memory) or step")
    p.add_argument("--step-context", type=int, default=256)
    p.add_argument("--out")
    args = p.parse_args(argv)
    jax_platform.keep_freed_memory()
    from models.gemma3 import load_model
    from serving.engine_core import EngineCore

    model = load_model(args.model, dtype=args.dtype, max_seq_len=max(
        int(x) for x in args.max_seq_len.split(",")))
    tok = model.tokenizer
    prompts = [[tok.bos_id] + _text_ids(tok, args.prompt_tokens - 1, i) for i in range(8)]
    results: dict = {"model": args.model, "dtype": args.dtype, "tokens": args.tokens,
                     "prompt_tokens": args.prompt_tokens, "runs": {}}
    lengths = [int(x) for x in args.max_seq_len.split(",")]
    if args.only == "step":
        results = {"model": args.model, "dtype": args.dtype, "context": args.step_context,
                   "steps": step_times(model, lengths, args.step_context, args.repeats)}
        lengths = []
    for length in lengths:
        cores, sizes = {}, {}
        for kind in args.engines.split(","):
            engine, sizes[kind] = build(model, kind, length, args.prefill_chunk)
            cores[kind] = EngineCore(engine).start()
        try:
            runs = {k: {"lone_itl_s": [], "batch_tok_s": []} for k in cores}
            for r in range(args.repeats):
                order = list(cores) if r % 2 == 0 else list(cores)[::-1]
                for kind in order:
                    runs[kind]["lone_itl_s"].append(lone_itl(cores[kind], prompts[0], args.tokens))
                    runs[kind]["batch_tok_s"].append(batch_tok_s(cores[kind], prompts, args.tokens))
        finally:
            for core in cores.values():
                core.shutdown()
        for kind, run in runs.items():
            entry = {"kv_cache_bytes": sizes[kind], **run,
                     "lone_itl_median_s": float(np.median(run["lone_itl_s"])),
                     "batch_tok_s_median": float(np.median(run["batch_tok_s"]))}
            results["runs"][f"{kind}@{length}"] = entry
            print(f"  {kind:13s} max_seq_len {length:6d}: lone ITL "
                  f"{entry['lone_itl_median_s'] * 1000:6.1f} ms, 8 streams "
                  f"{entry['batch_tok_s_median']:6.1f} tok/s, KV {sizes[kind] / 2**20:7.0f} MiB",
                  file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
