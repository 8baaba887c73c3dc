"""What an AllReduce configuration costs a server before it answers: compile time and size.

    python -m eval.bench_compile                                    # the default configurations
    python -m eval.bench_compile --model random:270m --configs 4:bf16,4:int8,2x2:int8

A server compiles its step programs before it is ready (and reads them back on a restart), and
each of a model's layers holds two AllReduces, inlined: so the AllReduce's code is compiled
2 x layers times per program. For each configuration `TP:LABEL` (TP a device count, or a mesh
such as 2x2 for `--tp-mesh`) this runs, in fresh processes:

- cold: a paged engine's first step of a lone one-token prompt (its program compiled, then
  run once) with empty caches, as a first start meets it;
- restart: the same in a second process over the caches the first filled (JAX's compilation
  cache and the program cache), as a restart meets it;

and reports each one's wall and CPU seconds, the bytes the caches hold after it (the compiled
executables and the traced programs: a restart that reads everything back adds none), and, for
the AllReduce alone, the fused kernels and HLO instructions of one call on a decode-sized
message (the model's width, 8 rows, bfloat16) compiled for this machine. `--no-native`
measures the XLA form of the codec (what a TPU or a GPU without the Triton kernels compiles)
instead of this CPU's C++ kernels.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_CONFIGS = "4:bf16,4:int8,2x2:bf16,2x2:int8"


def _parse(config: str) -> tuple[int, str | None, str]:
    """'4:int8' -> (4, None, 'int8'); '2x2:int8' -> (4, '2x2', 'int8')."""
    where, _, label = config.partition(":")
    if not label:
        raise SystemExit(f"a configuration is TP:LABEL (e.g. 4:int8 or 2x2:int8), got {config!r}")
    return math.prod(int(v) for v in where.split("x")), where if "x" in where else None, label


def _child(model: str, config: str, cache: str) -> dict:
    """In a fresh process: the first step of a lone one-token prompt, timed; and one
    AllReduce's compiled size."""
    tp, mesh, label = _parse(config)
    import jax_platform

    jax_platform.ensure_cpu_devices(tp)
    jax_platform.enable_compilation_cache(os.path.join(cache, "jax"))

    from equarx import AllReduceConfig
    from models.gemma3 import load_model
    from serving import IDLE, PagedRunner, PagedScheduler, Sequence, step_inputs

    allreduce = AllReduceConfig.from_label(label)
    m = load_model(model, tp=tp, tp_mesh=mesh, allreduce=allreduce, dtype="bfloat16",
                   max_seq_len=2048, program_cache_dir=os.path.join(cache, "programs"))
    runner = PagedRunner(m, max_num_seqs=8, max_seq_len=2048)
    sched = PagedScheduler(runner.info)
    sched.add([Sequence(id=0, prompt=[runner.tokenizer.bos_id], params=IDLE, seed=0)])
    inputs = step_inputs(sched.schedule(), sched.kv, runner.info)
    t0, c0 = time.perf_counter(), time.process_time()
    runner.run_step(inputs)
    row = {"step_s": time.perf_counter() - t0, "step_cpu_s": time.process_time() - c0}
    row.update(_allreduce_size(m.mesh, m.config.d_model, allreduce))
    return row


def _allreduce_size(mesh, width: int, allreduce) -> dict:
    """Fused kernels and HLO instructions of one AllReduce of bfloat16 [8, width] over the
    model's mesh (every axis), compiled."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from equarx import all_reduce
    from equarx.accounting import program_size

    axes = tuple(mesh.axis_names)
    f = jax.jit(jax.shard_map(lambda v: all_reduce(v[0], axes, allreduce)[None], mesh=mesh,
                              in_specs=P(axes), out_specs=P(axes), check_vma=False))
    fusions, instructions = program_size(
        f.lower(jnp.zeros((mesh.size, 8, width), jnp.bfloat16)).compile())
    return {"allreduce_fusions": fusions, "allreduce_instructions": instructions}


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(model: str, config: str, native: bool) -> dict:
    """Cold then restart, each in its own process over one cache directory."""
    env = dict(os.environ)
    if not native:
        env["EQUARX_NATIVE_CPU"] = "0"
    row = {"config": config, "model": model, "native_cpu": native}
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as cache:
        for phase in ("cold", "restart"):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            out = subprocess.run([sys.executable, "-m", "eval.bench_compile", "--child", config,
                                  "--model", model, "--cache", cache], env=env,
                                 capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{config} {phase}: the child failed\n{out.stderr[-3000:]}")
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            row[f"{phase}_step_s"] = round(got["step_s"], 2)
            row[f"{phase}_step_cpu_s"] = round(got["step_cpu_s"], 2)
            row[f"{phase}_process_cpu_s"] = round(after.ru_utime + after.ru_stime
                                                  - before.ru_utime - before.ru_stime, 1)
            row[f"{phase}_cache_bytes"] = _bytes(Path(cache))
            row.update({k: got[k] for k in ("allreduce_fusions", "allreduce_instructions")})
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:270m")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated TP:LABEL, TP a device count or a mesh (2x2)")
    ap.add_argument("--no-native", action="store_true",
                    help="the codec's XLA form instead of the CPU kernels")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.model, args.child, args.cache)))
        return
    rows = []
    print(f"{'config':>10} {'cold s':>7} {'cpu':>6} {'restart s':>9} {'cpu':>6} {'cache MB':>8} "
          f"{'AR fusions':>10} {'AR instr':>8}")
    for config in args.configs.split(","):
        r = measure(args.model, config, not args.no_native)
        rows.append(r)
        print(f"{config:>10} {r['cold_step_s']:>7.1f} {r['cold_step_cpu_s']:>6.1f} "
              f"{r['restart_step_s']:>9.1f} {r['restart_step_cpu_s']:>6.1f} "
              f"{r['cold_cache_bytes'] / 1e6:>8.1f} {r['allreduce_fusions']:>10} "
              f"{r['allreduce_instructions']:>8}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
