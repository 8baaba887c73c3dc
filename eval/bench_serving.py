"""Serving benchmark: streams requests through the OpenAI-compatible server at several
concurrency levels and reports time to first token (TTFT), inter-token latency (ITL), time per
output token (TPOT), end-to-end latency (E2E) as mean / median / p99, and throughput.

Definitions (vLLM's benchmark_serving):
  TTFT  request sent -> first generated token received (includes queueing and prefill);
  ITL   gap between consecutive tokens of a stream (every gap of every request);
  TPOT  per request (E2E - TTFT) / (output tokens - 1): the first token is excluded;
  E2E   request sent -> last token received;
  throughput  generated tokens / wall time of the whole level (all streams together).
Each stream sends its requests one after another (closed loop), so a level with 8 streams keeps
8 requests in flight. Requests use greedy decoding with `ignore_eos`; request i generates a number
of tokens drawn uniformly from [L(1 - r), L(1 + r)] (L = --max-tokens, r = --range-ratio, seeded,
the same draws at every level; vLLM's random-dataset convention). With r = 0 every request has the
same length, the streams finish together and all arrive again at once, so every request of a level
meets 7 others in the same prefill burst; r > 0 lets them drift apart as in real traffic.

    python -m eval.bench_serving                       # starts gemma3-serve (270M, bf16) itself
    python -m eval.bench_serving --url http://127.0.0.1:8000 --concurrency 1,8

--engine-ratio R: the server's 8-stream output tokens/s against the engine's batch-8 decode
tokens/s measured in this process (the same paged engine the server builds, `load_runner`,
driven directly: ragged steps of one token for each of max-num-seqs rows, each step's tokens fed to
the next, no scheduler, no HTTP), R times each, alternating (engine, server, engine, ...), and
their median ratio:

    python -m eval.bench_serving --engine-ratio 3 --max-tokens 256 --requests-per-stream 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

import jax_platform

ROOT = Path(__file__).resolve().parents[1]

TOPICS = ["the sea", "a lighthouse keeper", "the first snow of winter", "a lost key", "a robot learning to paint",
          "an old library", "the night train", "a garden on the moon", "two rival bakers", "a forgotten song",
          "the last bookshop", "a storm at harvest", "a clock that runs backwards", "a letter never sent",
          "the mountain village", "a city of bridges"]


def prompt_for(i: int) -> str:
    return (f"Write a short story about {TOPICS[i % len(TOPICS)]}. Describe the place, the people and "
            f"what changes for them by the end.\n\nStory:")


def summarize(xs) -> dict:
    a = np.asarray(xs, dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "median": None, "p99": None, "max": None, "n": 0}
    # max: one stall (a compile between two tokens) is under the p99 of a few hundred gaps.
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "n": int(a.size)}


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "logprobs": 0}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            lp = chunk["choices"][0]["logprobs"]
            now = time.perf_counter()
            times += [now] * (len(lp["tokens"]) if lp else 0)  # one chunk per token when logprobs are on
    if not times:
        raise RuntimeError("no tokens received")
    ttft = times[0] - t0
    e2e = times[-1] - t0
    n = len(times)
    return {"ttft": ttft, "e2e": e2e, "itl": list(np.diff(times)), "tokens": n,
            "tpot": (e2e - ttft) / (n - 1) if n > 1 else None}


def output_len(i: int, max_tokens: int, range_ratio: float) -> int:
    lo = max(1, round(max_tokens * (1 - range_ratio)))
    hi = max(lo, round(max_tokens * (1 + range_ratio)))
    return int(np.random.default_rng(i).integers(lo, hi + 1))


async def run_level(url: str, model: str, concurrency: int, requests_per_stream: int, max_tokens: int,
                    range_ratio: float = 0.0) -> dict:
    results = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        async def stream(k: int):
            for j in range(requests_per_stream):
                i = k * requests_per_stream + j
                results.append(await one_request(client, model, prompt_for(i),
                                                 output_len(i, max_tokens, range_ratio)))

        t0 = time.perf_counter()
        await asyncio.gather(*(stream(k) for k in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency, "requests": len(results), "output_tokens": tokens, "wall_s": wall,
        "output_tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall,
        "ttft_s": summarize([r["ttft"] for r in results]),
        "tpot_s": summarize([r["tpot"] for r in results if r["tpot"] is not None]),
        "itl_s": summarize([x for r in results for x in r["itl"]]),
        "e2e_s": summarize([r["e2e"] for r in results]),
    }


def engine_decode_rate(engine, steps: int, start: int = 40, overlapped: bool = False) -> float:
    """Tokens/s of `steps` back-to-back decode steps of a PagedRunner, one token for each of
    its max_num_seqs rows (greedy, each step fed the previous step's tokens, positions from
    `start`): the engine alone. With `overlapped`, each step is dispatched fed from the previous
    one on the device before that one's tokens are read back (`dispatch_step`), as the engine
    core's overlapped loop does."""
    from eval.paged_decode import decode_batch

    batch = decode_batch(engine.info, engine.info.max_num_seqs, start, engine.tokenizer.bos_id)

    def run(n: int) -> None:
        pending = None
        for _ in range(n):
            if not overlapped:
                batch.accept(engine.run_step(batch.inputs()).tokens)
                continue
            step = engine.dispatch_step(batch.inputs(fed=pending is not None), pending)
            if pending is not None:
                batch.accept(pending.result().tokens)
            pending = step
        if pending is not None:
            batch.accept(pending.result().tokens)

    run(2)  # warm: the step's programs and, overlapped, the token feed's
    t0 = time.perf_counter()
    run(steps)
    return engine.info.max_num_seqs * steps / (time.perf_counter() - t0)


