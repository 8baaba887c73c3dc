"""What the int8 AllReduce costs in quality: Gemma 3 scored on real English text.

For every AllReduce mode at every tensor-parallel degree, against the same model with an exact
float32 AllReduce (the reference):
  perplexity         of the corpus (next-token NLL over every scored position),
  kl_to_f32          mean KL(p_f32 || p_mode) per position, in nats,
  top1_agree_f32     fraction of positions whose argmax equals the reference's,
  greedy_exact_match fraction of prompts whose greedy continuation equals the reference's,
  greedy_prefix      mean number of leading continuation tokens equal to the reference's.

Corpus: prose of the Python Language Reference shipped with Python (see eval.corpus).
Modes (by default): f32 (exact), bf16 (XLA psum), the bf16 schedules unquantized (bf16_ring,
bf16_ring-full), the default int8 and its full-loop ring, the paper's tile codec
(int8-full+tile), int4, fp8, and a naive per-tensor int8 AllReduce (eval.naive_allreduce); any
AllReduce label may be asked for. All modes share one copy of the weights per tp.

  python -m eval.quality --out quality.json          # real Gemma 3 270M, tp 2 and 4
  python -m eval.quality --model random:tiny --tokens 256 --window 64   # quick run
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import time

import numpy as np

from equarx import AllReduceConfig
from eval import corpus
from eval.reports import write_json

NAIVE = "naive"
# The modes a default run evaluates: any `AllReduceConfig.label` (e.g. "int8-semi-ag+hadamard")
# or NAIVE, the per-tensor int8 strawman, may be asked for.
MODES = ("f32", "bf16", "bf16_ring", "bf16_ring-full", "int8", "int8-full", "int8-full+tile",
         "int4", "fp8", NAIVE)
REFERENCE = "f32"


# A mode spelled "<label>:unfolded" runs that AllReduce with its codec's rotation at run time,
# not folded into the o / linear weights as load_model serves it (see Gemma3Model.with_allreduce).
UNFOLDED = ":unfolded"


def mode_config(name: str) -> AllReduceConfig | None:
    """A mode's AllReduceConfig (None for the naive strawman); ValueError on an unknown name."""
    return None if name == NAIVE else AllReduceConfig.from_label(name.removesuffix(UNFOLDED))


def collective_configs(modes: list[str]) -> dict[str, AllReduceConfig]:
    """Each mode's AllReduceConfig, for evaluations that run `equarx.all_reduce` themselves
    (the naive strawman is a reduction of its own, not a config: refused)."""
    configs = {m: mode_config(m) for m in modes}
    if any(c is None for c in configs.values()):
        raise ValueError(f"'{NAIVE}' runs only in eval.quality; leave it out")
    return configs


def load_reference(model: str, tp: int, dtype: str, n_tokens: int, window: int):
    """The model with the reference AllReduce, and the corpus windows to score with it."""
    from models.gemma3 import load_model

    base = load_model(model, tp=tp, allreduce=AllReduceConfig(REFERENCE), dtype=dtype,
                      max_seq_len=window)
    tok = base.tokenizer
    return base, corpus.token_windows(tok.encode, n_tokens, window, tok.bos_id)


_CHUNK = 64  # positions per numpy block: 64 x 262144 float32 = 64 MiB per temporary


# ---------------------------------------------------------------------------------------------
# Metrics on logits (numpy, float64 accumulators)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare_logits(ref: np.ndarray, out: np.ndarray, targets: np.ndarray) -> dict:
    """Sums over positions. ref, out: float32 [T, V]; targets int [T] (the next token at each
    position, -1 where none). Returns nll (of `out`), kl (ref || out), agree (argmax), count."""
    if ref.shape != out.shape or ref.shape[0] != targets.shape[0]:
        raise ValueError(f"shape mismatch: ref {ref.shape}, out {out.shape}, "
                         f"targets {targets.shape}")
    sums = {"nll": 0.0, "kl": 0.0, "agree": 0, "count": 0}
    for start in range(0, ref.shape[0], _CHUNK):
        sl = slice(start, start + _CHUNK)
        keep = targets[sl] >= 0
        if not keep.any():
            continue
        lr, lo = log_softmax(ref[sl][keep]), log_softmax(out[sl][keep])
        t = targets[sl][keep]
        sums["nll"] -= float(lo[np.arange(len(t)), t].sum(dtype=np.float64))
        sums["kl"] += float((np.exp(lr) * (lr - lo)).sum(dtype=np.float64))
        sums["agree"] += int((lr.argmax(-1) == lo.argmax(-1)).sum())
        sums["count"] += int(keep.sum())
    return sums


