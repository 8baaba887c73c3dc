"""The full sweep of checks of the Pallas ring kernel (equarx.pallas_ring) and of the multi-axis schedule
through kernels (equarx.pallas_torus) that need no TPU.

- interpret: the kernels in Pallas' TPU interpret mode on 2, 4 and 8 virtual CPU devices (one
  axis, or a 2x2 / 2x4 / 4x2 / 2x2x2 mesh), each case against the module's
  `reference_all_reduce` (the same schedule through equarx.ring's ppermutes): bitwise equal,
  identical replicas, the race detector clean, and no semaphore left non-zero at kernel exit
  (the interpreter only prints a warning for that; it counts as a failure here), in both DMA
  execution modes.
- model: a small Gemma 3 (random weights, 2 layers) scoring two prompts with an `@pallas`
  AllReduce in interpret mode, on one axis or a 2x2 mesh (4 devices) and on 2x4 (8), against
  the same model with the module's reference plugged in as its reduction: the logits bitwise
  equal (and near the f32 psum's), so the kernels run inside the model's programs as they are.
- lower: the kernels lowered for TPU (`lowering_platforms=("tpu",)`, Pallas' Mosaic lowering)
  for every message the Gemma 3 models send: [tokens, d_model] for each model's d_model, tp
  2/4/8/16 and the 2x2, 2x4, 4x4 and 2x2x4 meshes, bfloat16 and float32, each codec, decode to
  long-prefill token counts.

Each device count needs its own process (XLA reads the device count, and the CPU runtime its
thread count, PJRT_NPROC, when JAX starts), so every group of cases runs in a child process
(`--child`) and reports one JSON line per case.

  python tests/equarx/pallas_sweep.py                  # everything (several minutes)
  python tests/equarx/pallas_sweep.py --only lower --json report.json
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import subprocess
import sys
import time

SEMAPHORE_WARNING = "non-zero count"  # the interpreter's message for a semaphore left set
CODEC_LABELS = ("int8-full+tile@pallas", "int8@pallas", "bf16_ring@pallas")
MODEL_D = {"270m": 640, "1b": 1152, "4b": 2560, "12b": 3840, "27b": 5376}
TPS = (2, 4, 8, 16)
DTYPES = ("bfloat16", "float32")
TOKENS = (1, 16, 128, 2048, 8192)  # a decode row, a prefill chunk, prompt buckets
MESHES = ("2x2", "2x4", "4x4", "2x2x4")  # multi-axis tori: v5e 2x2, 2x4, 4x4; v5p 2x2x4
AXES = ("x", "y", "z")


def interpret_case(label: str, shape, dtype: str = "float32", mode: str = "on_wait",
                   minishards: int = 4, min_piece: int = 1024, public: bool = False,
                   mesh: str | None = None) -> dict:
    """One interpret-mode case; `min_piece` small so that small messages are pipelined.
    `public`: through `equarx.all_reduce` (its dispatch, default interpret parameters and
    minimum piece) instead of calling the kernel's module with the race detector on.
    `mesh`: e.g. "2x2", "2x4" or "2x2x2" for the multi-axis schedule (equarx.pallas_torus) over that
    many devices, None for one axis over all of them."""
    return dict(kind="interpret", label=label, shape=list(shape), dtype=dtype, mode=mode,
                minishards=minishards, min_piece=min_piece, public=public, mesh=mesh)


def model_case(label: str, mesh: str | None = None) -> dict:
    return dict(kind="model", label=label, mesh=mesh)


def lower_case(label: str, tp: int, tokens: int, d_model: int, dtype: str,
               mesh: str | None = None) -> dict:
    return dict(kind="lower", label=label, tp=tp, shape=[tokens, d_model], dtype=dtype,
                mesh=mesh)


def _mesh(devices, n: int, mesh: str | None):
    """(Mesh, its axis names, their sizes) for a case: one axis "tp", or the named torus."""
    import numpy as np
    from jax.sharding import Mesh

    dims = (n,) if not mesh else tuple(int(v) for v in mesh.split("x"))
    axes = ("tp",) if not mesh else AXES[:len(dims)]
    return Mesh(np.array(devices[:n]).reshape(dims), axes), axes, dims


def full_interpret_cases(n_devices: int) -> list[dict]:
    """Every codec x dtype x DMA mode, with one and two windows of minishards (a 3-D message
    whose rows and columns need padding)."""
    cases = []
    for label, dtype, mode in itertools.product(CODEC_LABELS, DTYPES, ("on_wait", "eager")):
        cases.append(interpret_case(label, (2, 50, 200 * n_devices // 2), dtype, mode))
        if n_devices <= 4:  # 5 minishards a direction: windows of 4 and 1
            cases.append(interpret_case(label, (1152, 64 * n_devices), dtype, mode,
                                        minishards=12))
        for torus in {4: ("2x2",), 8: ("2x2x2", "2x4", "4x2")}.get(n_devices, ()):
            cases.append(interpret_case(label, (2, 40, 130 * n_devices), dtype, mode,
                                        mesh=torus))
    if n_devices == 4:
        cases += [model_case(label, mesh) for label in CODEC_LABELS for mesh in (None, "2x2")]
    if n_devices == 8:
        cases += [model_case(label, "2x4") for label in CODEC_LABELS]
    return cases


def full_lower_cases() -> list[dict]:
    one_axis = [lower_case(label, tp, tokens, d, dtype)
                for label, tp, tokens, d, dtype in itertools.product(
                    CODEC_LABELS, TPS, TOKENS, MODEL_D.values(), DTYPES)]
    tori = [lower_case(label, mesh_size(mesh), tokens, d, dtype, mesh)
            for label, mesh, tokens, d, dtype in itertools.product(
                CODEC_LABELS, MESHES, TOKENS, MODEL_D.values(), DTYPES)]
    return one_axis + tori


def mesh_size(mesh: str) -> int:
    out = 1
    for v in mesh.split("x"):
        out *= int(v)
    return out


# ---- the child process: one device count, a list of cases ----

def _selfcheck_detects_semaphore_warning() -> bool:
    """A kernel that leaves a semaphore signalled must produce the warning this script looks
    for (so that a silent interpreter cannot make the check vacuous)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(x_ref, o_ref, sem):
        pl.semaphore_signal(sem, 1)
        o_ref[...] = x_ref[...]

    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       scratch_shapes=[pltpu.SemaphoreType.REGULAR],
                       interpret=pltpu.InterpretParams())
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        jax.block_until_ready(f(jnp.zeros((8, 128), jnp.float32)))
    return SEMAPHORE_WARNING in captured.getvalue()


