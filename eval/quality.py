"""What an AllReduce costs in quality: the model with it against the same model with an exact
float32 AllReduce (the reference), on real English text (eval.corpus). The modes (--only) are
listed below; what each measures, and example commands: docs/benchmarks.md."""
from __future__ import annotations

import math
import os
import re
import sys
import threading
import time

import numpy as np

from equarx import AllReduceConfig
from eval import common, corpus
from eval.reports import format_columns, write_json

NAIVE, REFERENCE, UNFOLDED, NOISE = "naive", "f32", ":unfolded", "noise:"
MODES = ("f32", "bf16", "bf16_ring", "bf16_ring-full", "int8", "int8-full", "int8-full+tile",
         "int4", "fp8", NAIVE)
MODE_HELP = {
    "quality": "every --modes label at every --tp: perplexity, KL, top-1, greedy continuations",
    "images": "the tiny multimodal model: KL and top-1 of prompts with 0, 1 and 2 images",
    "scaling": "real tp=4 partials split over N emulated devices: the error's growth with N",
    "sensitivity": "beside the modes, the exact sum plus --noise: rms error and KL"}
DEFAULTS = {  # per mode: --tokens, --tp, --dtype, --modes
    "quality": (4096, "2,4", "bfloat16", ",".join(MODES)),
    "images": (24, "4", "float32", "int8"),
    "scaling": (1024, "4", "float32", "int8,int8-full,int8-semi,bf16_ring"),
    "sensitivity": (1024, "4", "bfloat16", "bf16_ring-full,int8")}
NOISE_SIZES = "0,1e-4,3e-4,1e-3,2e-3,4e-3,8e-3,1.6e-2"


# A mode's suffixes beside its AllReduce label: int8 / fp8 weights (`--quantization`, "-gG" a
# scale per G values: `--quantization-group-size`) and KV cache (`--kv-cache-dtype`), e.g.
# "bf16:w-int8", "bf16:w-int8-g32", "int8:w-int8:kv-int8".
STORAGE = re.compile(r"(?:w-(int8|fp8)(?:-g(\d+))?|kv-(int8|fp8))")


def mode_parts(name: str) -> tuple[str, bool, dict]:
    """A mode -> (its AllReduce label, whether the rotation is folded into the weights, the
    storage settings its suffixes name); ValueError on an unknown suffix."""
    label, *suffixes = name.split(":")
    if bad := [s for s in suffixes if s != UNFOLDED[1:] and not STORAGE.fullmatch(s)]:
        raise ValueError(f"unknown mode suffix {bad[0]!r} in {name!r}: 'unfolded', w-int8, "
                         "w-fp8 (either with -g<group size>), kv-int8 or kv-fp8")
    found = [STORAGE.fullmatch(s).groups() for s in suffixes if s != UNFOLDED[1:]]
    return label, UNFOLDED[1:] not in suffixes, {k: v for w, g, kv in found for k, v in (
        ("quantization", w), ("quantization_group_size", int(g or 0)), ("kv_cache_dtype", kv)) if v}


def mode_config(name: str) -> AllReduceConfig | None:
    """A mode's AllReduceConfig (None for the naive strawman); ValueError on an unknown label.
    "<label>:unfolded" runs the codec's rotation at run time instead of in the weights."""
    label = mode_parts(name)[0]
    return None if label == NAIVE else AllReduceConfig.from_label(label)


def naive_all_reduce(x, axis_name: str):
    """The strawman, a model reduction hook: each device quantizes its whole partial with ONE
    absmax scale, the int8 values and scales are all-gathered, and every device sums the
    dequantized partials in float32 (one outlier sets every element's step)."""
    import jax.numpy as jnp
    from jax import lax

    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf))
    q = jnp.round(xf * jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0))
    qs = lax.all_gather(jnp.clip(q, -127, 127).astype(jnp.int8), axis_name)
    scales = lax.all_gather(amax / 127.0, axis_name).reshape((-1,) + (1,) * x.ndim)
    return jnp.sum(qs.astype(jnp.float32) * scales, axis=0).astype(x.dtype)


