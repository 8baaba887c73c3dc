"""Does an XLA flag compile the engine's programs faster without changing what they compute?

    python -m eval.compile_flags                                   # the default set below
    python -m eval.compile_flags --flag=--xla_cpu_use_xnnpack=false     # the default and this

Each setting runs in a fresh process (XLA reads its flags once, at start-up), with no
compilation cache: a tiny random model's paged engine generates greedily for six prompts
beside each other, then the model scores them. Reported per setting: the process's CPU seconds
for that work, XLA's backend-compile seconds and program count (`jax.monitoring`), and a hash
of every generated token, its logprob and every score logit, which must equal the default's for
a flag to be usable: the suite runs the programs users run. A flag XLA does not know ends its
process (reported as such).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys

from eval.bench_engine import _submit
from eval.compile_events import record_compiles

# Flags of jaxlib's XLA:CPU that could plausibly make compiling cheaper.
DEFAULT_FLAGS = ("", "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_use_xnnpack=false",
                 "--xla_cpu_enable_concurrency_optimized_scheduler=false")
PROMPT_LENGTHS = (1, 7, 23, 45, 9, 30)


def _prompts(vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [[2] + rng.integers(4, vocab, n - 1).tolist() for n in PROMPT_LENGTHS]


def _generate(engine, prompts: list[list[int]], max_tokens: int) -> list[list[tuple[int, float]]]:
    """Each prompt's greedy (token, logprob)s, all submitted before any is awaited."""
    from serving import EngineCore

    core = EngineCore(engine).start()
    try:
        streams = [_submit(core, p, max_tokens) for p in prompts]
        return [s.wait(600).tokens for s in streams]
    finally:
        core.shutdown()


def child(model: str) -> dict:
    """This process's measurement (its XLA_FLAGS set by the parent)."""
    import numpy as np

    from equarx import AllReduceConfig
    from models.gemma3 import load_model
    from serving import PagedRunner

    compiles: list[float] = []
    record_compiles(compiles)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    m = load_model(model, tp=1, dtype="float32", allreduce=AllReduceConfig("f32"))
    prompts = _prompts(m.config.vocab_size)
    tokens = _generate(PagedRunner(m, max_num_seqs=4, max_seq_len=96, page_size=4,
                                   long_prefill_token_threshold=8),
                       prompts, max_tokens=6)
    scores = m.score(prompts)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    h = hashlib.sha256(repr(tokens).encode())
    h.update(np.ascontiguousarray(np.asarray(scores)).tobytes())
    return dict(cpu_s=round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 1),
                compile_s=round(sum(compiles), 1), programs=len(compiles), bits=h.hexdigest()[:16])


def measure(flags: str, model: str) -> dict:
    """One setting, in a fresh process: child()'s dict, or an error."""
    import jax_platform

    env = jax_platform.child_environment(malloc_tunables=False)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "eval.compile_flags", "--child", "--model", model],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(flags=flags, error=last.split("] ", 1)[-1][:120])  # without glog's prefix
    return dict(flags=flags, **json.loads(rows[-1]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flag", action="append", default=[],
                    help="an XLA flag setting to compare with the default (repeatable; write "
                         "--flag=--xla_...); none: the set in DEFAULT_FLAGS")
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model)), flush=True)
        return
    from eval.reports import format_columns

    flags = [""] + args.flag if args.flag else list(DEFAULT_FLAGS)
    rows = [measure(f, args.model) for f in flags]
    base = next((r.get("bits") for r in rows if not r["flags"]), None)

    def verdict(r):
        return r["error"] if "error" in r else ("same" if r["bits"] == base else "DIFFERENT")

    print(format_columns(rows, [
        ("XLA flags", "<56", lambda r: r["flags"] or "(default)"),
        ("cpu s", ">6", lambda r: str(r.get("cpu_s", "-"))),
        ("compile s", ">9", lambda r: str(r.get("compile_s", "-"))),
        ("programs", ">8", lambda r: str(r.get("programs", "-"))),
        ("bits vs default", "<20", verdict)]))


if __name__ == "__main__":
    main()
