"""What the int8 AllReduce costs on prompts with images, beside the same model's text prompts:
the tiny random multimodal model (`random:tiny?vision=tiny`, float32) at --tp devices, every
position's logits of one ragged step with the f32 AllReduce and with each --modes AllReduce.

    python -m eval.quality_images --tp 4 --modes int8

Prompts: --prompts text prompts of --tokens random tokens, and as many with one and with two
images (random pixels) between such text. Reported per kind: mean KL(p_f32 || p_mode) in nats
and top-1 agreement over every position that is not an image's soft token (a soft token's
logits predict nothing).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import jax_platform
from eval.reports import write_json


def prompt(model, kind: int, tokens: int, seed: int):
    """(ids, images) of `kind` images (0, 1, 2), each image followed by text."""
    from serving import SeqImage

    rng = np.random.default_rng(seed)
    t, c = model.vision.tokens, model.vision.config
    ids = [model.tokenizer.bos_id] + rng.integers(10, 400, tokens).tolist()
    images = []
    for j in range(kind):
        a = len(ids) + 1
        pixels = rng.uniform(-1, 1, (1, c.image_size, c.image_size, 3)).astype(np.float32)
        images.append(SeqImage(spans=((a, a + c.tokens_per_image),), pixels=pixels,
                               key=f"q{seed}-{j}"))
        ids += [t.start] + [t.soft] * c.tokens_per_image + [t.end]
        ids += rng.integers(10, 400, tokens).tolist()
    return ids, tuple(images)


def all_logits(model, ids, images) -> np.ndarray:
    """float32 [len(ids), V]: every position's logits from one ragged step over the prompt."""
    from models.gemma3.ragged import RaggedBatch
    from serving import PagedRunner, step_inputs
    from serving import PagedScheduler
    from serving import SamplingParams
    from serving import Sequence

    n = len(ids)
    size = 1 << (n - 1).bit_length()
    # One piece; S rows = T tokens (deterministic mode pads every step to all S rows), so
    # that each row's `last` can name a token: the spare rows read every position.
    engine = PagedRunner(model, max_num_seqs=size, max_seq_len=2 * size, page_size=4,
                         long_prefill_token_threshold=size, max_num_batched_tokens=size,
                         prefix_caching=False, deterministic=True)
    sched = PagedScheduler(engine.info)
    sched.add([Sequence(id=0, prompt=list(ids), params=SamplingParams(max_tokens=1), seed=0,
                        images=images)])
    inputs = step_inputs(sched.schedule(), sched.kv, engine.info)
    t = inputs.buckets.tokens
    batch = RaggedBatch(**{**inputs.batch, "last": np.arange(t, dtype=np.int32)})
    logits, _ = model.ragged_step(engine.pages, batch, images=engine._image_rows(inputs))
    return np.asarray(logits)[:n]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--modes", default="int8")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--out")
    args = p.parse_args(argv)
    jax_platform.request_cpu_devices(args.tp)
    from eval.quality import compare_logits, mode_config
    from equarx import AllReduceConfig
    from models.gemma3 import load_model

    source = "random:tiny?vision=tiny"
    ref = load_model(source, tp=args.tp, dtype="float32", allreduce=AllReduceConfig(method="f32"))
    prompts = {kind: [prompt(ref, kind, args.tokens, 100 * kind + i) for i in range(args.prompts)]
               for kind in (0, 1, 2)}
    want = {kind: [all_logits(ref, ids, ims) for ids, ims in ps] for kind, ps in prompts.items()}
    rows = []
    for mode in args.modes.split(","):
        m = load_model(source, tp=args.tp, dtype="float32", allreduce=mode_config(mode))
        for kind, ps in prompts.items():
            sums = {"kl": 0.0, "agree": 0, "count": 0}
            for (ids, ims), ref_logits in zip(ps, want[kind]):
                keep = np.asarray(ids) != ref.vision.tokens.soft
                got = all_logits(m, ids, ims)
                # compare_logits needs targets only for its NLL: any non-negative id will do
                s = compare_logits(ref_logits[keep], got[keep], np.zeros(int(keep.sum()), int))
                for k in sums:
                    sums[k] += s[k]
            rows.append({"mode": mode, "images": kind, "positions": sums["count"],
                         "kl_to_f32": sums["kl"] / sums["count"],
                         "top1_agree_f32": sums["agree"] / sums["count"]})
            r = rows[-1]
            print(f"  tp={args.tp} {mode:8s} {kind} image(s): KL {r['kl_to_f32']:.2e}, top-1 "
                  f"{100 * r['top1_agree_f32']:.2f}% over {r['positions']} positions", file=sys.stderr)
    report = {"model": source, "tp": args.tp, "dtype": "float32", "rows": rows}
    write_json(args.out, report)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