def compare_logits(ref: np.ndarray, out: np.ndarray, targets: np.ndarray) -> dict:
    """Sums over positions (targets -1: none): nll of `out`, KL(ref || out), argmax agreement."""
    if ref.shape != out.shape or ref.shape[0] != targets.shape[0]:
        raise ValueError(f"shape mismatch: {ref.shape}, {out.shape}, targets {targets.shape}")
    sums = {"nll": 0.0, "kl": 0.0, "agree": 0, "count": 0}
    for start in range(0, ref.shape[0], 64):  # 64 x 262k float32 a temporary
        keep = targets[start:start + 64] >= 0
        if not keep.any():
            continue
        lr, lo = (a - np.log(np.exp(a).sum(-1, keepdims=True)) for a in (
            x[start:start + 64][keep] - x[start:start + 64][keep].max(-1, keepdims=True)
            for x in (ref, out)))
        t = targets[start:start + 64][keep]
        sums["nll"] -= float(lo[np.arange(len(t)), t].sum(dtype=np.float64))
        sums["kl"] += float((np.exp(lr) * (lr - lo)).sum(dtype=np.float64))
        sums["agree"] += int((lr.argmax(-1) == lo.argmax(-1)).sum())
        sums["count"] += int(keep.sum())
    return sums


def score_windows(reference, variants: dict, windows: list[list[int]]) -> dict:
    """Per variant (name -> model): `compare_logits` against `reference` summed over windows."""
    sums = {m: {"nll": 0.0, "kl": 0.0, "agree": 0, "count": 0} for m in variants}
    for i, window in enumerate(windows):
        targets, ref = np.array(window[1:] + [-1]), reference.score([window])[0]
        for m, model in variants.items():
            for k, v in compare_logits(ref, model.score([window])[0], targets).items():
                sums[m][k] += v
        print(f"  window {i + 1}/{len(windows)}", file=sys.stderr, flush=True)
    return sums


def metrics(s: dict) -> dict:
    return {"kl_to_f32": s["kl"] / s["count"], "top1_agree_f32": s["agree"] / s["count"],
            "perplexity": math.exp(s["nll"] / s["count"]), "tokens": s["count"]}


def load_reference(model: str, tp: int, dtype: str, n_tokens: int, window: int):
    from models.gemma3 import load_model

    base = load_model(model, tp=tp, allreduce=AllReduceConfig(REFERENCE), dtype=dtype,
                      max_seq_len=window)
    return base, corpus.token_windows(base.tokenizer.encode, n_tokens, window, base.tokenizer.bos_id)


def quality(args) -> list[dict]:
    """Every --modes label (or the naive strawman) at every --tp against the f32 reference:
    perplexity, KL, top-1 agreement and greedy continuations (f32 against itself: a check)."""
    from serving import LLM, SamplingParams

    modes = [REFERENCE] + [m for m in common.names(args.modes) if m != REFERENCE]
    rows = []
    for tp in common.ints(args.tp):
        base, windows = load_reference(args.model, tp, args.dtype, args.tokens,
                                       max(args.window, args.prompt_tokens + args.new_tokens + 1))
        models = {m: base.with_allreduce(  # the naive strawman as the model's reduction
            mode_config(m) or AllReduceConfig("bf16"), reduction=naive_all_reduce
            if mode_parts(m)[0] == NAIVE else None, fold_rotation=mode_parts(m)[1],
            **mode_parts(m)[2]) for m in modes}
        sums = score_windows(models[REFERENCE], models, windows)
        prompts = [[base.tokenizer.bos_id] + p for p in corpus.prompt_set(
            base.tokenizer.encode, args.prompts, args.prompt_tokens)]
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        greedy = {}
        for m in modes:
            with LLM(models[m], max_num_seqs=len(prompts),
                     max_seq_len=args.prompt_tokens + 1 + args.new_tokens) as llm:
                greedy[m] = llm.generate(prompts, params)
        for m in modes:
            pairs = list(zip(greedy[m], greedy[REFERENCE]))
            rows.append({"tp": tp, "mode": m, **metrics(sums[m]),
                         "allreduce": mode_config(m).to_dict() if mode_config(m)
                         else {"method": NAIVE}, **mode_parts(m)[2],
                         "greedy_exact_match": sum(g == r for g, r in pairs) / len(pairs),
                         "greedy_prefix": sum(len(os.path.commonprefix([g, r])) for g, r in pairs)
                         / len(pairs)})
        bf16 = next((r["perplexity"] for r in rows if r["mode"] == "bf16" and r["tp"] == tp), None)
        for r in rows[-len(modes):]:
            r["perplexity_vs_bf16"] = r["perplexity"] / bf16 - 1 if bf16 else None
        if args.out:  # long runs keep what they have
            write_json(args.out, {"quality": rows})
    return rows


