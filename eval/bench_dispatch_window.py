"""What the engine's dispatch window costs (serving/dispatch_window.py): overlapped decode steps
of the paged engine (each dispatched before the previous one's tokens are read back, fed from
it on the device, as the engine core runs them) with the window on and with it off,
alternating, in one process.

    python -m eval.bench_dispatch_window --tp 2 --steps 48 --repeats 4

With the window off the loop itself keeps only about two steps in flight, so it cannot wedge; with
it on, the loop's read-backs retire its programs, so it should never wait (`drains` counts the
waits of the runs with the window on): the ratio shows what the window's bookkeeping costs there.
"""
from __future__ import annotations

import argparse
import json
import time


def run(model: str = "gemma3-270m", tp: int = 2, max_num_seqs: int = 8, steps: int = 48,
        repeats: int = 4, log=print) -> dict:
    import jax_platform

    jax_platform.ensure_cpu_devices(tp)
    import numpy as np

    from eval.paged_decode import decode_batch
    from models.gemma3 import load_model
    from serving import PagedRunner

    engine = PagedRunner(load_model(model, tp=tp, max_seq_len=1024), max_num_seqs=max_num_seqs,
                         max_seq_len=1024, long_prefill_token_threshold=16, prefix_caching=False,
                         model_name="bench")
    engine.warmup(lambda _: None)
    # The runner sets its window's limit from its devices (DEFAULT_LIMIT where XLA:CPU can
    # wedge, else 0); the runs below switch it by hand, the same window otherwise.
    on = engine.window.limit

    def steps_ms(limit: int, n: int) -> tuple[float, int, int]:
        """Milliseconds a step over n overlapped steps; the window's waits and the most
        programs it saw unfinished meanwhile."""
        window = engine.window
        window.limit = limit
        window.drain()
        drains, window.most_unfinished = window.drains, 0
        batch = decode_batch(engine.info, max_num_seqs, 10, engine.tokenizer.bos_id)
        prev = None
        t0 = time.perf_counter()
        for _ in range(n):
            pending = engine.dispatch_step(batch.inputs(fed=prev is not None), prev)
            if prev is not None:
                prev.result()
            prev = pending
        prev.result()
        return (time.perf_counter() - t0) / n * 1e3, window.drains - drains, window.most_unfinished

    for limit in (on, 0):  # warm both
        steps_ms(limit, 8)
    times = {"window": [], "none": []}
    drains = most = 0
    for _ in range(repeats):
        ms, waits, unfinished = steps_ms(on, steps)
        times["window"].append(ms)
        drains, most = drains + waits, max(most, unfinished)
        times["none"].append(steps_ms(0, steps)[0])
    med = {k: float(np.median(v)) for k, v in times.items()}
    report = {"model": model, "tp": tp, "max_num_seqs": max_num_seqs, "steps": steps,
              "window_limit": on,
              "ms_per_step": times, "median_ms": med, "ratio": med["window"] / med["none"],
              "drains": drains, "most_unfinished": most}
    log(f"tp={tp}, {max_num_seqs} rows, window of {on} programs: {med['window']:.1f} ms a step, without "
        f"{med['none']:.1f} ms: {report['ratio']:.3f}x; {drains} waits with the window on")
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--out", help="write the report as JSON here")
    args = p.parse_args(argv)
    report = run(args.model, args.tp, args.max_num_seqs, args.steps, args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