def _run_interpret(case: dict, n: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import equarx
    from equarx import AllReduceConfig, pallas_ring, pallas_torus
    from equarx.layout import MIN_PIECE_ELEMENTS

    cfg = AllReduceConfig.from_label(case["label"], minishards=case["minishards"])
    if case["public"]:
        case = {**case, "min_piece": MIN_PIECE_ELEMENTS, "mode": "on_wait"}
    mesh, axes, dims = _mesh(jax.devices(), n, case.get("mesh"))
    shape = tuple(case["shape"])
    x = jax.random.normal(jax.random.key(n), (n, *shape), jnp.float32)
    x = jax.device_put(x.astype(case["dtype"]), NamedSharding(mesh, P(axes)))
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=case["mode"])

    def on_mesh(f):
        return jax.jit(jax.shard_map(lambda v: f(v[0])[None], mesh=mesh, in_specs=P(axes),
                                     out_specs=P(axes), check_vma=False))

    if case.get("mesh"):
        module, where = pallas_torus, axes
        p = pallas_torus.plan_for(cfg, shape, dims, case["min_piece"])
    else:
        module, where = pallas_ring, "tp"
        p = pallas_ring.plan_for(cfg, shape, n, case["min_piece"])
    captured = io.StringIO()
    t0 = time.perf_counter()
    if case["public"]:
        def kernel(v):
            return equarx.all_reduce(v, where, cfg)
    else:
        def kernel(v):
            return module.all_reduce(v, where, cfg, params, case["min_piece"])
    with contextlib.redirect_stdout(captured):
        got = on_mesh(kernel)(x)
        got = np.asarray(jax.block_until_ready(got).astype(jnp.float32))
    seconds = time.perf_counter() - t0
    # The public entry runs without the race detector: None, not "no race".
    races = None if case["public"] else bool(interpreter.races.races_found)
    want = on_mesh(lambda v: module.reference_all_reduce(v, where, cfg, case["min_piece"]))(x)
    want = np.asarray(want.astype(jnp.float32))
    exact = np.asarray(x.astype(jnp.float32)).sum(0)
    warnings = [line for line in captured.getvalue().splitlines() if SEMAPHORE_WARNING in line]
    return dict(minishards_per_direction=p.minishards, window=p.window, piece=list(p.piece),
                bitwise=bool(np.array_equal(got, want)),
                differing=int((got != want).sum()),
                replicas_identical=all(np.array_equal(got[0], g) for g in got[1:]),
                races=races, semaphore_warnings=warnings,
                rel_error=float(np.abs(got[0] - exact).max() / np.abs(exact).max()),
                seconds=round(seconds, 2))