def image_logits(model, ids, images) -> np.ndarray:
    """float32 [len(ids), V]: every position's logits of a prompt with images, from one ragged
    step as the engine plans it (the features from the runner's encoder). Deterministic mode
    pads the step to all S = T rows, so that each row's `last` can name a token."""
    import jax.numpy as jnp

    from models.gemma3.ragged import ImageRows, RaggedBatch
    from serving import PagedRunner, PagedScheduler, SamplingParams, Sequence, step_inputs

    n = 1 << (len(ids) - 1).bit_length()
    runner = PagedRunner(model, max_num_seqs=n, max_seq_len=2 * n, page_size=4,
                         long_prefill_token_threshold=n, max_num_batched_tokens=n,
                         prefix_caching=False, deterministic=True)
    sched = PagedScheduler(runner.info)
    sched.add([Sequence(id=0, prompt=list(ids), params=SamplingParams(max_tokens=1), seed=0,
                        images=images)])
    inputs, rows = step_inputs(sched.schedule(), sched.kv, runner.info), None
    if inputs.images:
        feats = [runner.image_features(im) for im in inputs.images]
        pad = inputs.buckets.features - sum(f.shape[0] for f in feats)
        feats += [jnp.zeros((pad, feats[0].shape[1]), feats[0].dtype)] * (pad > 0)
        rows = ImageRows(features=jnp.concatenate(feats), index=inputs.image_index)
    batch = RaggedBatch(**{**inputs.batch, "last": np.arange(inputs.buckets.tokens, dtype=np.int32)})
    return np.asarray(model.ragged_step(runner.pages, batch, images=rows)[0])[:len(ids)]


def images(args) -> list[dict]:
    """KL and top-1 of the tiny multimodal model (float32) over every position of prompts with
    0, 1 and 2 images (soft tokens left out)."""
    from models.gemma3 import load_model
    from serving import SeqImage

    def load(allreduce):
        return load_model("random:tiny?vision=tiny", tp=common.ints(args.tp)[0], dtype="float32",
                          allreduce=allreduce, max_seq_len=4096)

    ref = load(AllReduceConfig(REFERENCE))
    t, c = ref.vision.tokens, ref.vision.config

    def prompt(kind: int, seed: int):  # `kind` images, each followed by text
        rng = np.random.default_rng(seed)
        ids, ims = [ref.tokenizer.bos_id] + rng.integers(10, 400, args.tokens).tolist(), []
        for j in range(kind):
            a, size = len(ids) + 1, (1, c.image_size, c.image_size, 3)
            ims.append(SeqImage(spans=((a, a + c.tokens_per_image),), key=f"q{seed}-{j}",
                                pixels=rng.uniform(-1, 1, size).astype(np.float32)))
            ids += [t.start] + [t.soft] * c.tokens_per_image + [t.end]
            ids += rng.integers(10, 400, args.tokens).tolist()
        return ids, tuple(ims)

    prompts = {k: [prompt(k, 100 * k + i) for i in range(args.prompts)] for k in (0, 1, 2)}
    want = {k: [image_logits(ref, *p) for p in ps] for k, ps in prompts.items()}
    rows = []
    for mode in common.names(args.modes):
        m = load(mode_config(mode))
        for kind, ps in prompts.items():
            sums = {"kl": 0.0, "agree": 0, "count": 0, "nll": 0.0}
            for (ids, ims), ref_logits in zip(ps, want[kind]):
                keep = np.asarray(ids) != t.soft  # a soft token's logits predict nothing
                s = compare_logits(ref_logits[keep], image_logits(m, ids, ims)[keep],
                                   np.zeros(int(keep.sum()), int))
                sums = {k: sums[k] + s[k] for k in sums}
            r = metrics(sums)
            rows.append({"mode": mode, "images": kind, "positions": sums["count"],
                         "kl_to_f32": r["kl_to_f32"], "top1_agree_f32": r["top1_agree_f32"]})
    return rows


def split_parts(partials, k: int, key):
    """f32[4, ...] -> f32[4k, ...]: each partial as k parts summing to it, a part's rms per row
    the partial's / sqrt(k) (as independent contributions of 1/N of the heads or FFN would
    be); k = 1 returns the partials."""
    import jax
    import jax.numpy as jnp

    if k == 1:
        return partials
    noise = jax.random.normal(key, (partials.shape[0], k) + partials.shape[1:], jnp.float32)
    noise = noise - noise.mean(axis=1, keepdims=True)
    rms = jnp.sqrt(jnp.mean(partials**2, axis=-1, keepdims=True))[:, None]
    parts = partials[:, None] / k + noise * rms * math.sqrt(1 / k - 1 / k**2)
    return parts.reshape((-1,) + partials.shape[1:])


