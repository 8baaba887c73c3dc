"""Engine benchmark: the engine core over the paged engine, driven in-process (no HTTP), for the
costs and gains of the engine's scheduling modes (docs/engine.md):

  throughput  8 closed-loop greedy streams (4 requests each, 32-96 tokens), the deterministic
              (batch-invariant) mode against the default mode: tokens/s of the whole run.
  prefix      time to first token of a request whose first 1,500 tokens another request already
              prefilled (prefix cache hit) against that first request's (the default mode).
  itl         inter-token latency of 4 running streams while a 2,000-token prompt is admitted
              (its pieces beside their decodes: p99 of their gaps from its arrival to its first
              token) against their median gap without it; the default mode, or both modes with
              --itl-modes 2.
  burst       8 requests of mixed prompt lengths at once on an engine just through its warm-up
              (a server the moment it is ready: no background compile yet), then 8 others:
              the step shapes the warm-up left compile inside the first burst, stalling every
              stream; the first burst's time and longest gap against the second's.

    python -m eval.bench_engine                          # all four, gemma3-270m bfloat16
    python -m eval.bench_engine --only prefix,itl --long-prefill-token-threshold 16 --out report.json
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np

import jax_platform


def _text_ids(tokenizer, n: int, seed: int) -> list[int]:
    """`n` token ids of ordinary text (the real tokenizer's), deterministic per seed."""
    words = ("the sea lighthouse keeper winter snow lost key robot paint library night train garden "
             "moon rival bakers forgotten song bookshop storm harvest clock letter mountain village "
             "city bridges river market children evening quiet light road").split()
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(rng.choice(words, 64)) + ". ")
    return ids[:n]


class Stream:
    """A sink recording every token of one request: its arrival time, id and logprob."""

    def __init__(self):
        self.times: list[float] = []
        self.tokens: list[tuple[int, float | None]] = []
        self.done = threading.Event()
        self.error = None

    def __call__(self, event) -> None:
        now = time.perf_counter()
        self.times += [now] * len(event.tokens)
        self.tokens += [(t.id, t.logprob) for t in event.tokens]
        if event.finish_reason is not None:
            self.error = event.error
            self.done.set()

    def wait(self, timeout: float = 3600) -> "Stream":
        if not self.done.wait(timeout) or self.error:
            raise RuntimeError(f"request failed: {self.error}")
        return self


def _submit(core, ids, max_tokens: int) -> Stream:
    from serving import SamplingParams

    s = Stream()
    core.submit([(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0), s)])
    return s


