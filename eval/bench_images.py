"""Images in the paged engine, in-process (the engine core, no HTTP): how long another request's
image holds up a running stream, and the time to first token of an image request.

  stall   a greedy text stream runs; after a few tokens another request arrives. Its largest
          inter-token gap from then until the other request's first token, for the other
          request being
            text    a text prompt as long as the image prompt (the stall of prompt pieces),
            whole   an image prompt, the encoder run whole inside one step (as before the
                    staged encoder: the scheduler is told every image is ready),
            staged  an image prompt, the encoder run in bounded stages between steps
                    (serving/image_encoder.py), the image's soft tokens then computed in
                    one step (as before serving/image_spans.py),
            spans   the same, the soft tokens written a layer at a time between steps
                    (serving/image_spans.py; the default).
  ttft    a lone one-image request (a new image: the encoder runs), then the same request
          again (features and prefix pages cached): both times to first token and their ratio.
  encoder (--encoder N) images/s of the one-shot encoder (`image_features`, tower and
          projector), N images one at a time, with the tower on one device of the mesh (the
          served placement) and replicated on every device (as before).

    python -m eval.bench_images --model "random:tiny?vision=tiny"
    python -m eval.bench_images --model "random:4b?layers=4&vocab=4096&vision=so400m" --tp 2

Every kind of request runs once before it is measured (with a different image), and a gap in
which a program still compiled (a step shape the warm-up did not run) is
left out of the maxima and counted.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import jax_platform
from eval.reports import write_json

from eval.bench_engine import Stream


COMPILES: list[float] = []  # when each compilation ended (perf_counter), from jax.monitoring


def _on_event(name: str, seconds: float, **_) -> None:
    if name.startswith("/jax/core/compile/"):
        COMPILES.append(time.perf_counter())


def image_request(model, text_ids: list[int], seed: int):
    """A prompt with one image after `text_ids` (the Gemma 3 layout: start, soft tokens, end)
    and its SeqImage (random pixels: a new content hash for each seed)."""
    from serving import SeqImage

    t = model.vision.tokens
    n = model.vision.config.tokens_per_image
    size = model.vision.config.image_size
    a = len(text_ids) + 1
    ids = list(text_ids) + [t.start] + [t.soft] * n + [t.end] + text_ids[1:9]
    pixels = np.random.default_rng(seed).uniform(-1, 1, (1, size, size, 3)).astype(np.float32)
    return ids, (SeqImage(spans=((a, a + n),), pixels=pixels, key=f"bench-{seed}"),)


def _params(n: int):
    from serving import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def submit(core, ids, images, n: int) -> Stream:
    s = Stream()
    core.submit([(ids, _params(n), s, images)])
    return s


def stall(core, model, args, kind: str, seed: int) -> dict:
    """The running stream's largest gap while the other request (`kind`) is admitted."""
    text = prompt_ids(model, 12, seed)
    ids, images = image_request(model, text, seed)
    if kind == "text":
        ids, images = prompt_ids(model, len(ids), seed + 1), ()
    elif args.features_cached:  # the encoder's share left out: only the soft tokens' steps
        import jax
        jax.block_until_ready(core.runner.image_features(images[0]))  # (dispatch is async)
    stream = Stream()
    engine = core.runner
    encoded = []  # images encoded so far, at each of the stream's tokens (the engine thread's view)

    def counted(event, sink=stream):
        encoded.extend([engine.images_encoded] * len(event.tokens))
        sink(event)

    [sid] = core.submit([(prompt_ids(model, 8, seed + 2), _params(args.stream_tokens), counted)])
    while len(stream.times) < 4:
        time.sleep(0.001)
    t0 = time.perf_counter()
    other = submit(core, ids, images, 1).wait()
    first = other.times[0]
    while len(stream.times) < 2 or stream.times[-1] <= first:
        if stream.done.is_set():
            break
        time.sleep(0.001)
    core.cancel([sid])
    stream.done.wait(60)
    times = np.array(stream.times)
    before = np.diff(times[times < t0])
    # from the stream's last token before the other request to its first after the other's
    # first token
    lo = int(np.searchsorted(times, t0)) - 1
    hi = min(int(np.searchsorted(times, first, side="right")), len(times) - 1)
    gaps = np.diff(times[lo:hi + 1])
    # The gaps before the other request's features were ready: the encoder's share (the step
    # that then runs the image's soft tokens, all in one piece, comes after).
    enc = np.array(encoded[lo:hi + 1])
    # A gap in which a program compiled (a step shape the warm-up did not run, say) is
    # left out of the maxima and counted: compilation is not what this measures.
    ends = times[lo + 1:hi + 1]
    compiled = np.array([any(a < c <= b for c in COMPILES) for a, b in zip(ends - gaps, ends)],
                        bool)
    encoding = gaps[(enc[1:] == enc[0]) & ~compiled] if len(enc) > 1 else gaps
    # ... and the gaps after them: the image's soft tokens (one step, or the span's stages).
    after = gaps[(enc[1:] > enc[0]) & ~compiled] if len(enc) > 1 else gaps[:0]
    n_compiled = int(compiled.sum())
    gaps = gaps[~compiled]
    return {"max_itl_s": float(gaps.max()),
            "max_itl_while_encoding_s": float(encoding.max()) if len(encoding) else None,
            "max_itl_after_features_s": float(after.max()) if len(after) else None,
            "median_itl_before_s": float(np.median(before)), "gaps_with_a_compile": n_compiled,
            "other_ttft_s": float(first - t0), "stream_tokens_meanwhile": int(len(gaps))}