def emulated_reduction(config: AllReduceConfig, n_devices: int, tp: int = 4):
    """A reduction hook: `config`'s all_reduce over n_devices emulated from the real partials
    (the same fixed key on every device, so every device builds the same parts)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from equarx import all_reduce

    if n_devices % tp:
        raise ValueError(f"emulated devices must be a multiple of {tp}, got {n_devices}")

    def reduce(x, axis):
        partials = lax.all_gather(x.astype(jnp.float32), axis)
        parts = split_parts(partials, n_devices // tp, jax.random.PRNGKey(20250617)).astype(x.dtype)
        return jax.vmap(lambda p: all_reduce(p, "emulated", config), axis_name="emulated")(parts)[0]

    return reduce


def scaling(args) -> list[dict]:
    from equarx import resolved_variant

    base, windows = load_reference(args.model, 4, args.dtype, args.tokens, args.window)
    variants = {(m, n): base.with_allreduce(AllReduceConfig(REFERENCE), reduction=emulated_reduction(
        mode_config(m), n)) for m in common.names(args.modes) for n in common.ints(args.devices)}
    rows = [{"mode": m, "devices": n, "emulated": n != 4, **metrics(s), "variant": resolved_variant(
        mode_config(m), n, args.window * base.config.d_model * 4)}
        for (m, n), s in score_windows(base, variants, windows).items()]
    for r in rows:
        at4 = next((x["kl_to_f32"] for x in rows if x["mode"] == r["mode"] and x["devices"] == 4), 0)
        r["kl_vs_4"] = r["kl_to_f32"] / at4 if at4 else None
    return rows


class ErrorMeter:
    """Sums of squared errors and of squared exact sums, fed from inside the compiled programs
    (`jax.debug.callback`, from several threads at once: hence the lock)."""

    def __init__(self):
        self.err2 = self.ref2 = 0.0
        self._lock = threading.Lock()

    def add(self, err2, ref2) -> None:
        with self._lock:
            self.err2, self.ref2 = self.err2 + float(err2), self.ref2 + float(ref2)

    @property
    def relative(self) -> float | None:
        return math.sqrt(self.err2 / self.ref2) if self.ref2 > 0 else None


def _as_delivered(exact, dtype):
    """Float32 values rounded to `dtype` as the reference hands its sum on (reduce_precision:
    XLA may drop an f32 -> bf16 -> f32 pair of converts)."""
    import jax.numpy as jnp
    from jax import lax

    if jnp.dtype(dtype) == jnp.float32:
        return exact
    info = jnp.finfo(dtype)
    return lax.reduce_precision(exact, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def row_noise(exact, eps: float):
    """Standard normal values drawn from each value's bits (a hash, then Box-Muller), times
    eps x the rms of its row."""
    import jax.numpy as jnp
    from jax import lax

    bits = lax.bitcast_convert_type(exact, jnp.uint32)
    h = (bits * jnp.uint32(2654435761)) ^ (bits >> 13)
    h = (h * jnp.uint32(2246822519)) ^ (h >> 16)
    u1 = ((h & 0xFFFF).astype(jnp.float32) + 0.5) / 65536.0
    u2 = (h >> 16).astype(jnp.float32) / 65536.0
    z = jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(2.0 * math.pi * u2)
    return eps * jnp.sqrt(jnp.mean(exact * exact, axis=-1, keepdims=True)) * z


def measured_reduction(meter: ErrorMeter, config: AllReduceConfig | None = None,
                       eps: float | None = None):
    """A reduction hook: `config`'s all_reduce, or (eps) the exact sum plus `row_noise`; its
    error against the delivered exact sum goes to `meter`."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from equarx import all_reduce

    if (config is None) == (eps is None):
        raise ValueError("give exactly one of a config and a noise size, not both or neither")

    def reduce(x, axis):
        exact = lax.psum(x.astype(jnp.float32), axis)
        out = (all_reduce(x, axis, config) if config is not None
               else _as_delivered(exact + row_noise(exact, eps), x.dtype).astype(x.dtype))
        err = out.astype(jnp.float32) - _as_delivered(exact, x.dtype)
        jax.debug.callback(meter.add, jnp.sum(err * err), jnp.sum(exact * exact))
        return out

    return reduce