def common_prefix(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


# ---------------------------------------------------------------------------------------------
# Running the modes


def mode_models(base, modes: list[str]) -> dict:
    """One Gemma3Model per mode, all sharing `base`'s weights (folded copies of o and linear
    for modes that fold their rotation, as `load_model` does), mesh and tokenizer; the naive
    strawman is plugged in as the model's tensor-parallel reduction."""
    from eval.naive_allreduce import naive_all_reduce

    out = {}
    for name in modes:
        # With a reduction set, the forward pass never reads the config (it only labels the model).
        cfg, reduction = ((AllReduceConfig("bf16"), naive_all_reduce) if name == NAIVE
                          else (mode_config(name), None))
        out[name] = base.with_allreduce(cfg, reduction=reduction,
                                        fold_rotation=not name.endswith(UNFOLDED))
    return out


def score_windows(reference, variants: dict, windows: list[list[int]],
                  log=print) -> tuple[dict, dict]:
    """Score each window with `reference` and every model of `variants` (name -> model);
    returns, per name, the sums of `compare_logits` against the reference over all windows and
    the seconds its scoring took."""
    sums = {m: {"nll": 0.0, "kl": 0.0, "agree": 0, "count": 0} for m in variants}
    seconds = {m: 0.0 for m in variants}
    for wi, window in enumerate(windows):
        targets = np.array(window[1:] + [-1])
        ref = reference.score([window])[0]
        for m, model in variants.items():
            t0 = time.perf_counter()
            out = model.score([window])[0]
            seconds[m] += time.perf_counter() - t0
            for k, v in compare_logits(ref, out, targets).items():
                sums[m][k] += v
        log(f"window {wi + 1}/{len(windows)} done")
    return sums, seconds


def evaluate_tp(base, modes: list[str], windows: list[list[int]], prompts: list[list[int]],
                new_tokens: int, log=print) -> list[dict]:
    """Metrics of every mode at base.tp (see the module docstring). f32 is scored twice, so its
    own KL and agreement check that the reference is deterministic."""
    models = mode_models(base, modes)
    sums, seconds = score_windows(models[REFERENCE], models, windows,
                                  log=lambda msg: log(f"  tp={base.tp} {msg}"))
    from serving import LLM, SamplingParams

    greedy = {}
    bos = base.tokenizer.bos_id
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    length = max(len(p) for p in prompts) + 1 + new_tokens
    for m in modes:
        with LLM(models[m], max_num_seqs=len(prompts), max_seq_len=length) as llm:
            greedy[m] = llm.generate([[bos] + p for p in prompts], params)
    rows = []
    for m in modes:
        s = sums[m]
        exact = [g == r for g, r in zip(greedy[m], greedy[REFERENCE])]
        prefix = [common_prefix(g, r) for g, r in zip(greedy[m], greedy[REFERENCE])]
        rows.append({
            "tp": base.tp, "mode": m,
            "allreduce": mode_config(m).to_dict() if m != NAIVE else {"method": NAIVE},
            "tokens_scored": s["count"], "perplexity": math.exp(s["nll"] / s["count"]),
            "kl_to_f32": s["kl"] / s["count"], "top1_agree_f32": s["agree"] / s["count"],
            "greedy_exact_match": sum(exact) / len(exact),
            "greedy_prefix": sum(prefix) / len(prefix), "score_s": seconds[m],
        })
    bf16 = next((r for r in rows if r["mode"] == "bf16"), None)
    for r in rows:
        r["perplexity_vs_bf16"] = r["perplexity"] / bf16["perplexity"] - 1 if bf16 else None
    return rows


def run(model: str = "gemma3-270m", tps: tuple[int, ...] = (2, 4), modes: list[str] | None = None,
        n_tokens: int = 4096, window: int = 512, n_prompts: int = 16, prompt_tokens: int = 32,
        new_tokens: int = 16, dtype: str = "bfloat16", log=print,
        checkpoint=None) -> dict:
    """Evaluate every mode at every tp; returns the report (settings + rows).
    checkpoint(report) is called after each tp with the rows so far (long runs keep them)."""
    from models.gemma3 import load_model

    modes = list(modes or MODES)
    for m in modes:
        mode_config(m)  # fail on a typo before any model loads
    if REFERENCE not in modes:
        modes.insert(0, REFERENCE)
    rows, tokens = [], None
    for tp in tps:
        base = load_model(model, tp=tp, allreduce=mode_config(REFERENCE), dtype=dtype,
                          max_seq_len=max(window, prompt_tokens + new_tokens + 1))
        tok = base.tokenizer
        windows = corpus.token_windows(tok.encode, n_tokens, window, tok.bos_id)
        prompts = corpus.prompt_set(tok.encode, n_prompts, prompt_tokens)
        tokens = sum(len(w) - 1 for w in windows)
        log(f"tp={tp}: {base}; {len(windows)} windows of {window} ({tokens} predictions), "
            f"{len(prompts)} prompts")
        rows += evaluate_tp(base, modes, windows, prompts, new_tokens, log=log)
        del base
        if checkpoint is not None:
            checkpoint(_report(model, dtype, tokens, window, n_prompts, prompt_tokens,
                               new_tokens, tps, modes, rows))
    return _report(model, dtype, tokens, window, n_prompts, prompt_tokens, new_tokens, tps,
                   modes, rows)


def _report(model, dtype, tokens, window, n_prompts, prompt_tokens, new_tokens, tps, modes,
            rows) -> dict:
    return {
        "model": model, "dtype": dtype, "corpus": corpus.SOURCE, "tokens_scored": tokens,
        "window": window, "prompts": n_prompts, "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens, "tp": list(tps), "modes": modes, "reference": REFERENCE,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows,
    }


def format_table(rows: list[dict]) -> str:
    head = (f"{'tp':>3} {'mode':<18} {'perplexity':>10} {'vs bf16':>8} {'KL to f32':>10} "
            f"{'top-1 = f32':>11} {'greedy =':>9} {'prefix':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        vs = "-" if r["perplexity_vs_bf16"] is None else f"{100 * r['perplexity_vs_bf16']:+.2f}%"
        lines.append(f"{r['tp']:>3} {r['mode']:<18} {r['perplexity']:>10.4f} {vs:>8} "
                     f"{r['kl_to_f32']:>10.2e} {100 * r['top1_agree_f32']:>10.2f}% "
                     f"{100 * r['greedy_exact_match']:>8.1f}% {r['greedy_prefix']:>7.2f}")
    return "\n".join(lines)


def add_scoring_args(p: argparse.ArgumentParser, *, tokens: int, dtype: str) -> None:
    """The options every quality evaluation takes: the model, how much text, its dtype and
    where the report goes."""
    p.add_argument("--model", default="gemma3-270m", help="load_model source")
    p.add_argument("--tokens", type=int, default=tokens, help="next-token predictions scored")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window (with BOS)")
    p.add_argument("--dtype", default=dtype, choices=["bfloat16", "float32"])
    p.add_argument("--out", default=None, help="write the report as JSON")


def comma_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scoring_args(p, tokens=4096, dtype="bfloat16")
    p.add_argument("--tp", default="2,4", help="comma list of tensor-parallel degrees")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma list of AllReduce labels (e.g. int8-semi-ag+hadamard) or naive; "
                        "'int8:unfolded' rotates at run time instead of in the weights")
    p.add_argument("--prompts", type=int, default=16, help="greedy prompts")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16, help="greedy continuation length")
    args = p.parse_args(argv)
    tps = tuple(int(t) for t in args.tp.split(","))
    from jax_platform import ensure_cpu_devices

    ensure_cpu_devices(max(tps))
    def save(report: dict) -> None:
        write_json(args.out, report)

    report = run(args.model, tps, comma_list(args.modes),
                 args.tokens, args.window, args.prompts, args.prompt_tokens, args.new_tokens,
                 args.dtype, checkpoint=save)
    print(f"# {report['model']} ({report['dtype']}), {report['tokens_scored']} tokens of "
          f"{report['corpus']}; reference: f32 AllReduce at the same tp")
    print(format_table(report["rows"]))
    save(report)
    return report


if __name__ == "__main__":
    main()