def _engine(model, args, deterministic: bool, prefix: bool, max_num_seqs: int,
            background: bool = True):
    from serving import PagedRunner

    engine = PagedRunner(model, max_num_seqs=max_num_seqs, max_seq_len=args.max_seq_len,
                         page_size=args.page_size,
                         long_prefill_token_threshold=args.long_prefill_token_threshold,
                         prefix_caching=prefix, deterministic=deterministic, model_name="bench")
    # Ready as a server is once its background compiler is done (serving/runtime.py,
    # serving/background_compile.py): the warm-up's programs compiled and run, then every other
    # step shape compiled, so that no timed step waits for a compile (the deterministic mode
    # has none left after the warm-up); with --no-background-compile, as ready as such a
    # server is after its warm-up.
    t0 = time.perf_counter()
    engine.compile_warmup(lambda msg: None)
    engine.warmup(lambda msg: None)
    if args.background_compile and background:
        engine.model.compile_ragged(engine.later_programs())
    print(f"  engine ({'deterministic' if deterministic else 'default'} mode, pieces of "
          f"{engine.info.long_prefill_token_threshold}, {max_num_seqs} sequences) compiled and "
          f"warmed up in "
          f"{time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return engine


def bench_throughput(model, args) -> dict:
    """8 closed-loop streams (bench_serving's load): each sends `args.requests` requests one after
    another, a short prompt each and an output length drawn from [L/2, 3L/2] (L = args.tokens,
    the same draws for both modes). The two modes' runs alternate (a shared machine's load
    drifts); tokens/s of the whole run, median over the repeats."""
    from serving import EngineCore

    lengths = np.random.default_rng(0).integers(args.tokens // 2, 3 * args.tokens // 2 + 1, (8, args.requests))
    prompts = [[model.tokenizer.bos_id] + _text_ids(model.tokenizer, 24, i) for i in range(8 * args.requests)]
    modes = {"default": False, "deterministic": True}
    cores = {name: EngineCore(_engine(model, args, det, prefix=False, max_num_seqs=8)).start()
             for name, det in modes.items()}
    runs: dict[str, list] = {name: [] for name in modes}

    def stream(core, k: int, out: list) -> None:
        for j in range(args.requests):
            out.append(len(_submit(core, prompts[k * args.requests + j], int(lengths[k, j])).wait().times))

    def tok_s(core) -> float:
        counts: list[int] = []
        t0 = time.perf_counter()
        threads = [threading.Thread(target=stream, args=(core, k, counts)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) / (time.perf_counter() - t0)

    try:
        for core in cores.values():
            # A round untimed: the few small programs the warm-up does not run (the sampler's,
            # the overlapped loop's token feed at each step shape) compile on first use.
            tok_s(core)
        for r in range(args.repeats):
            for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                runs[name].append(tok_s(cores[name]))
    finally:
        for core in cores.values():
            core.shutdown()
    out = {}
    for name in modes:
        out[name] = {"tok_s": float(np.median(runs[name])), "runs": runs[name]}
        print(f"  {name}: {out[name]['tok_s']:.1f} tok/s (median of {args.repeats}: "
              f"{', '.join(f'{x:.1f}' for x in runs[name])})", file=sys.stderr)
    out["deterministic_cost"] = 1 - out["deterministic"]["tok_s"] / out["default"]["tok_s"]
    return out


def bench_prefix(model, args) -> dict:
    """TTFT of a request sharing a 1,500-token prefix with an earlier one, against the earlier
    one's; and the prompt tokens the second found cached (whole pages of the shared prefix)."""
    from serving import EngineCore

    engine = _engine(model, args, False, prefix=True, max_num_seqs=args.max_num_seqs)
    tok = model.tokenizer
    prefix = [tok.bos_id] + _text_ids(tok, args.prefix_tokens - 1, 100)
    core = EngineCore(engine).start()
    try:
        ttfts = []
        for i in range(2):
            t0 = time.perf_counter()
            s = _submit(core, prefix + _text_ids(tok, 40, 200 + i), 2).wait()
            ttfts.append(s.times[0] - t0)
        hit = core.scheduler.kv.hits
    finally:
        core.shutdown()
    out = {"prefix_tokens": args.prefix_tokens, "first_ttft_s": ttfts[0], "second_ttft_s": ttfts[1],
           "ratio": ttfts[1] / ttfts[0], "hit_tokens": hit}
    print(f"  TTFT first {ttfts[0] * 1000:.0f} ms, second {ttfts[1] * 1000:.0f} ms "
          f"({hit} tokens cached): {out['ratio']:.3f}x", file=sys.stderr)
    return out


def bench_itl(model, args) -> dict:
    """4 running streams; a 2,000-token prompt arrives; their gaps during its admission."""
    from serving import EngineCore

    out = {}
    for name, det in (("default", False), ("deterministic", True))[:args.itl_modes]:
        engine = _engine(model, args, det, prefix=False, max_num_seqs=args.max_num_seqs)
        tok = model.tokenizer
        core = EngineCore(engine).start()
        try:
            _submit(core, [tok.bos_id] + _text_ids(tok, 20, 1), 4).wait()
            streams = [_submit(core, [tok.bos_id] + _text_ids(tok, 20, 10 + i), args.itl_tokens) for i in range(4)]
            while min(len(s.times) for s in streams) < 8:  # all four decoding
                time.sleep(0.01)
            # The baseline lasts --baseline-s, but ends while the streams have three quarters
            # of their tokens left: on a fast machine they would otherwise end before the long
            # prompt arrives, leaving no gap to measure during its admission.
            deadline = time.perf_counter() + args.baseline_s
            while time.perf_counter() < deadline and min(
                    len(s.times) for s in streams) < args.itl_tokens // 4:
                time.sleep(0.005)
            t_arrive = time.perf_counter()
            long = _submit(core, [tok.bos_id] + _text_ids(tok, args.long_tokens - 1, 2), 2)
            while not long.times:
                time.sleep(0.005)
            t_first = long.times[0]
            for s in streams:
                s.wait()
            long.wait()
        finally:
            core.shutdown()
        base, during = [], []
        for s in streams:
            t = np.asarray(s.times[4:])  # past the start-up
            gaps, ends = np.diff(t), t[1:]
            base += list(gaps[ends < t_arrive])
            during += list(gaps[(ends > t_arrive) & (t[:-1] < t_first)])
        if not base or not during:  # a model so fast that no gap fell in a window
            raise RuntimeError(f"no gaps to compare ({len(base)} before, {len(during)} during the "
                               "admission): raise --baseline-s or --long-tokens")
        med, p99 = float(np.median(base)), float(np.percentile(during, 99))
        out[name] = {"baseline_median_itl_s": med, "baseline_gaps": len(base), "admission_p99_itl_s": p99,
                     "admission_median_itl_s": float(np.median(during)),
                     "admission_max_itl_s": float(np.max(during)), "admission_gaps": len(during),
                     "admission_s": t_first - t_arrive, "ratio": p99 / med}
        print(f"  {name}: median ITL {med * 1000:.1f} ms without, median {np.median(during) * 1000:.1f} "
              f"and p99 {p99 * 1000:.1f} ms while the "
              f"{args.long_tokens}-token prompt is admitted ({t_first - t_arrive:.1f} s): {p99 / med:.2f}x",
              file=sys.stderr)
    return out


# The burst's prompt lengths, as fractions of --burst-tokens: lone-prompt and beside-others
# pieces of several token buckets, as a first minute of chat traffic brings.
BURST_FRACTIONS = (0.03, 0.13, 0.3, 0.5, 0.73, 1.0, 0.08, 0.2)


def bench_burst(model, args) -> dict:
    """8 requests sent at once to an engine just through its warm-up, then 8 others (other
    texts, no prefix hits) once they are done: each burst's wall time from sending to the last
    token, and its longest gap between two tokens of a stream."""
    from serving import EngineCore

    engine = _engine(model, args, False, prefix=True, max_num_seqs=8, background=False)
    tok = model.tokenizer
    core = EngineCore(engine).start()
    runs = []
    try:
        for burst in range(2):
            t0 = time.perf_counter()
            streams = [_submit(core, [tok.bos_id] + _text_ids(tok, max(1, int(f * args.burst_tokens)),
                                                               300 + 10 * burst + i), args.tokens)
                       for i, f in enumerate(BURST_FRACTIONS)]
            for s in streams:
                s.wait()
            gaps = [float(np.max(np.diff(s.times))) for s in streams if len(s.times) > 1]
            runs.append({"wall_s": max(s.times[-1] for s in streams) - t0,
                         "longest_gap_s": max(gaps, default=0.0),
                         "ttft_s": [s.times[0] - t0 for s in streams]})
    finally:
        core.shutdown()
    out = {"first": runs[0], "second": runs[1], "ratio": runs[0]["wall_s"] / runs[1]["wall_s"]}
    for name, r in (("first", runs[0]), ("second", runs[1])):
        print(f"  {name} burst: {r['wall_s']:.1f} s, longest gap {r['longest_gap_s']:.2f} s, TTFT "
              f"{min(r['ttft_s']):.2f}-{max(r['ttft_s']):.2f} s", file=sys.stderr)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="throughput,prefix,itl,burst",
                   help="comma-separated: throughput, prefix, itl, burst")
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--allreduce", default="bf16")
    p.add_argument("--max-seq-len", type=int, default=2560)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, help="the most prompt "
                   "tokens a step computes for one sequence beside others (a multiple of --page-size; 0: "
                   "each mode's default, 16 or deterministic 64)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences running at once")
    p.add_argument("--tokens", type=int, default=64, help="throughput: mean tokens per request")
    p.add_argument("--requests", type=int, default=4, help="throughput: requests per stream")
    p.add_argument("--repeats", type=int, default=3, help="throughput: runs per mode, alternating (median)")
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--itl-tokens", type=int, default=400, help="itl: tokens per running stream")
    p.add_argument("--baseline-s", type=float, default=3.0, help="itl: seconds of gaps without the long prompt")
    p.add_argument("--itl-modes", type=int, default=1, choices=(1, 2),
                   help="itl: the default mode only, or both")
    p.add_argument("--burst-tokens", type=int, default=300, help="burst: the longest prompt")
    p.add_argument("--compile-cache-dir", default=None)
    p.add_argument("--no-background-compile", dest="background_compile", action="store_false",
                   help="measure a server started with --no-background-compile: the step shapes "
                        "the warm-up leaves compile on first use, inside the timed runs")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    jax_platform.request_cpu_devices(args.tp)

    from eval.reports import write_json
    from serving import ServerConfig, configure_jax, load_configured_model

    config = ServerConfig(model=args.model, dtype=args.dtype, tp=args.tp, allreduce=args.allreduce,
                          max_seq_len=args.max_seq_len,
                          long_prefill_token_threshold=args.long_prefill_token_threshold,
                          page_size=args.page_size, compile_cache_dir=args.compile_cache_dir)
    configure_jax(config)
    model = load_configured_model(config)
    report = {"model": args.model, "dtype": args.dtype, "tp": args.tp, "allreduce": args.allreduce,
              "max_seq_len": args.max_seq_len,
              "long_prefill_token_threshold": args.long_prefill_token_threshold, "page_size": args.page_size,
              "command": "python -m eval.bench_engine " + " ".join(argv if argv is not None else sys.argv[1:])}
    for part in args.only.split(","):
        print(f"{part}:", file=sys.stderr)
        report[part] = {"throughput": bench_throughput, "prefix": bench_prefix, "itl": bench_itl,
                        "burst": bench_burst}[part](model, args)
    write_json(args.out, report)
    if "throughput" in report:
        cost = report["throughput"]["deterministic_cost"]
        print(f"deterministic mode's cost at 8 streams: {100 * cost:.1f}% of tok/s")
    if "prefix" in report:
        print(f"TTFT with a {args.prefix_tokens}-token prefix hit: {report['prefix']['ratio']:.3f}x the miss")
    for name, r in report.get("itl", {}).items():
        print(f"p99 ITL of 4 streams while a {args.long_tokens}-token prompt is admitted ({name}): "
              f"{r['ratio']:.2f}x their median")
    if "burst" in report:
        print(f"a first burst of 8 requests on a just-warmed engine: {report['burst']['ratio']:.2f}x "
              f"the time of the next")


if __name__ == "__main__":
    main()
