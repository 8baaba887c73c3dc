"""Gemma 3 model speed on this machine: prefill and decode throughput, KV cache size, cold start.

  python -m eval.bench_model                      # everything, real 270M, bfloat16, tp 1 and 2
  python -m eval.bench_model --only prefill,decode --tp 1,2 --batches 1,8 --repeats 7
  python -m eval.bench_model --only kv            # 27B KV cache bytes per sequence at 32k
  python -m eval.bench_model --only cold --cold-tp 2 --cold-orbax

What is timed is the engine API a server calls (`Gemma3Model.prefill`, `.decode_step`), after
compilation and a warm-up call, with block_until_ready; the tp settings are interleaved
(A B A B ...) so that load from other processes hits them alike; medians and min-max are
reported. Prefill: one prompt of --prefill-len tokens (bucket of the same size) written into a
cache slot. Decode: every slot of a --cache-len cache decodes --steps tokens per repeat at
positions from --start-pos on (attention over that many cached positions); tokens/s counts
batch x steps. Cold start: a fresh process loads the weights and compiles one prefill bucket
and the decode step (`Gemma3Model.warm_up`), without, then with, the persistent caches a server
keeps (JAX's compilation cache for the executables, our program cache for the traced programs,
`models.gemma3.program_cache`, and the GGUF file's decoded weights,
`models.gemma3.weights_cache`): the first run with them fills them; the restarts are measured
with the compilation caches alone (weights decoded from the GGUF file again) and with all of
them; with --cold-orbax, once more from a converted orbax checkpoint instead of the GGUF file.
Both ways of starting are measured (--cold-modes): "sequential" loads the weights, then
compiles; "overlap" compiles on a thread while the weights load (`load_model(warm_up=...)`,
what `gemma3-serve` and `gemma3-generate` do).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax_platform

SECTIONS = ("prefill", "decode", "kv", "cold")


def _stats(times: list[float], work: float) -> dict:
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "n": len(times),
            "per_s": work / med, "per_s_range": [work / max(times), work / min(times)]}


def bench_prefill(models: dict, length: int, repeats: int, log) -> list[dict]:
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = {}
    caches = {}
    for tp, m in models.items():
        bucket = m.bucket_for(length)
        ids = np.zeros((1, bucket), np.int32)
        ids[0, :length] = [2] + rng.integers(4, m.config.vocab_size, length - 1).tolist()
        tokens[tp] = ids
        caches[tp] = m.init_cache(1, bucket)
    lengths, slots = np.array([length], np.int32), np.array([0], np.int32)
    times = {tp: [] for tp in models}

    def run(tp):
        t0 = time.perf_counter()
        logits, caches[tp] = models[tp].prefill(caches[tp], tokens[tp], lengths, slots)
        jax.block_until_ready((logits, caches[tp]))
        return time.perf_counter() - t0

    for tp in models:  # compile + warm-up
        run(tp)
        run(tp)
    for _ in range(repeats):
        for tp in models:
            times[tp].append(run(tp))
    rows = []
    for tp in models:
        row = {"section": "prefill", "tp": tp, "tokens": length, **_stats(times[tp], length)}
        log(f"prefill {length} tok, tp={tp}: {row['per_s']:.0f} tok/s (median of {repeats}, "
            f"{row['per_s_range'][0]:.0f}-{row['per_s_range'][1]:.0f})")
        rows.append(row)
    return rows


def bench_decode(models: dict, batches: list[int], cache_len: int, start: int, steps: int,
                 repeats: int, log) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = []
    for batch in batches:
        caches, times = {}, {tp: [] for tp in models}
        for tp, m in models.items():
            caches[tp] = m.init_cache(batch, cache_len)
        tokens = jnp.full((batch,), 1000, jnp.int32)
        # Positions come from the host, as a server's scheduler sends them.
        positions = [np.full((batch,), start + i, np.int32) for i in range(steps * (repeats + 1))]

        def run(tp, first):
            t0 = time.perf_counter()
            for i in range(steps):
                logits, caches[tp] = models[tp].decode_step(caches[tp], tokens,
                                                             positions[first + i - start])
                if i % 8 == 7:  # at most 16 programs queued (serving/dispatch_window.py)
                    jax.block_until_ready(caches[tp])
            jax.block_until_ready((logits, caches[tp]))
            return time.perf_counter() - t0

        for tp in models:
            run(tp, start)  # compile + warm-up
        for r in range(repeats):
            for tp in models:
                times[tp].append(run(tp, start + r * steps))
        for tp in models:
            row = {"section": "decode", "tp": tp, "batch": batch, "steps": steps,
                   "cache_len": cache_len, "start_pos": start,
                   **_stats(times[tp], batch * steps)}
            log(f"decode batch {batch}, tp={tp}: {row['per_s']:.1f} tok/s "
                f"({1e3 * row['median_s'] / steps:.1f} ms/step; range "
                f"{row['per_s_range'][0]:.1f}-{row['per_s_range'][1]:.1f} tok/s)")
            rows.append(row)
    return rows


def bench_kv(log) -> list[dict]:
    from models.gemma3 import CONFIGS, bytes_per_sequence

    rows = []
    for size in ("27b", "270m"):
        c = CONFIGS[size]
        ring = bytes_per_sequence(c, 32_768)
        full = bytes_per_sequence(c, 32_768, ring=False)
        rows.append({"section": "kv", "config": c.name, "seq_len": 32_768, "dtype": "bfloat16",
                     "ring_bytes": ring, "full_bytes": full, "ratio": ring / full})
        log(f"KV cache per sequence at 32k, {c.name} (bf16): ring buffers {ring / 2**30:.3f} GiB, "
            f"full-length local layers {full / 2**30:.3f} GiB, ratio {ring / full:.3f}")
    return rows


def cold_child(args) -> None:
    """One cold start, in this fresh process; prints a JSON line."""
    t0 = time.perf_counter()
    jax_platform.request_cpu_devices(args.cold_tp)
    # As gemma3-serve sets itself up: malloc keeps freed blocks, every program is cached.
    jax_platform.keep_freed_memory()
    jax_platform.enable_compilation_cache(args.cache_dir)
    from models.gemma3 import load_model

    t_import = time.perf_counter()
    warm_up = dict(num_slots=args.cold_slots, max_seq_len=args.cache_len,
                   buckets=[args.prefill_len])
    caches = {}
    if args.cache_dir:  # as gemma3-serve keeps them (serving.runtime.load_configured_model)
        caches["program_cache_dir"] = os.path.join(args.cache_dir, "programs")
        if not args.no_weights_cache:
            caches["weights_cache_dir"] = os.path.join(args.cache_dir, "weights")
    if args.overlap:  # compile while the weights load
        load_model(args.source, tp=args.cold_tp, dtype=args.dtype, max_seq_len=args.cache_len,
                   warm_up=warm_up, **caches)
        t_load = t_ready = time.perf_counter()
    else:
        model = load_model(args.source, tp=args.cold_tp, dtype=args.dtype,
                           max_seq_len=args.cache_len, **caches)
        t_load = time.perf_counter()
        model.warm_up(**warm_up)
        t_ready = time.perf_counter()
    print(json.dumps({"import_s": t_import - t0, "load_s": t_load - t_import,
                      "compile_s": t_ready - t_load, "total_s": t_ready - t0}))


COLD_MODES = ("sequential", "overlap")


def bench_cold(args, log) -> list[dict]:
    def start(cache_dir, source, overlap, weights_cache=True):
        cmd = [sys.executable, "-m", "eval.bench_model", "--cold-child", "--source", source,
               "--dtype", args.dtype, "--cold-tp", str(args.cold_tp), "--cache-len",
               str(args.cache_len), "--prefill-len", str(args.prefill_len), "--cold-slots",
               str(args.cold_slots)] + (["--cache-dir", cache_dir] if cache_dir else []) + \
            (["--overlap"] if overlap else []) + ([] if weights_cache else ["--no-weights-cache"])
        # The child asks for its own --cold-tp devices, not this process's count.
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env=jax_platform.child_environment(malloc_tunables=False))
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows = []
    modes = [m for m in args.cold_modes.split(",") if m]
    with tempfile.TemporaryDirectory() as ckpt:
        if args.cold_orbax:
            _convert(args.source, args.dtype, f"{ckpt}/model")
        for mode in modes:
            with tempfile.TemporaryDirectory() as cache_dir:
                runs = [("no caches", None, args.source, False),
                        ("caches empty (fills them)", cache_dir, args.source, True),
                        ("compilation caches warm, weights decoded again", cache_dir,
                         args.source, False),
                        ("compilation and weights caches warm (restart)", cache_dir,
                         args.source, True)]
                if args.cold_orbax:
                    runs.append(("compilation caches warm, converted orbax checkpoint", cache_dir,
                                 f"{ckpt}/model", False))
                mode_rows = []
                for name, d, source, weights_cache in runs:
                    r = start(d, source, mode == "overlap", weights_cache)
                    mode_rows.append({"section": "cold", "mode": mode, "run": name,
                                      "tp": args.cold_tp, **r})
                    parts = (f"load and compile overlapped {r['load_s']:.1f}" if mode == "overlap"
                             else f"load {r['load_s']:.1f}, compile {r['compile_s']:.1f}")
                    log(f"cold start tp={args.cold_tp}, {mode}, {name}: {r['total_s']:.1f} s "
                        f"(import {r['import_s']:.1f}, {parts})")
            for i, name in ((2, "compilation caches"), (3, "compilation and weights caches"),
                            (4, "compilation caches + orbax checkpoint")):
                if i < len(runs):
                    speedup = mode_rows[0]["total_s"] / mode_rows[i]["total_s"]
                    mode_rows.append({"section": "cold", "mode": mode, "run": f"speedup: {name}",
                                      "value": speedup})
                    log(f"cold start speed-up, {mode}, {name}: {speedup:.1f}x")
            rows += mode_rows
    return rows


def _convert(source: str, dtype: str, path: str) -> None:
    """Write `source` as a converted orbax checkpoint (in a child process: its own devices)."""
    code = ("import sys; from models.gemma3 import load_model; "
            "load_model(sys.argv[1], dtype=sys.argv[2]).save(sys.argv[3])")
    subprocess.run([sys.executable, "-c", code, source, dtype, path], check=True,
                   capture_output=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--source", default="gemma3-270m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", default="1,2", help="comma-separated tp values (interleaved)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"subset of {SECTIONS}")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--cache-len", type=int, default=1024)
    p.add_argument("--start-pos", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cold-tp", type=int, default=2)
    p.add_argument("--cold-slots", type=int, default=8)
    p.add_argument("--cold-orbax", action="store_true",
                   help="also restart from a converted orbax checkpoint of --source")
    p.add_argument("--cold-modes", default=",".join(COLD_MODES),
                   help="cold start: 'sequential' (load, then compile) and/or 'overlap' (compile "
                        "while the weights load)")
    p.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)  # child: overlap
    p.add_argument("--no-weights-cache", action="store_true", help=argparse.SUPPRESS)  # child
    p.add_argument("--out", help="write all rows as JSON here")
    p.add_argument("--cold-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cold_child:
        return cold_child(args)

    bad_modes = set(args.cold_modes.split(",")) - set(COLD_MODES)
    if bad_modes:
        p.error(f"unknown cold-start modes {sorted(bad_modes)}; choose from {COLD_MODES}")
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    tps = [int(t) for t in args.tp.split(",")]
    jax_platform.request_cpu_devices(max(tps))
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    rows = []
    if "prefill" in sections or "decode" in sections:
        from models.gemma3 import load_model

        models = {tp: load_model(args.source, tp=tp, dtype=args.dtype,
                                 max_seq_len=max(args.cache_len, args.prefill_len)) for tp in tps}
        log(f"models: {', '.join(repr(m) for m in models.values())}; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        if "prefill" in sections:
            rows += bench_prefill(models, args.prefill_len, args.repeats, log)
        if "decode" in sections:
            rows += bench_decode(models, [int(b) for b in args.batches.split(",")],
                                 args.cache_len, args.start_pos, args.steps, args.repeats, log)
        del models
    if "kv" in sections:
        rows += bench_kv(log)
    if "cold" in sections:
        rows += bench_cold(args, log)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "load_average": os.getloadavg(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