def load_local_engine(args):
    """The engine the started server builds (same flags), in this process."""
    from serving import ServerConfig, load_runner

    if args.server_arg:
        raise SystemExit("--engine-ratio does not pass --server-arg to the local engine: drop them")
    config = ServerConfig(model=args.model, dtype=args.dtype, tp=args.tp, allreduce=args.allreduce,
                          max_num_seqs=args.max_num_seqs, max_seq_len=args.max_seq_len)
    jax_platform.request_cpu_devices(args.tp)
    return load_runner(config, lambda msg: None)


def engine_ratio(args, url: str, model: str, engine) -> dict:
    """Alternating engine and max-num-seqs-stream server runs; medians and their ratio. The engine
    runs its decode steps one by one (`run_step`) and overlapped (`dispatch_step`)."""
    modes = ["sync", "overlapped"]
    eng: dict[str, list[float]] = {m: [] for m in modes}
    srv = []
    n = engine.info.max_num_seqs
    for _ in range(args.engine_ratio):
        for m in modes:
            eng[m].append(engine_decode_rate(engine, args.engine_steps, overlapped=m == "overlapped"))
        level = asyncio.run(run_level(url, model, n, args.requests_per_stream, args.max_tokens, args.range_ratio))
        srv.append(level["output_tokens_per_s"])
        print(f"  engine batch-{n} decode " + ", ".join(f"{m} {eng[m][-1]:.1f}" for m in modes) +
              f" tok/s; server {n} streams {srv[-1]:.1f} tok/s: {srv[-1] / eng['sync'][-1]:.3f} of sync",
              file=sys.stderr)
    s = float(np.median(srv))
    out = {"server_tok_s": srv, "server_median": s}
    for m in modes:
        e = float(np.median(eng[m]))
        out[m] = {"engine_tok_s": eng[m], "engine_median": e, "ratio": s / e,
                  "ratios": [b / a for a, b in zip(eng[m], srv)]}
    return out


def start_server(args) -> tuple[subprocess.Popen, str]:
    # Malloc tunables as the container image runs it; the server asks for its own --tp devices.
    env = jax_platform.child_environment()
    cmd = [sys.executable, "-m", "serving.cli", "--port", str(args.port), "--model", args.model,
           "--dtype", args.dtype, "--tp", str(args.tp), "--allreduce", args.allreduce,
           "--max-num-seqs", str(args.max_num_seqs), "--max-seq-len", str(args.max_seq_len),
           *args.server_arg]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} (see --server-log)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t0 > args.startup_timeout:
            proc.kill()
            raise SystemExit("the server did not become ready in time")
        time.sleep(1)
    print(f"server ready in {time.perf_counter() - t0:.0f}s (load, compile, warm-up)", file=sys.stderr)
    return proc, url


