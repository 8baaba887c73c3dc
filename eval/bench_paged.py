"""The paged engine's two modes against each other, in-process (the engine core, no HTTP), same
model, same machine, runs alternating:

  lone   one greedy stream (a short prompt, then N tokens): its median inter-token latency.
         A lone request must not pay for a full batch.
  batch  8 concurrent greedy streams: tokens/s of the whole run.
  Both at each --max-seq-len given: the steps attend over the pages the sequences hold (the
  deterministic mode's decode program has a table of the whole --max-seq-len, of which it
  reads the rows' pages).
  memory the KV cache each engine allocates for the setting (bytes counted from the arrays),
         beside what a dense cache of 8 rows of --max-seq-len tokens would hold.

    python -m eval.bench_paged                                # gemma3-270m bfloat16, tp=1
    python -m eval.bench_paged --max-seq-len 2048,32768 --tokens 48 --repeats 3 --out r.json

The other measurements (`--only`):
  step      one decode step of 8 rows at a 256-token context (`--step-context`), engine-level
            (the model program, sampling and the tokens back to the host), the two modes
            alternating: the attention's cost without the scheduling and prefill around it.
  ttft      a lone prompt of --prompt-tokens (e.g. 900): its time to first token, the two modes
            alternating (the default mode runs a lone prompt in pieces of the whole step
            budget, the deterministic mode in pieces of --long-prefill-token-threshold).
  streams   the paged engine with max_num_seqs = the largest of --streams: output tokens/s at
            each stream count.
  capacity  how many sequences of --prompt-tokens the paged engine serves at once in the KV
            bytes of a dense cache of 8 x 8,192 tokens (8 rows each holding every position in
            the global layers and the window in the local ones, `bytes_per_sequence`; the
            allocator and scheduler run for real; no model steps: the pages a sequence holds do
            not depend on the values).

Engines (--engines): "paged" the paged engine's default mode, "paged-deterministic" the paged
engine with --deterministic (batch-invariant: a step's decode rows in one program of every
slot's row, its prompt piece in a program of its own).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import jax_platform
from eval.bench_engine import _submit, _text_ids
from eval.reports import write_json


ENGINES = ("paged", "paged-deterministic")


def build(model, kind: str, max_seq_len: int, chunk: int):
    from serving import PagedRunner

    if kind not in ENGINES:
        raise SystemExit(f"unknown engine {kind!r}: one of {', '.join(ENGINES)}")
    engine = PagedRunner(model, max_num_seqs=8, max_seq_len=max_seq_len, page_size=16,
                         long_prefill_token_threshold=chunk, prefix_caching=False,
                         model_name="bench", deterministic=kind == "paged-deterministic")
    nbytes = sum(x.nbytes for x in _leaves(engine.pages))
    t = engine.warmup(lambda msg: None)
    print(f"  {kind} at max_seq_len {max_seq_len}: warmed up in {t:.0f}s, KV cache "
          f"{nbytes / 2**20:.0f} MiB", file=sys.stderr)
    return engine, nbytes


def dense_cache_bytes(model, rows: int, seq_len: int) -> int:
    """KV bytes of a dense cache of `rows` sequences of `seq_len` tokens (the global layers
    hold every position, the local ones their window): the layout that reserves a whole
    context per sequence, which the paged pools are measured against."""
    c = model.config
    per_position = 2 * c.num_kv_heads * c.head_dim * _kv_dtype(model).itemsize
    return rows * per_position * (c.num_global_layers * seq_len
                                  + c.num_local_layers * min(c.sliding_window, seq_len))


def _kv_dtype(model) -> np.dtype:
    """The dtype a KV value takes on this model's devices (bfloat16 pools on a CPU are held as
    their 16-bit patterns)."""
    return np.dtype(model.pages_shapes(2, 2, 1).layers[0].kv.dtype)


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


def lone_ttft(model, length: int, prompt_tokens: int, repeats: int, chunk: int) -> dict:
    """TTFT of one prompt of `prompt_tokens` alone, the deterministic and the default mode
    alternating (`--only ttft`)."""
    from serving import EngineCore

    tok = model.tokenizer
    cores = {k: EngineCore(build(model, k, length, chunk)[0]).start() for k in ENGINES[::-1]}
    times = {k: [] for k in cores}
    try:
        for r in range(repeats + 1):
            prompt = [tok.bos_id] + _text_ids(tok, prompt_tokens - 1, 100 + r)
            for kind in (list(cores) if r % 2 == 0 else list(cores)[::-1]):
                t0 = time.perf_counter()
                s = _submit(cores[kind], prompt, 2).wait()
                if r:  # the first round compiles the buckets this prompt meets
                    times[kind].append(s.times[0] - t0)
    finally:
        for core in cores.values():
            core.shutdown()
    out = {}
    for kind, ts in times.items():
        out[f"{kind}@{length}"] = {"ttft_s": ts, "ttft_median_s": float(np.median(ts))}
        print(f"  {kind:19s} a lone {prompt_tokens}-token prompt: TTFT "
              f"{np.median(ts) * 1000:6.0f} ms", file=sys.stderr)
    return out


def streams_scaling(model, length: int, counts: list[int], tokens: int, prompt_tokens: int,
                    repeats: int, chunk: int) -> dict:
    """Output tokens/s of the paged engine (max_num_seqs = the largest count) at each number
    of concurrent greedy streams (`--only streams`)."""
    from serving import EngineCore
    from serving import PagedRunner

    tok = model.tokenizer
    engine = PagedRunner(model, max_num_seqs=max(counts), max_seq_len=length, page_size=16,
                         long_prefill_token_threshold=chunk, prefix_caching=False, model_name="bench")
    engine.warmup(lambda msg: None)
    core = EngineCore(engine).start()
    rates = {n: [] for n in counts}
    try:
        for r in range(repeats):
            for n in (counts if r % 2 == 0 else counts[::-1]):
                prompts = [[tok.bos_id] + _text_ids(tok, prompt_tokens - 1, 1000 * r + i)
                           for i in range(n)]
                rates[n].append(batch_tok_s(core, prompts, tokens))
    finally:
        core.shutdown()
    out = {}
    for n, rs in rates.items():
        out[f"paged@{n}"] = {"tok_s": rs, "tok_s_median": float(np.median(rs))}
        print(f"  paged, max_num_seqs {max(counts)}: {n:3d} streams {np.median(rs):6.1f} tok/s",
              file=sys.stderr)
    return out


def capacity(model, seqs: int, prompt_tokens: int, rows: int = 8, row_len: int = 8192) -> dict:
    """How many concurrent sequences of `prompt_tokens` the paged engine serves in the KV bytes
    of a dense cache of `rows` x `row_len` tokens (`dense_cache_bytes`, `--only capacity`): the
    allocator and scheduler run for real (no model steps: the pages a sequence holds do not
    depend on the values computed)."""
    from serving import local_pages_for, paged_runner_info
    from serving import PagedScheduler
    from serving import SamplingParams
    from serving import Sequence

    c = model.config
    dtype = _kv_dtype(model)
    budget = dense_cache_bytes(model, rows, row_len)
    n_global, n_local = c.num_global_layers, c.num_local_layers
    token_layer = 2 * c.num_kv_heads * c.head_dim * dtype.itemsize
    page = 16
    per_seq_local = local_pages_for(page, c.sliding_window, page)
    per_seq_global = -(-(prompt_tokens + 16) // page)
    per_seq = (per_seq_local * n_local + per_seq_global * n_global) * page * token_layer

    def pool_bytes(info):
        return ((info.num_global_pages - 1) * n_global
                + (info.num_local_pages - 1) * n_local) * page * token_layer

    # The most sequences whose pools (as the engine sizes them: a quarter more local pages
    # than the windows need, for prefix-cache hits) fit in the dense cache's bytes.
    fits = int(budget // per_seq) + 1
    while True:
        info = paged_runner_info(model, fits, row_len, page, fits * per_seq_global * page, page,
                                 None, False, False, "bench")
        if pool_bytes(info) <= budget:
            break
        fits -= 1
    sched = PagedScheduler(info)
    sched.add([Sequence(id=i, prompt=[2] * prompt_tokens, params=SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True), seed=0) for i in range(seqs)])
    most, steps = 0, 0
    while sched.num_running or sched.num_waiting:
        plan = sched.schedule()
        steps += 1
        most = max(most, sched.num_running)
        for p in plan.pieces:
            if p.sample:
                p.seq.generated.append(7)
                if len(p.seq.generated) >= 16:
                    sched.finish(p.seq)
    res = {"dense_cache_bytes": int(budget), "bytes_per_sequence": int(per_seq),
           "sequences_that_fit": fits, "pool_bytes": int(pool_bytes(info)), "most_running": most,
           "preemptions": sched.num_preemptions, "steps": steps,
           "bytes_for_all": int(per_seq * seqs)}
    print(f"  KV bytes of a dense cache of {rows} x {row_len} tokens: {budget / 2**20:.0f} MiB; "
          f"a {prompt_tokens}-token sequence holds {per_seq / 2**20:.2f} MiB of pages ({per_seq_local} local pages "
          f"x {n_local} layers + {per_seq_global} global x {n_global}); {fits} fit, ran {most} at "
          f"once, {sched.num_preemptions} preemptions; {seqs} need "
          f"{per_seq * seqs / budget:.2f}x the bytes", file=sys.stderr)
    return res


def step_runners(model, length: int, context: int, rows: int = 8) -> dict:
    """Per engine, a function that runs one decode step of `rows` sequences at position
    `context` (what their caches hold does not matter to the time: zeros) and waits for its
    tokens. The rows hold their pages as the allocator gives them out; each call runs the same
    step again (it rewrites the same positions)."""
    from eval.paged_decode import decode_batch
    from serving import PagedRunner

    out = {}
    for kind in ENGINES:
        engine = PagedRunner(model, max_num_seqs=rows, max_seq_len=length, page_size=16,
                             prefix_caching=False, model_name="bench",
                             deterministic=kind == "paged-deterministic")
        inputs = decode_batch(engine.info, rows, context + 1, model.tokenizer.bos_id).inputs()
        out[kind] = lambda engine=engine, inputs=inputs: engine.run_step(inputs)
    return out


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
            print(f"  {kind:19s} max_seq_len {length:6d}: 8-row decode step at context {context}: "
                  f"{np.median(ts) * 1000:6.1f} ms (quartiles {np.percentile(ts, 25) * 1000:.1f}"
                  f"-{np.percentile(ts, 75) * 1000:.1f})", file=sys.stderr)
        del runners
    return out


def compare_engines(model, args) -> dict:
    """The default run: lone ITL, 8-stream tokens/s and KV bytes per engine and --max-seq-len."""
    from serving import EngineCore

    tok = model.tokenizer
    prompts = [[tok.bos_id] + _text_ids(tok, args.prompt_tokens - 1, i) for i in range(8)]
    results: dict = {}
    for length in _lengths(args):
        cores, sizes = {}, {}
        for kind in args.engines.split(","):
            engine, sizes[kind] = build(model, kind, length, args.long_prefill_token_threshold)
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
        dense = dense_cache_bytes(model, 8, length)
        print(f"  a dense cache of 8 x {length} tokens: {dense / 2**20:7.0f} MiB", file=sys.stderr)
        for kind, run in runs.items():
            entry = {"kv_cache_bytes": sizes[kind], "dense_cache_bytes": dense, **run,
                     "lone_itl_median_s": float(np.median(run["lone_itl_s"])),
                     "batch_tok_s_median": float(np.median(run["batch_tok_s"]))}
            results[f"{kind}@{length}"] = entry
            print(f"  {kind:19s} max_seq_len {length:6d}: lone ITL "
                  f"{entry['lone_itl_median_s'] * 1000:6.1f} ms, 8 streams "
                  f"{entry['batch_tok_s_median']:6.1f} tok/s, KV {sizes[kind] / 2**20:7.0f} MiB",
                  file=sys.stderr)
    return results


def _lengths(args) -> list[int]:
    return [int(x) for x in args.max_seq_len.split(",")]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("step", "ttft", "streams", "capacity"),
                   help="one of the other measurements instead of the engines' comparison")
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-seq-len", default="2048,32768")
    p.add_argument("--engines", default="paged-deterministic,paged",
                   help="comma-separated: " + ", ".join(ENGINES))
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="0: each mode's default (16, deterministic 64)")
    p.add_argument("--streams", default="8,32", help="with --only streams: stream counts")
    p.add_argument("--step-context", type=int, default=256, help="with --only step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    jax_platform.keep_freed_memory()
    from models.gemma3 import load_model

    lengths = _lengths(args)
    if args.only == "capacity":
        lengths = [max(lengths + [8192])]
    model = load_model(args.model, dtype=args.dtype, max_seq_len=max(lengths))
    results: dict = {"model": args.model, "dtype": args.dtype, "tokens": args.tokens,
                     "prompt_tokens": args.prompt_tokens, "only": args.only}
    if args.only == "step":
        results["runs"] = step_times(model, lengths, args.step_context, args.repeats)
    elif args.only == "ttft":
        results["runs"] = lone_ttft(model, lengths[0], args.prompt_tokens, args.repeats,
                                    args.long_prefill_token_threshold)
    elif args.only == "streams":
        results["runs"] = streams_scaling(model, lengths[0], [int(x) for x in args.streams.split(",")],
                                          args.tokens, args.prompt_tokens, args.repeats,
                                          args.long_prefill_token_threshold)
    elif args.only == "capacity":
        results["runs"] = capacity(model, 48, args.prompt_tokens)
    else:
        results["runs"] = compare_engines(model, args)
    write_json(args.out, results)
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