def parse_noise(text: str) -> list[float]:
    values = [float(v) for v in common.names(text)]
    if any(not (v >= 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"noise sizes must be finite numbers >= 0, got {text!r}")
    return values


def sensitivity(args) -> list[dict]:
    import jax

    base, windows = load_reference(args.model, common.ints(args.tp)[0], args.dtype, args.tokens,
                                   args.window)
    meters, variants = {}, {}
    for name, cfg, eps in ([(m, mode_config(m), None) for m in common.names(args.modes)]
                           + [(f"{NOISE}{e:g}", None, e) for e in parse_noise(args.noise)]):
        meters[name] = ErrorMeter()
        variants[name] = base.with_allreduce(AllReduceConfig(REFERENCE),
                                             reduction=measured_reduction(meters[name], cfg, eps))
    sums = score_windows(base, variants, windows)
    jax.effects_barrier()
    return [{"variant": name, "noise": name.startswith(NOISE),
             "allreduce_rel_error": meters[name].relative, **metrics(s)} for name, s in sums.items()]


COLUMNS = {
    "quality": [("tp", ">3", "tp"), ("mode", "<24", "mode"), ("perplexity", ">10", "perplexity"),
                ("vs bf16", ">8", "perplexity_vs_bf16"), ("KL to f32", ">10", "kl_to_f32"),
                ("top-1 = f32", ">11", "top1_agree_f32"), ("greedy =", ">9", "greedy_exact_match"),
                ("prefix", ">7", "greedy_prefix")],
    "images": [("mode", "<12", "mode"), ("images", ">6", "images"), ("positions", ">9", "positions"),
               ("KL to f32", ">10", "kl_to_f32"), ("top-1 = f32", ">11", "top1_agree_f32")],
    "scaling": [("mode", "<16", "mode"), ("N", ">3", "devices"), ("schedule", "<8", "variant"),
                ("KL to f32", ">10", "kl_to_f32"), ("x N=4", ">6", "kl_vs_4"),
                ("top-1 = f32", ">11", "top1_agree_f32")],
    "sensitivity": [("variant", "<16", "variant"), ("AllReduce error", ">15", "allreduce_rel_error"),
                    ("KL to f32", ">10", "kl_to_f32"), ("top-1 = f32", ">11", "top1_agree_f32")]}


def cell(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, MODE_HELP, only="quality", engine=False)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--dtype", choices=("bfloat16", "float32"))
    p.add_argument("--tp", help="comma list (quality); one degree (images, sensitivity)")
    p.add_argument("--modes", help="comma list of AllReduce labels (quality: or naive; "
                   "'int8:unfolded' rotates at run time instead of in the weights; ':w-int8', "
                   "':w-fp8', ':kv-int8', ':kv-fp8' add int8 / fp8 weights or KV cache, "
                   "':w-int8-g32' weights with a scale per 32 values)")
    p.add_argument("--tokens", type=int, help="next-token predictions scored (images: text "
                   "tokens around each image)")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window (with BOS)")
    p.add_argument("--prompts", type=int, help="greedy prompts (quality: 16; images: 4)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16, help="greedy continuation length")
    p.add_argument("--devices", default="4,8,16", help="scaling: emulated axis sizes (multiples of 4)")
    p.add_argument("--noise", default=NOISE_SIZES, help="sensitivity: noise sizes (x a row's rms)")
    args = p.parse_args(argv)
    report = {"model": args.model, "corpus": corpus.SOURCE, "reference": REFERENCE,
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    given = {k: getattr(args, k) for k in ("tokens", "tp", "dtype", "modes", "prompts")}
    settings = {mode: {k: given[k] if given[k] is not None else v for k, v in zip(
        given, DEFAULTS[mode] + (4 if mode == "images" else 16,))} for mode in common.names(args.only)}
    from jax_platform import ensure_cpu_devices
    if "scaling" in settings:  # always the real tp=4
        settings["scaling"]["tp"] = "4"
    ensure_cpu_devices(max(max(common.ints(s["tp"])) for s in settings.values()))
    for mode, values in settings.items():
        vars(args).update(values)
        rows = {"quality": quality, "images": images, "scaling": scaling,
                "sensitivity": sensitivity}[mode](args)
        report[mode] = {**values, "rows": rows}
        print(f"# {mode}: {args.model} ({args.dtype}), tp {args.tp}, {args.tokens} tokens; "
              f"reference: the f32 AllReduce")
        print(format_columns(rows, [(t, spec, lambda r, k=k: cell(r.get(k)))
                                    for t, spec, k in COLUMNS[mode]]))
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