def _run_model(case: dict, n: int) -> dict:
    import numpy as np

    from equarx import AllReduceConfig, pallas_ring, pallas_torus
    from models.gemma3 import load_model

    cfg = AllReduceConfig.from_label(case["label"])
    reference = pallas_torus if case.get("mesh") else pallas_ring
    t0 = time.perf_counter()
    # fold_rotation=False: the plugged-in reduction below gets the partials unrotated too.
    heads = "&heads=8" if n > 4 else ""  # tiny's 4 heads split over at most 4 devices
    kernel = load_model("random:tiny?layers=1&d=256&ffn=512" + heads, tp=n,
                        tp_mesh=case.get("mesh"), dtype="float32", allreduce=cfg,
                        fold_rotation=False)
    prompts = [[2] + list(range(10, 40)), [2] + list(range(100, 130))]
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        got = np.asarray(kernel.score(prompts))
    seconds = time.perf_counter() - t0
    plugged = kernel.with_allreduce(
        cfg, reduction=lambda x, axes: reference.reference_all_reduce(x, axes, cfg))
    want = np.asarray(plugged.score(prompts))
    exact = np.asarray(kernel.with_allreduce(AllReduceConfig("f32")).score(prompts))
    warnings = [line for line in captured.getvalue().splitlines() if SEMAPHORE_WARNING in line]
    return dict(bitwise=bool(np.array_equal(got, want)), differing=int((got != want).sum()),
                semaphore_warnings=warnings,
                rel_error=float(np.abs(got - exact).max() / np.abs(exact).max()),
                seconds=round(seconds, 2))


def _run_lower(case: dict) -> dict:
    import jax
    from jax.sharding import PartitionSpec as P

    from equarx import AllReduceConfig, pallas_ring, pallas_torus

    cfg = AllReduceConfig.from_label(case["label"])
    n = case["tp"]
    mesh, axes, dims = _mesh(jax.devices(), n, case.get("mesh"))
    shape = tuple(case["shape"])
    if case.get("mesh"):
        def reduce(v):
            return pallas_torus.all_reduce(v, axes, cfg, interpret=None)
        p = pallas_torus.plan_for(cfg, shape, dims)
        vmem = pallas_torus.vmem_bytes(p, dims, case["dtype"])
    else:
        def reduce(v):
            return pallas_ring.all_reduce(v, "tp", cfg, interpret=None)
        p = pallas_ring.plan_for(cfg, shape, n)
        vmem = pallas_ring.vmem_bytes(p, case["dtype"], case["dtype"])
    f = jax.jit(jax.shard_map(lambda v: reduce(v[0])[None], mesh=mesh, in_specs=P(axes),
                              out_specs=P(axes), check_vma=False))
    t0 = time.perf_counter()
    text = f.trace(jax.ShapeDtypeStruct((n, *shape), case["dtype"])).lower(
        lowering_platforms=("tpu",)).as_text()
    return dict(lowered="tpu_custom_call" in text, minishards_per_direction=p.minishards,
                piece=list(p.piece), vmem_bytes=vmem, seconds=round(time.perf_counter() - t0, 2))


def _child(n: int, cases: list[dict]) -> None:
    from jax.experimental.pallas import tpu as pltpu

    if any(c["kind"] in ("interpret", "model") for c in cases):
        print(json.dumps(dict(kind="selfcheck",
                              detects_semaphore_warning=_selfcheck_detects_semaphore_warning())),
              flush=True)
    for case in cases:
        try:
            run = {"interpret": _run_interpret, "model": _run_model}.get(case["kind"])
            result = run(case, n) if run else _run_lower(case)
        except Exception as e:  # reported, and the interpreter's state reset for the next case
            pltpu.reset_tpu_interpret_mode_state()
            result = dict(error=f"{type(e).__name__}: {str(e)[:500]}")
        print(json.dumps({**case, "devices": n, **result}), flush=True)


# ---- the parent: one child per device count ----