def stalls(core, model, args) -> dict:
    """Every kind's stall runs, the kinds in turn (a load that drifts meets them alike), the
    first round only compiling."""
    engine = core.runner
    kinds = [k for k in args.kinds.split(",") if k]
    runs: dict[str, list] = {k: [] for k in kinds}
    seed = 100
    for r in range(args.repeats + 1):
        for kind in kinds:
            core.scheduler.image_ready = (lambda key: True) if kind == "whole" else engine.image_ready
            core.scheduler.stage_spans = kind == "spans"
            seed += 10
            out = stall(core, model, args, kind, seed)
            if r:
                runs[kind].append(out)
    for kind, done in runs.items():
        worst = max(x["max_itl_s"] for x in done)
        enc = max(x["max_itl_while_encoding_s"] or 0 for x in done)
        after = max(x["max_itl_after_features_s"] or 0 for x in done)
        skipped = sum(x["gaps_with_a_compile"] for x in done)
        print(f"  {kind:6s}: max ITL {worst * 1000:8.1f} ms, while encoding {enc * 1000:8.1f} "
              f"ms, after {after * 1000:8.1f} ms ({skipped} gap(s) with a compile left out; "
              f"median before {done[-1]['median_itl_before_s'] * 1000:.1f} ms), other TTFT "
              f"{done[-1]['other_ttft_s']:.2f} s", file=sys.stderr)
    return runs


def encoder_rates(model, n: int) -> dict:
    """Images/s of `model.image_features` with the tower on one device and replicated (n
    images after a compiling call); the served placement is restored."""
    import jax

    host = model.host_vision()
    size = model.vision.config.image_size
    pixels = np.random.default_rng(0).uniform(-1, 1, (1, size, size, 3)).astype(np.float32)
    out = {}
    try:
        for name, replicated in (("one_device", False), ("replicated", True)):
            model.attach_vision(host, replicated=replicated)
            jax.block_until_ready(model.image_features(pixels))
            t0 = time.perf_counter()
            for _ in range(n):
                jax.block_until_ready(model.image_features(pixels))
            best = time.perf_counter() - t0
            out[name] = {"images_per_s": n / best, "s_per_image": best / n}
            print(f"  encoder, tower {name:10s}: {n / best:.4f} images/s ({best / n:.2f} s an "
                  f"image)", file=sys.stderr)
    finally:
        model.attach_vision(host)
    return out


def prompt_ids(model, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    tok = model.tokenizer
    return [tok.bos_id] + rng.integers(10, 200, n - 1).tolist()


def ttft(core, model, seed: int) -> dict:
    ids, images = image_request(model, prompt_ids(model, 12, seed), seed)
    t0 = time.perf_counter()
    first = submit(core, ids, images, 1).wait().times[0] - t0
    t0 = time.perf_counter()
    again = submit(core, ids, images, 1).wait().times[0] - t0
    return {"first_s": first, "again_s": again, "ratio": again / first}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:tiny?vision=tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--long-prefill-token-threshold", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kinds", default="text,whole,staged,spans",
                   help="'' to measure only the TTFT")
    p.add_argument("--ttft", type=int, default=1, help="0: skip the TTFT measurement")
    p.add_argument("--features-cached", action="store_true",
                   help="encode each image before its request (not timed), so that the stall "
                        "is the soft tokens' alone; the kinds then run in turn, --repeats times")
    p.add_argument("--encoder", type=int, default=0,
                   help="N > 0: also time N images through the one-shot encoder, on one "
                        "device and replicated")
    p.add_argument("--deterministic", action="store_true",
                   help="the engine in deterministic mode (one step shape; spans staged alone "
                        "too): kind 'staged' is then its soft tokens in one step as before")
    p.add_argument("--out")
    args = p.parse_args(argv)
    jax_platform.request_cpu_devices(args.tp)
    jax_platform.keep_freed_memory()
    import jax
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    from equarx import AllReduceConfig
    from models.gemma3 import load_model
    from serving import EngineCore
    from serving import PagedRunner

    model = load_model(args.model, tp=args.tp, dtype=args.dtype, max_seq_len=4096 + 512,
                       allreduce=AllReduceConfig(method="f32"))
    engine = PagedRunner(model, max_num_seqs=4, max_seq_len=4096 + 512, page_size=16,
                         long_prefill_token_threshold=args.long_prefill_token_threshold,
                         deterministic=args.deterministic, model_name="bench")
    core = EngineCore(engine).start()
    results = {"model": args.model, "tp": args.tp,
               "long_prefill_token_threshold": args.long_prefill_token_threshold,
               "deterministic": args.deterministic,
               "encoder_budget_flops": engine.encoder.budget_flops,
               "encoder_stages": len(engine.encoder.stages), "stall": {}}
    try:
        if args.encoder:
            results["encoder"] = encoder_rates(model, args.encoder)
        results["stall"] = stalls(core, model, args)
        core.scheduler.image_ready = engine.image_ready
        core.scheduler.stage_spans = True
        if args.ttft:
            ttft(core, model, 1)  # compiles the lone request's programs
        results["ttft"] = [ttft(core, model, 2 + r) for r in range(args.repeats if args.ttft else 0)]
        for t in results["ttft"]:
            print(f"  one-image request: TTFT {t['first_s']:.3f} s, the same again "
                  f"{t['again_s']:.3f} s ({t['ratio']:.3f}x)", file=sys.stderr)
    finally:
        core.shutdown()
    write_json(args.out, results)
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
