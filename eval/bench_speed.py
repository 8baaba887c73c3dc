"""The engine at the hardware's pace, on any JAX backend: the engine core over a paged runner,
in-process (no HTTP), greedy streams, every shape met once before it is timed.

  streams   output tok/s of N concurrent streams (--prompt-tokens in, --tokens out each; one
            engine of max_num_seqs = the largest N) and their inter-token latency (per stream the
            median gap between successive tokens after the first, then the median over streams)
  ttft      a lone prompt of --long-prompt tokens: its time to first token
  step      one decode step of 8 rows at a 256-token context: the engine's step (inputs from the
            host, tokens back), an overlapped step (fed from the step in flight, as the engine
            core runs them) and the model program alone
  census    that step's compiled program: kernels of its entry computation and parameters, per
            layer; and, from a host trace of the steps (jaxlib's PjitFunction and DevicePut
            events), the programs dispatched and the arrays put on a device per step
  ready     time to ready as the server gets there (`serving.load_runner`: load, compile the
            warm-up's programs, warm up), in a fresh process over an empty compilation cache,
            then in another over the cache the first filled
  compiles  compiles (and compilation-cache reads) after ready: requests at 1, 8, 32, 64 streams
            (at most max_num_seqs) with prompts of mixed lengths on an engine just warmed up

    python -m eval.bench_speed                                    # CPU: 2 layers of 1B shapes
    python -m eval.bench_speed --model "random:1b?vocab=262000" --out speed.json   # a GPU
    python -m eval.bench_speed --only streams,step --streams 1,8,32

The stream counts default to 1,8,32,64 on an accelerator and 1,8 on a CPU. A vocabulary below
262,144 gets the byte tokenizer (the report says which). Not measured: transfers between devices
(at --tp > 1 a DevicePut may be one: the logits gathered onto the sampling device).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import jax_platform
from eval.bench_engine import _submit, _text_ids
from eval.reports import format_columns, write_json

MODES = ("streams", "ttft", "step", "census", "ready", "compiles")
DEFAULT_MODEL = "random:1b?layers=2&global_every=2&vocab=262000"
ROOT = Path(__file__).resolve().parents[1]
STEP_ROWS, STEP_CONTEXT, STEP_REPEATS, TRACE_STEPS = 8, 256, 20, 8


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def engine(model, slots: int, max_seq_len: int, precompile: str = "all"):
    """A paged runner of `slots` sequences (no prefix cache: every prompt computed), its
    step programs compiled (--precompile: every shape, or the warm-up's) and its warm-up run as
    the server does before it is ready
    (serving/runtime.py); returns (runner, seconds)."""
    from serving import PagedRunner

    t0 = time.perf_counter()
    runner = PagedRunner(model, max_num_seqs=slots, max_seq_len=max_seq_len, page_size=16,
                         prefix_caching=False, model_name="bench")
    if precompile == "all":
        runner.compile_warmup(lambda msg: None, everything=True)
    else:
        runner.compile_warmup(lambda msg: None)
    runner.warmup(lambda msg: None)
    return runner, time.perf_counter() - t0


def _round(core, prompts, tokens: int) -> tuple[float, list, float]:
    """All `prompts` submitted at once, `tokens` greedy tokens each: (output tok/s over the
    round's wall time, the streams, when they were submitted)."""
    t0 = time.perf_counter()
    streams = [_submit(core, p, tokens) for p in prompts]
    for s in streams:
        s.wait()
    return sum(len(s.times) for s in streams) / (time.perf_counter() - t0), streams, t0


def _itl(streams) -> float:
    """The median over streams of each one's median gap between successive tokens (the gaps
    after its first token)."""
    return float(np.median([np.median(np.diff(s.times)) for s in streams if len(s.times) > 1]))


def streams(core, counts: list[int], prompt_tokens: int, tokens: int, repeats: int) -> dict:
    """Per stream count: an untimed round (its step shapes met), then `repeats` timed rounds,
    the counts' order alternating between rounds."""
    tok = core.runner.tokenizer

    def prompts(n: int, seed: int):
        return [[tok.bos_id] + _text_ids(tok, prompt_tokens - 1, seed + i) for i in range(n)]

    for n in counts:
        _round(core, prompts(n, 10_000 * n), tokens)
    runs = {n: {"tok_s": [], "itl_s": [], "ttft_s": []} for n in counts}
    for r in range(repeats):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            rate, ss, t0 = _round(core, prompts(n, 1000 * (r + 1)), tokens)
            runs[n]["tok_s"].append(rate)
            runs[n]["itl_s"].append(_itl(ss))
            runs[n]["ttft_s"].append(float(np.median([s.times[0] - t0 for s in ss])))
    return {str(n): {**run, "tok_s_median": float(np.median(run["tok_s"])),
                     "itl_median_s": float(np.median(run["itl_s"])),
                     "ttft_median_s": float(np.median(run["ttft_s"]))}
            for n, run in runs.items()}


def ttft(core, length: int, repeats: int) -> dict:
    """A lone prompt of `length` tokens: its time to first token, after an untimed one."""
    tok = core.runner.tokenizer
    times = []
    for r in range(repeats + 1):
        prompt = [tok.bos_id] + _text_ids(tok, length - 1, 500 + r)
        t0 = time.perf_counter()
        s = _submit(core, prompt, 1).wait()
        if r:
            times.append(s.times[0] - t0)
    return {"prompt_tokens": length, "ttft_s": times, "ttft_median_s": float(np.median(times))}


def _context(runner) -> int:
    """The step's context: STEP_CONTEXT, or less where the overlapped steps would run past
    max_seq_len."""
    return min(STEP_CONTEXT, runner.info.max_seq_len - STEP_REPEATS - 2)


def _step_batch(runner):
    from eval.paged_decode import decode_batch

    return decode_batch(runner.info, STEP_ROWS, _context(runner) + 1, runner.tokenizer.bos_id)


def _overlapped(runner, steps: int, during=contextlib.nullcontext) -> None:
    """A first step, then `steps` more as the engine core's overlapped loop runs them: each
    dispatched before the last one's tokens are read, fed from it on the device (those within
    `during()`)."""
    batch = _step_batch(runner)
    prev = runner.dispatch_step(batch.inputs())
    with during():
        for _ in range(steps):
            pending = runner.dispatch_step(batch.inputs(fed=True), prev)
            prev.result()
            prev = pending
    prev.result()


def _plain(runner, steps: int, during=contextlib.nullcontext) -> None:
    """`steps` engine steps (`run_step`: inputs from the host, tokens back) within `during()`."""
    inputs = _step_batch(runner).inputs()
    with during():
        for _ in range(steps):
            runner.run_step(inputs)


def step(model, max_seq_len: int) -> tuple[dict, object]:
    """One 8-row decode step at context 256, median ms: the engine's (`run_step`), a step of the
    overlapped loop, and the model program alone (inputs already on the device). Returns the
    report and the runner (for `census`)."""
    import jax

    from eval.step_profile import _median_ms
    from models.gemma3.ragged import RaggedBatch
    from serving import PagedRunner

    runner = PagedRunner(model, max_num_seqs=STEP_ROWS, max_seq_len=max_seq_len, page_size=16,
                         prefix_caching=False, model_name="bench")
    inputs = _step_batch(runner).inputs()
    for _ in range(2):  # compile, then once more
        runner.run_step(inputs)
    out = {"rows": STEP_ROWS, "context": _context(runner), "repeats": STEP_REPEATS,
           "step_ms": _median_ms(lambda: runner.run_step(inputs), STEP_REPEATS)}
    _overlapped(runner, TRACE_STEPS)  # compiles the feed
    t0 = time.perf_counter()
    _overlapped(runner, STEP_REPEATS - 1)
    out["overlapped_step_ms"] = (time.perf_counter() - t0) / STEP_REPEATS * 1000
    batch = RaggedBatch(**{k: jax.device_put(np.asarray(v, np.int32), model.programs.replicated)
                           for k, v in inputs.batch.items()})

    def model_only():
        logits, runner.pages = model.ragged_step(runner.pages, batch)
        jax.block_until_ready(logits)

    model_only()
    out["model_program_ms"] = _median_ms(model_only, STEP_REPEATS)
    return out, runner


def _host_events(trace_dir: str, steps: int) -> dict:
    """Per step, from a host trace: the programs dispatched (outermost PjitFunction events, by
    name) and the arrays put on a device (DevicePut, DevicePutWithSharding events)."""
    import jax

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(max(files, key=os.path.getmtime))
    programs: collections.Counter = collections.Counter()
    puts = 0
    for plane in data.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            open_until = 0.0  # the end of the outermost PjitFunction event open
            for ev in sorted(line.events, key=lambda e: e.start_ns):
                if ev.name.startswith("PjitFunction(") and ev.start_ns >= open_until:
                    programs[ev.name[len("PjitFunction("):-1]] += 1
                    open_until = ev.start_ns + ev.duration_ns
                elif ev.name in ("DevicePut", "DevicePutWithSharding"):
                    puts += 1
    return {"programs": sum(programs.values()) / steps,
            "by_name": {k: v / steps for k, v in sorted(programs.items())},
            "device_puts": puts / steps}


def census(runner) -> dict:
    """The step's compiled program (`step`'s runner, its 8-row decode shape) counted
    (`eval.step_profile.census`), per layer; programs and device puts per step from host traces
    of `TRACE_STEPS` plain and overlapped steps."""
    import jax

    from eval.step_profile import census as count

    model = runner.model
    b = _step_batch(runner).inputs().buckets
    key = model.ragged_key(b.tokens, b.seqs, b.queries, b.global_pages, b.local_pages,
                           runner.pages, b.logits)
    c = count(model.lower_ragged(key).compile().as_text())
    layers = model.config.num_layers
    out = {"program": key.describe(), **c, "layers": layers,
           "entry_kernels_per_layer": c["entry_kernels"] / layers,
           "parameters_per_layer": c["parameters"] / layers}
    for name, run in (("plain", _plain), ("overlapped", _overlapped)):
        run(runner, TRACE_STEPS)  # anything left to compile, outside the trace
        trace = tempfile.mkdtemp(prefix="bench-speed-trace-")
        try:
            run(runner, TRACE_STEPS, lambda: jax.profiler.trace(trace))
            out[f"per_step_{name}"] = _host_events(trace, TRACE_STEPS)
        except Exception as e:  # a backend whose host trace cannot be read back
            out[f"per_step_{name}"] = {"error": repr(e)[:300]}
        finally:
            shutil.rmtree(trace, ignore_errors=True)
    return out


def compiles(core, slots: int, max_seq_len: int, tokens: int, durations: list,
             hits: list) -> dict:
    """Requests at 1, 8, 32, 64 streams (at most `slots`) with prompts of mixed lengths (up to
    max_seq_len - tokens) on an engine just warmed up: the compiles and cache reads they
    caused (`durations`, `hits`: recorded by `record_compiles` since the warm-up ended)."""
    tok = core.runner.tokenizer
    rng = np.random.default_rng(7)
    counts = sorted({min(n, slots) for n in (1, 8, 32, 64)})
    longest = max_seq_len - tokens
    t0 = time.perf_counter()
    for n in counts:
        lengths = rng.integers(2, longest + 1, n)
        _round(core, [[tok.bos_id] + _text_ids(tok, int(k) - 1, 3000 + i)
                      for i, k in enumerate(lengths)], tokens)
    return {"streams": counts, "longest_prompt": longest, "wall_s": time.perf_counter() - t0,
            "compiles": len(durations), "compile_s": float(sum(durations)),
            "cache_reads": len(hits), "cache_read_s": float(sum(hits))}


def _ready_child(args, slots: int) -> dict:
    """In a fresh process: `serving.load_runner` (as a server before /health says ready) over
    the compilation cache in args.cache_dir."""
    from eval.compile_events import record_compiles
    from serving import ServerConfig, load_runner

    durations, hits = [], []
    record_compiles(durations, hits)
    config = ServerConfig(model=args.model, tp=args.tp, dtype=args.dtype, max_num_seqs=slots,
                          max_seq_len=args.max_seq_len, compile_cache_dir=args.cache_dir)
    t0 = time.perf_counter()
    load_runner(config, lambda msg: None)
    return {"ready_s": time.perf_counter() - t0, "max_num_seqs": slots, "compiles": len(durations),
            "compile_s": float(sum(durations)), "cache_reads": len(hits),
            "cache_read_s": float(sum(hits))}


def ready(args) -> dict:
    """Time to ready in a fresh process, cold (an empty cache directory) then over the cache
    the first filled. process_s: the child's whole life (interpreter, imports, exit too). Run
    before this process starts its backend (on a GPU it would take the memory they need)."""
    out = {}
    cache = tempfile.mkdtemp(prefix="bench-speed-cache-")
    try:
        for phase in ("cold", "cached"):
            cmd = [sys.executable, "-m", "eval.bench_speed", "--only", "ready-child",
                   "--model", args.model, "--dtype", args.dtype, "--tp", str(args.tp),
                   "--max-seq-len", str(args.max_seq_len), "--cache-dir", cache]
            cmd += ["--streams", args.streams] if args.streams else []
            t0 = time.perf_counter()
            r = subprocess.run(cmd, cwd=ROOT, env=jax_platform.child_environment(),
                               capture_output=True, text=True, timeout=3600)
            if r.returncode:
                raise SystemExit(f"ready ({phase}): the child failed\n{r.stderr[-3000:]}")
            out[phase] = {**json.loads(r.stdout.strip().splitlines()[-1]),
                          "process_s": time.perf_counter() - t0}
            _log(f"ready ({phase}) in {out[phase]['ready_s']:.1f}s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out


def table(report: dict) -> str:
    """The report's figures as plain-text lines."""
    lines = [f"{report['model']} ({report['layers']} layers, vocab {report['vocab_size']}, "
             f"{report['tokenizer']} tokenizer), {report['dtype']}, tp={report['tp']}, "
             f"{report['device']} ({report['backend']}), jax {report['jax']}"]
    if "streams" in report:
        rows = [{"n": n, **r} for n, r in report["streams"].items()]
        lines += ["", format_columns(rows, [
            ("streams", ">7", lambda r: r["n"]),
            ("tok/s", ">9", lambda r: f"{r['tok_s_median']:.1f}"),
            ("ITL ms", ">8", lambda r: f"{r['itl_median_s'] * 1000:.1f}"),
            ("TTFT ms", ">8", lambda r: f"{r['ttft_median_s'] * 1000:.0f}")])]
    if "ttft" in report:
        t = report["ttft"]
        lines.append(f"\nlone {t['prompt_tokens']}-token prompt: TTFT {t['ttft_median_s'] * 1000:.0f} ms")
    if "step" in report:
        s = report["step"]
        lines.append(f"{s['rows']}-row decode step at context {s['context']}: {s['step_ms']:.2f} ms "
                     f"(overlapped {s['overlapped_step_ms']:.2f} ms, model program alone "
                     f"{s['model_program_ms']:.2f} ms)")
    if "census" in report:
        c = report["census"]
        lines.append(f"step program: {c['entry_kernels']} kernels, {c['parameters']} parameters "
                     f"({c['entry_kernels_per_layer']:.1f} and {c['parameters_per_layer']:.1f} "
                     f"a layer), {c['while_loops']} loops")
        for name in ("plain", "overlapped"):
            e = c[f"per_step_{name}"]
            lines.append(f"  {name} step: " + (e["error"] if "error" in e else
                         f"{e['programs']:g} programs ({', '.join(e['by_name'])}), "
                         f"{e['device_puts']:g} arrays put on a device"))
    if "compiles" in report:
        c = report["compiles"]
        lines.append(f"after ready, streams {c['streams']}, prompts up to {c['longest_prompt']}: "
                     f"{c['compiles']} compiles ({c['compile_s']:.1f} s), {c['cache_reads']} "
                     f"cache reads ({c['cache_read_s']:.1f} s)")
    if "ready" in report:
        for phase, r in report["ready"].items():
            lines.append(f"ready, {phase:6s}: {r['ready_s']:.1f} s (process {r['process_s']:.1f} s), "
                         f"{r['compiles']} compiles, {r['cache_reads']} cache reads")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--streams", help="stream counts (default 1,8,32,64; on a CPU 1,8)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="output tokens a stream")
    p.add_argument("--long-prompt", type=int, default=2048,
                   help="ttft's prompt (at most max_seq_len - tokens)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--precompile", default="all", choices=("all", "warmup"),
                   help="as the server's flag: every step shape compiled before ready, or the "
                        "warm-up's (the others then compile in the untimed rounds)")
    p.add_argument("--out")
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    only = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = set(only) - set(MODES) - {"ready-child"}
    if unknown:
        raise SystemExit(f"unknown --only {sorted(unknown)}: one of {', '.join(MODES)}")
    jax_platform.request_cpu_devices(args.tp)
    done = {"ready": ready(args)} if "ready" in only else {}
    import jax

    backend = jax.default_backend()
    counts = [int(x) for x in (args.streams or ("1,8" if backend == "cpu" else "1,8,32,64")).split(",")]
    slots = max(counts)
    if only == ["ready-child"]:
        print(json.dumps(_ready_child(args, slots)))
        return {}
    jax_platform.keep_freed_memory()
    from eval.compile_events import record_compiles
    from models.gemma3 import load_model
    from models.gemma3.byte_tokenizer import ByteTokenizer
    from serving import EngineCore

    t0 = time.perf_counter()
    model = load_model(args.model, tp=args.tp, dtype=args.dtype, max_seq_len=args.max_seq_len)
    c = model.config
    report: dict = {
        "model": args.model, "dtype": args.dtype, "tp": args.tp, "backend": backend,
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "layers": c.num_layers, "d_model": c.d_model, "vocab_size": c.vocab_size,
        "tokenizer": "byte" if isinstance(model.tokenizer, ByteTokenizer) else "real",
        "max_seq_len": args.max_seq_len, "max_num_seqs": slots, "prompt_tokens": args.prompt_tokens,
        "tokens": args.tokens, "repeats": args.repeats, "load_s": time.perf_counter() - t0, **done}
    _log(f"loaded {args.model} in {report['load_s']:.1f}s ({report['tokenizer']} tokenizer)")
    if {"streams", "ttft", "compiles"} & set(only):
        runner, report["warmup_s"] = engine(model, slots, args.max_seq_len, args.precompile)
        _log(f"engine of {slots} sequences compiled and warmed up in {report['warmup_s']:.1f}s")
        durations, hits = [], []
        record_compiles(durations, hits)  # from ready on; `compiles` reads them
        core = EngineCore(runner).start()
        try:
            if "compiles" in only:  # first: on the engine just through its warm-up
                report["compiles"] = compiles(core, slots, args.max_seq_len, args.tokens,
                                              durations, hits)
                _log(f"compiles after ready: {report['compiles']['compiles']}")
            if "streams" in only:
                report["streams"] = streams(core, counts, args.prompt_tokens, args.tokens,
                                            args.repeats)
                _log("streams done")
            if "ttft" in only:
                report["ttft"] = ttft(core, min(args.long_prompt, args.max_seq_len - args.tokens),
                                      args.repeats)
                _log("ttft done")
        finally:
            core.shutdown()
        del runner, core
    if {"step", "census"} & set(only):
        out, runner = step(model, args.max_seq_len)
        if "step" in only:
            report["step"] = out
        if "census" in only:
            report["census"] = census(runner)
        del runner
    _log(table(report))
    write_json(args.out, report)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
