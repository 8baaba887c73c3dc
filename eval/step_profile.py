"""Where one decode step's time goes, on any backend: the engine's step (`PagedRunner.run_step`)
against its parts run alone (the inputs' transfer, the model program, the sampler), the
compiled programs' census (kernels of the entry computation, parameters) and, where the
profiler can read it back, the device's largest kernels.

    python -m eval.step_profile --model "random:1b?vocab=262000" --rows 8 --context 256
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

import numpy as np


def census(hlo_text: str) -> dict:
    """Counts of the compiled module's ENTRY instructions by opcode, the ENTRY's kernels
    (fusions, custom calls, copies, ...: every instruction but parameters, tuples, constants
    and bitcasts), its parameters, and the kernels inside while loops' bodies (each runs once
    per iteration)."""
    comps: dict[str, list[str]] = {}
    entry = None
    name = None
    for line in hlo_text.splitlines():
        m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            name = m.group(2)
            comps[name] = []
            if m.group(1):
                entry = name
            continue
        if name is not None and line.startswith("  ") and "=" in line:
            comps[name].append(line)
    ops = collections.Counter()
    loops = 0
    for line in comps.get(entry, []):
        m = re.search(r"=\s*[^=]*?\s([a-z][\w\-]*)\(", line)
        if m:
            ops[m.group(1)] += 1
            if m.group(1) == "while":
                loops += 1
    free = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast"}
    body_kernels = 0
    for line in comps.get(entry, []):
        m = re.search(r"body=%?([\w.\-]+)", line)
        if m:
            body_kernels += sum(1 for ln in comps.get(m.group(1), [])
                                if re.search(r"\s(fusion|custom-call|copy|scatter|gather|"
                                             r"dynamic-update-slice|sort)\(", ln))
    return {"entry_kernels": sum(n for op, n in ops.items() if op not in free),
            "parameters": ops.get("parameter", 0), "while_loops": loops,
            "kernels_in_loop_bodies": body_kernels, "ops": dict(ops.most_common(12))}


def dumped_census(dump_dir: str, pattern: str) -> dict:
    """`census` of the largest after-optimizations module in `dump_dir` matching `pattern`."""
    files = glob.glob(os.path.join(dump_dir, f"*{pattern}*after_optimizations.txt"))
    if not files:
        return {"error": f"no dump matching {pattern}"}
    path = max(files, key=os.path.getsize)
    with open(path) as f:
        return {"file": os.path.basename(path), **census(f.read())}


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1000)


def device_kernels(trace_dir: str, top: int = 25) -> dict:
    """The device's kernels from a profiler trace: name -> (count, total ms), largest first."""
    import jax

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {"error": "no trace"}
    data = jax.profiler.ProfileData.from_file(max(files, key=os.path.getmtime))
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    span = [float("inf"), 0.0]
    for plane in data.planes:
        if "GPU" not in plane.name and "TPU" not in plane.name:
            continue
        for line in plane.lines:
            if "Stream" not in line.name and "XLA Ops" not in line.name:
                continue
            for ev in line.events:
                t = totals[ev.name[:90]]
                t[0] += 1
                t[1] += ev.duration_ns / 1e6
                span[0] = min(span[0], ev.start_ns)
                span[1] = max(span[1], ev.start_ns + ev.duration_ns)
    if not totals:
        return {"error": "no device events", "planes": [
            (pl.name, [ln.name for ln in pl.lines][:8]) for pl in data.planes][:12]}
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])
    return {"kernels": sum(c for c, _ in totals.values()),
            "busy_ms": sum(ms for _, ms in totals.values()),
            "span_ms": (span[1] - span[0]) / 1e6 if span[1] else 0.0,
            "top": [(n, c, round(ms, 3)) for n, (c, ms) in ranked[:top]]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:1b?vocab=262000")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--trace-steps", type=int, default=10)
    p.add_argument("--out")
    args = p.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="xla-dump-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} "
                               "--xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$").strip()
    import jax

    from eval.paged_decode import decode_batch
    from models.gemma3 import load_model
    from serving import PagedRunner

    t0 = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype, max_seq_len=args.max_seq_len)
    out: dict = {"model": args.model, "backend": jax.default_backend(),
                 "device": str(jax.devices()[0].device_kind), "rows": args.rows,
                 "context": args.context, "load_s": time.perf_counter() - t0}
    runner = PagedRunner(model, max_num_seqs=args.rows, max_seq_len=args.max_seq_len,
                         page_size=16, prefix_caching=False, model_name="bench")
    inputs = decode_batch(runner.info, args.rows, args.context + 1,
                          model.tokenizer.bos_id).inputs()
    t0 = time.perf_counter()
    runner.run_step(inputs)
    out["first_step_s"] = time.perf_counter() - t0
    runner.run_step(inputs)
    out["step_ms"] = _median_ms(lambda: runner.run_step(inputs), args.repeats)
    out["dispatch_ms"] = _median_ms(lambda: runner.dispatch_step(inputs), args.repeats)
    jax.block_until_ready(runner.pages)

    # The parts alone: the batch's transfer, the model program with device inputs, the sampler.
    from models.gemma3.ragged import RaggedBatch

    put = lambda: {k: model._ids(v, v.ndim, k) for k, v in inputs.batch.items()}  # noqa: E731
    out["inputs_h2d_ms"] = _median_ms(lambda: jax.block_until_ready(put()), args.repeats)
    if hasattr(model, "_ids_many"):
        out["inputs_h2d_batched_ms"] = _median_ms(
            lambda: jax.block_until_ready(model._ids_many(dict(inputs.batch))), args.repeats)
    packed = np.concatenate([v.ravel() for v in inputs.batch.values()]).astype(np.int32)
    out["inputs_h2d_packed_ms"] = _median_ms(
        lambda: jax.block_until_ready(jax.device_put(packed, model.programs.replicated)),
        args.repeats)
    batch = RaggedBatch(**put())

    def model_only():
        logits, runner.pages = model.ragged_step(runner.pages, batch)
        return jax.block_until_ready(logits)

    logits = model_only()
    out["model_program_ms"] = _median_ms(model_only, args.repeats)

    def model_dispatch():
        out_, runner.pages = model.ragged_step(runner.pages, batch)
        return out_

    out["model_dispatch_ms"] = _median_ms(model_dispatch, args.repeats)
    jax.block_until_ready(runner.pages)
    params = inputs.sampling.resolve()
    pos = inputs.sample_positions
    sampled = lambda: jax.block_until_ready(runner._sample(logits, params, pos))  # noqa: E731
    sampled()
    out["sampler_ms"] = _median_ms(sampled, args.repeats)
    # The full sampler, as a step with a sampled row runs it.
    hot = params._replace(temperature=np.ones_like(params.temperature))
    jax.block_until_ready(runner._sample(logits, hot, pos))
    out["full_sampler_ms"] = _median_ms(
        lambda: jax.block_until_ready(runner._sample(logits, hot, pos)), args.repeats)
    greedy = jax.jit(lambda x: jax.numpy.argmax(x, axis=-1))
    jax.block_until_ready(greedy(logits))
    out["argmax_ms"] = _median_ms(lambda: jax.block_until_ready(greedy(logits)), args.repeats)
    top1 = jax.jit(lambda x: jax.lax.top_k(x, 1)[1][:, 0])
    jax.block_until_ready(top1(logits))
    out["top1_ms"] = _median_ms(lambda: jax.block_until_ready(top1(logits)), args.repeats)
    out["census_step"] = dumped_census(dump, "ragged")
    out["census_sampler"] = dumped_census(dump, "jit_sample")
    trace = tempfile.mkdtemp(prefix="trace-")
    try:
        with jax.profiler.trace(trace):
            for _ in range(args.trace_steps):
                runner.run_step(inputs)
        prof = device_kernels(trace)
        prof["per_step_kernels"] = prof.get("kernels", 0) / args.trace_steps
        prof["per_step_busy_ms"] = prof.get("busy_ms", 0) / args.trace_steps
        out["profile"] = prof
    except Exception as e:  # the profiler's read-back is optional
        out["profile"] = {"error": repr(e)[:300]}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