def fmt_row(level: dict) -> str:
    ms = lambda s, k: f"{1000 * level[s][k]:.0f}"  # noqa: E731
    return (f"| {level['concurrency']} | {level['requests']} | {level['output_tokens_per_s']:.1f} | "
            f"{ms('ttft_s', 'mean')} / {ms('ttft_s', 'median')} / {ms('ttft_s', 'p99')} | "
            f"{ms('tpot_s', 'mean')} / {ms('tpot_s', 'median')} / {ms('tpot_s', 'p99')} | "
            f"{ms('itl_s', 'mean')} / {ms('itl_s', 'median')} / {ms('itl_s', 'p99')} / "
            f"{ms('itl_s', 'max')} | "
            f"{ms('e2e_s', 'mean')} / {ms('e2e_s', 'median')} / {ms('e2e_s', 'p99')} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="benchmark a running server instead of starting one")
    p.add_argument("--concurrency", default="1,8", help="comma-separated stream counts")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request (mean)")
    p.add_argument("--range-ratio", type=float, default=None,
                   help="output lengths uniform in [L(1-r), L(1+r)]; 0 = all equal (default 0.5; "
                        "with --engine-ratio 0, so that the server stays at max-num-seqs streams "
                        "until the end, as the engine's batch does)")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--engine-ratio", type=int, default=0, metavar="R",
                   help="instead of the levels: R alternating runs of the engine's batch decode "
                        "(in this process) and the server at max-num-seqs streams, and their ratio")
    p.add_argument("--engine-steps", type=int, default=128, help="--engine-ratio: decode steps per engine run")
    g = p.add_argument_group("server started by the benchmark (ignored with --url)")
    g.add_argument("--model", default="gemma3-270m")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--allreduce", default="bf16",
                   help="the server's AllReduce label (e.g. int8-semi+hadamard), passed on as is")
    g.add_argument("--max-num-seqs", type=int, default=8)
    g.add_argument("--max-seq-len", type=int, default=512)
    g.add_argument("--port", type=int, default=8011)
    g.add_argument("--server-log")
    g.add_argument("--server-arg", action="append", default=[], help="extra gemma3-serve flag (repeatable)")
    g.add_argument("--startup-timeout", type=float, default=1800)
    args = p.parse_args(argv)
    if args.range_ratio is None:
        args.range_ratio = 0.0 if args.engine_ratio else 0.5

    if args.engine_ratio and "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", ""):
        # The engine measured here runs under the server's malloc tunables too.
        os.execve(sys.executable, [sys.executable, "-m", "eval.bench_serving", *sys.argv[1:]],
                  jax_platform.child_environment())
    proc = None
    url = args.url
    if args.engine_ratio and url is not None:
        raise SystemExit("--engine-ratio starts its own server (the same flags as its engine)")
    if url is None:
        proc, url = start_server(args)
    try:
        if args.engine_ratio:
            engine = load_local_engine(args)
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            asyncio.run(run_level(url, model, 1, max(1, args.warmup_requests), 8))
            r = engine_ratio(args, url, model, engine)
            for m in ("sync", "overlapped"):
                if m in r:
                    e = r[m]
                    print(f"server {r['server_median']:.1f} tok/s at {args.max_num_seqs} streams / "
                          f"engine ({m}) {e['engine_median']:.1f} tok/s batch-{args.max_num_seqs} "
                          f"decode = {e['ratio']:.3f} "
                          f"(medians of {args.engine_ratio}; per run {', '.join(f'{x:.3f}' for x in e['ratios'])})")
            if args.out:
                Path(args.out).write_text(json.dumps(r, indent=2))
            return
        info = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        model = info["id"]
        if args.warmup_requests:
            asyncio.run(run_level(url, model, 1, args.warmup_requests, 8))
        levels = []
        for c in (int(x) for x in args.concurrency.split(",")):
            level = asyncio.run(run_level(url, model, c, args.requests_per_stream, args.max_tokens,
                                          args.range_ratio))
            levels.append(level)
            print(f"concurrency {c}: {level['output_tokens_per_s']:.1f} tok/s, median TTFT "
                  f"{1000 * level['ttft_s']['median']:.0f} ms, median TPOT {1000 * level['tpot_s']['median']:.0f} ms",
                  file=sys.stderr)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()

    result = {"server": {k: info.get(k) for k in ("id", "tp", "dtype", "allreduce_label", "max_model_len")},
              "max_tokens": args.max_tokens, "range_ratio": args.range_ratio,
              "requests_per_stream": args.requests_per_stream, "levels": levels}
    if len(levels) >= 2 and levels[0]["concurrency"] == 1:
        lone = levels[0]["ttft_s"]["median"]
        result["ttft_median_ratio_vs_lone"] = {lv["concurrency"]: lv["ttft_s"]["median"] / lone for lv in levels[1:]}
    print("| streams | requests | output tok/s | TTFT ms mean / median / p99 | TPOT ms mean / median / p99 "
          "| ITL ms mean / median / p99 / max | E2E ms mean / median / p99 |")
    print("|---|---|---|---|---|---|---|")
    for level in levels:
        print(fmt_row(level))
    if "ttft_median_ratio_vs_lone" in result:
        print("median TTFT / lone request's median TTFT: " +
              ", ".join(f"{c} streams {r:.2f}x" for c, r in result["ttft_median_ratio_vs_lone"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