def run_child(n_devices: int, cases: list[dict], timeout: float = 1800) -> list[dict]:
    """Run `cases` in a child process with `n_devices` virtual CPU devices; one dict per case
    (plus a leading selfcheck row when there are interpret cases). Raises on a crashed or
    hung child, with its output."""
    import jax_platform

    env = jax_platform.child_environment(malloc_tunables=False, cpu_devices=n_devices)
    env["JAX_PLATFORMS"] = "cpu"
    # The interpreter passes buffers through host callbacks, which the CPU runtime copies on
    # a thread pool sized to the cores; with fewer threads than devices, buffers over ~100 KiB
    # deadlock (see the project's Pallas notes). 4 N + 4 threads were enough.
    env["PJRT_NPROC"] = str(4 * n_devices + 4)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(n_devices),
                           "--cases", json.dumps(cases)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(rows) < len(cases):
        raise RuntimeError(f"check child ({n_devices} devices) exited {proc.returncode} after "
                           f"{len(rows)} of {len(cases)} cases:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return rows


def failures(rows: list[dict]) -> list[str]:
    """What went wrong, one line per failed check."""
    out = []
    for r in rows:
        name = f"{r.get('label')} {r.get('shape')} {r.get('dtype')} {r.get('mode', '')} " \
               f"on {r.get('mesh') or r.get('devices')}"
        if r["kind"] == "selfcheck":
            if not r["detects_semaphore_warning"]:
                out.append("the semaphore warning is not captured: checks would be vacuous")
        elif "error" in r:
            out.append(f"{name}: {r['error']}")
        elif r["kind"] == "interpret":
            bad = [k for k, ok in (("not bitwise equal", r["bitwise"]),
                                   ("replicas differ", r["replicas_identical"]),
                                   ("race detected", r["races"] is not True),
                                   ("semaphore left non-zero", not r["semaphore_warnings"]))
                   if not ok]
            if bad:
                out.append(f"{name}: {', '.join(bad)}")
        elif r["kind"] == "model":
            bad = [k for k, ok in (("logits not bitwise equal", r["bitwise"]),
                                   ("semaphore left non-zero", not r["semaphore_warnings"]),
                                   ("far from the f32 psum", r["rel_error"] < 0.05)) if not ok]
            if bad:
                out.append(f"model {r['label']} on {r.get('mesh') or r['devices']}: "
                           f"{', '.join(bad)}")
        elif not r["lowered"]:
            out.append(f"{name}: no TPU custom call in the lowered module")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("interpret", "lower"), help="one kind of check")
    ap.add_argument("--devices", default="2,4,8", help="device counts for interpret mode")
    ap.add_argument("--json", help="write every row to this file")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, json.loads(args.cases))
        return 0
    rows = []
    if args.only != "lower":
        for n in (int(v) for v in args.devices.split(",")):
            t0 = time.perf_counter()
            rows += run_child(n, full_interpret_cases(n))
            print(f"interpret, {n} devices: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.only != "interpret":
        t0 = time.perf_counter()
        rows += run_child(max(TPS), full_lower_cases())
        print(f"lowering: {time.perf_counter() - t0:.0f} s", flush=True)
    for r in rows:
        if r["kind"] == "interpret" and "error" not in r:
            print(f"{r['label']:24} {str(r['shape']):16} {r['dtype']:9} {r['mode']:8} "
                  f"N={r.get('mesh') or r['devices']} mh={r['minishards_per_direction']} "
                  f"bitwise={r['bitwise']} races={r['races']} "
                  f"sems={len(r['semaphore_warnings'])} rel_err={r['rel_error']:.4f} "
                  f"{r['seconds']} s")
        if r["kind"] == "model" and "error" not in r:
            print(f"model {r['label']:18} N={r.get('mesh') or r['devices']} "
                  f"bitwise={r['bitwise']} rel_err_vs_f32={r['rel_error']:.4f} {r['seconds']} s")
    lowered = [r for r in rows if r["kind"] == "lower" and r.get("lowered")]
    print(f"lowered for TPU: {len(lowered)} of {sum(r['kind'] == 'lower' for r in rows)}; "
          f"largest VMEM scratch {max((r['vmem_bytes'] for r in lowered), default=0) / 2**20:.1f}"
          f" MiB")
    if args.json:
        from eval.reports import write_json

        write_json(args.json, dict(rows=rows, failures=failures(rows)))
    bad = failures(rows)
    for line in bad:
        print("FAIL", line)
    print("all checks passed" if not bad else f"{len(bad)} failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
