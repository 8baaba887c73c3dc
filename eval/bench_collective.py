"""Benchmark equarx.all_reduce methods side by side: time, bytes per device, MSE.

Two modes:
  one process, D virtual CPU devices (default): a "collective" is a memcpy, so this shows
    what quantization costs in compute, nothing more;
  --processes N: one process per device on JAX's distributed runtime (gloo over TCP on
    127.0.0.1), with --link-gbit X inside a network namespace whose loopback is shaped to X
    Gbit/s, so that the link is the bottleneck (needs root).

Methods are measured interleaved (A B C D, then rotated) after a warm-up; the table shows the
median time, the min-max spread, the median of the per-repeat ratios against bf16 and
bf16_ring, the bytes each device sends (read from the compiled program), that figure against
an ideal bf16 ring AllReduce of the same message, and the MSE of the program's bf16 output
against the float32 sum of the same bf16 inputs. On a shaped link two more columns: "wire",
every device's bytes through the one shared token bucket at the link rate (a lower bound),
and with --predict-from an unshaped run, "model" = that run's time + wire (the additive
alpha-beta prediction, an upper bound where host work overlaps other processes' transfers).

  python -m eval.bench_collective --sizes 64K,1M,16M --repeats 7 --out single.json
  python -m eval.bench_collective --processes 4 --one-message-per-hop --out p4.json
  python -m eval.bench_collective --processes 4 --link-gbit 2 --one-message-per-hop \
      --predict-from p4.json --out p4_2g.json
  python -m eval.bench_collective --show p4_2g.json --predict-from p4.json

Message size = bytes of the bf16 message each device contributes. --one-message-per-hop sets
pipelined=False: XLA:CPU runs collectives synchronously, so pipelining cannot overlap
anything there and each extra message only adds latency.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equarx import (AllReduceConfig, all_reduce, bytes_sent_per_device, folds_rotation, groups,
                    ideal_ring_bytes)
from eval.reports import write_json
from jax_platform import ensure_cpu_devices, keep_freed_memory, malloc_label

DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M"
DEFAULT_METHODS = "bf16,bf16_ring,int8,int8-full+tile"
# Message rows: a model's activations are [tokens, d_model]; the token-local layouts split every
# row across the devices. 4096 divides every power-of-two size here into whole tokens.
DEFAULT_ROW = 4096


def parse_size(text: str) -> int:
    """'64K' -> 65536, '4M' -> 4 MiB, '1000' -> 1000 bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    value = float(text[:-1] if mult > 1 else text)
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value * mult)


def format_size(nbytes: int) -> str:
    for unit, mult in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult} {unit}"
    return f"{nbytes} B"


def parse_method(name: str, minishards: int, pipelined: bool = True):
    """'bf16', 'f32', 'bf16_ring[-semi]', 'int8-full', 'int8-semi-ag', 'int8-full+hadamard', ...
    -> AllReduceConfig (the spelling of `AllReduceConfig.label`), with an optional mesh suffix
    (see split_method)."""
    return AllReduceConfig.from_label(split_method(name)[0], minishards=minishards,
                                      pipelined=pipelined)


MESH_KINDS = ("ring", "snake", "torus")


def split_method(name: str) -> tuple[str, str]:
    """'int8-full+tile:torus' -> ('int8-full+tile', 'torus'). Suffixes: none (a 1D mesh "tp"
    over the devices in process order), ':snake' (a 1D mesh whose consecutive devices are torus
    neighbours, eval.torus.snake_order), ':torus' (the mesh of --mesh's shape, axes x, y[, z],
    reduced over all of them: the multi-axis schedule for ring methods, XLA's psum over the
    tuple for bf16/f32). See `method_options` for ':folded'."""
    label, kind, _ = method_options(name)
    return label, kind


def method_options(name: str) -> tuple[str, str, bool]:
    """'int8:folded', 'int8:torus:folded' -> (label, mesh kind, folded). ':folded' times the
    AllReduce as a model with its rotation folded into the weights calls it
    (`all_reduce(..., rotated=True)`: the input counts as rotated partials, and the forward
    rotation is skipped); only for configs that fold (equarx.folds_rotation)."""
    label, *opts = name.split(":")
    kinds = [o for o in opts if o in MESH_KINDS]
    unknown = [o for o in opts if o not in MESH_KINDS and o != "folded"]
    if unknown or len(kinds) > 1 or len(opts) > len(set(opts)):
        raise ValueError(f"mesh suffix must be one of {MESH_KINDS[1:]} (and/or ':folded'), "
                         f"got {name!r}")
    return label, (kinds[0] if kinds else "ring"), "folded" in opts


def parse_dims_arg(text: str) -> tuple[int, ...]:
    from eval.torus import parse_dims

    return parse_dims(text)


def _stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def _meshes(kinds: list[str], dims: tuple[int, ...] | None) -> dict[str, tuple[Mesh, tuple]]:
    devices = np.array(jax.devices())
    out = {}
    for kind in kinds:
        if kind == "ring":
            out[kind] = (Mesh(devices, ("tp",)), ("tp",))
            continue
        if dims is None or int(np.prod(dims)) != devices.size:
            raise ValueError(f"':{kind}' methods need --mesh (or --torus) dimensions whose "
                             f"product is the {devices.size} devices, got {dims}")
        if kind == "snake":
            from eval.torus import snake_order

            out[kind] = (Mesh(devices[snake_order(tuple(dims))], ("tp",)), ("tp",))
        else:
            axes = ("x", "y", "z")[:len(dims)]
            out[kind] = (Mesh(devices.reshape(dims), axes), axes)
    return out


def bench_on_mesh(sizes: list[int], methods: list[str], repeats: int, minishards: int,
                  pipelined: bool = True, mse: bool = True, seed: int = 0,
                  row_width: int = DEFAULT_ROW, mesh_dims: tuple[int, ...] | None = None
                  ) -> list[dict]:
    """Measure every method at every size on all of jax.devices() (a 1D mesh axis "tp", or
    the mesh a method's suffix names: split_method). Runs the same way in one process or in
    every process of a distributed run."""
    n = jax.device_count()
    kinds = {name: split_method(name)[1] for name in methods}
    folded = {name: method_options(name)[2] for name in methods}
    # one order in every process (a set's would vary with the hash seed, and with it the
    # barrier's mesh and the order of collectives)
    meshes = _meshes(list(dict.fromkeys(kinds.values())), mesh_dims)
    local_devices = jax.local_device_count()
    rows = []
    for size in sizes:
        n_el = size // 2
        width = row_width if n_el % row_width == 0 else n_el  # [tokens, row], or one row
        tokens = n_el // width
        rng = np.random.default_rng(seed + 1000 * jax.process_index())
        local = rng.standard_normal((local_devices * tokens, width),
                                    dtype=np.float32).astype(jnp.bfloat16)
        xs = {kind: jax.make_array_from_process_local_data(
            NamedSharding(mesh, P(axes)), local, (n * tokens, width))
            for kind, (mesh, axes) in meshes.items()}
        configs = {m: parse_method(m, minishards, pipelined) for m in methods}
        compiled, compile_s, nbytes, inputs = {}, {}, {}, {}
        for name, cfg in configs.items():
            mesh, axes = meshes[kinds[name]]
            reduce_over = axes[0] if len(axes) == 1 else axes
            f = jax.jit(jax.shard_map(
                lambda a, c=cfg, r=reduce_over, rot=folded[name]: all_reduce(a, r, c, rotated=rot),
                mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
            x = inputs[name] = (_folded_input(xs[kinds[name]], cfg) if folded[name]
                                else xs[kinds[name]])
            t0 = time.perf_counter()
            compiled[name] = f.lower(x).compile()
            compile_s[name] = time.perf_counter() - t0
            nbytes[name] = bytes_sent_per_device(compiled[name])
            compiled[name](x).block_until_ready()  # warm-up
        times = {name: [] for name in methods}
        barrier = process_barrier(meshes[next(iter(meshes))][0])
        for r in range(repeats):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for name in order:
                x = inputs[name]
                barrier()
                t0 = time.perf_counter()
                compiled[name](x).block_until_ready()
                barrier()
                times[name].append(time.perf_counter() - t0)
        errors = _mse(meshes, xs, kinds, compiled, folded, configs) if mse else {}
        ideal = ideal_ring_bytes(n_el, 2, n)
        for name in methods:
            row = {
                "size_bytes": size, "method": name, "label": configs[name].label,
                "mesh": kinds[name], "devices": n, "times_s": times[name], **_stats(times[name]),
                "bytes_per_device": nbytes[name], "bytes_vs_ideal_bf16_ring": nbytes[name] / ideal,
                "compile_s": compile_s[name], "mse": errors.get(name),
                # median over repeats of (the other method's time / this one's), same repeat
                "speedup_vs": {ref: statistics.median(a / b for a, b in zip(times[ref],
                                                                            times[name]))
                               for ref in methods},
            }
            for ref in ("bf16", "bf16_ring"):
                if ref in times:
                    row[f"speedup_vs_{ref}"] = row["speedup_vs"][ref]
            rows.append(row)
        del xs, inputs
    return rows


def _folded_input(x: jax.Array, cfg: AllReduceConfig) -> jax.Array:
    """x's rows rotated in runs of the codec's groups, rounded to x's dtype: the partials a
    model with the rotation folded into its weights hands to `all_reduce(rotated=True)`."""
    g = cfg.group_size
    return jax.jit(lambda v: groups.rotate(v, g).astype(v.dtype), out_shardings=x.sharding)(x)


def process_barrier(mesh: Mesh):
    """With several processes: a function that returns once every process has called it (a
    one-value psum over the mesh). A process's program returns when its own output is complete,
    while its peers may still be receiving their last pieces, and without a barrier that tail
    would be timed as part of whichever method runs next. Timing from a barrier to a barrier
    charges each AllReduce with all of its traffic (plus one tiny collective, the same for every
    method). One process: a no-op (its collectives are memory copies inside the program)."""
    if jax.process_count() == 1:
        return lambda: None
    axes = mesh.axis_names
    local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    token = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P(axes)), np.zeros(local, np.float32), (mesh.size,))
    sync = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, axes), mesh=mesh, in_specs=P(axes),
                                 out_specs=P(axes))).lower(token).compile()
    return lambda: sync(token).block_until_ready()


def _mse(meshes: dict, xs: dict, kinds: dict, compiled: dict, folded: dict,
         configs: dict) -> dict:
    """MSE of each timed program's output against the float32 sum of the same bf16 inputs (a
    ':folded' method's program gets them rotated, in bf16, as from folded weights).

    The outputs come from the very programs that were timed, materialised in bf16. (Fusing the
    error into the same jit would let XLA drop the final bf16 rounding: on CPU it folds
    f32 -> bf16 -> f32 conversion pairs, which makes the bf16 psum look exact.)"""
    out = {}
    for kind, (mesh, axes) in meshes.items():
        x = xs[kind]
        exact = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a.astype(jnp.float32), axes),
                                      mesh=mesh, in_specs=P(axes), out_specs=P(axes)))(x)
        err = jax.jit(jax.shard_map(
            lambda y, e: jax.lax.pmean(jnp.mean((y.astype(jnp.float32) - e) ** 2), axes),
            mesh=mesh, in_specs=(P(axes), P(axes)), out_specs=P()))
        for name, program in compiled.items():
            if kinds[name] != kind:
                continue
            y = program(_folded_input(x, configs[name]) if folded[name] else x)
            out[name] = float(err(y, exact))
            del y
    return out


def worker(params: dict) -> dict:
    """Entry point of each process in --processes mode (see eval.multiproc)."""
    rows = bench_on_mesh(**params)
    return {"process": jax.process_index(), "rows": rows}


def wire_s(row: dict, link_gbit: float) -> float:
    """Lower bound on a shaped loopback: every device's bytes through the one shared token
    bucket at the link rate, nothing else."""
    return row["bytes_per_device"] * row["devices"] * 8 / (link_gbit * 1e9)


def alpha_beta_s(unshaped_row: dict, link_gbit: float) -> float:
    """Additive alpha-beta prediction on a shaped loopback: the same run on the unshaped
    loopback (per-message latency, quantization and other host compute, process skew, the
    kernel's own copies) plus the wire time. An upper bound where host work and transfers
    overlap (other processes keep the link busy while one computes); the unshaped run's own
    transfer time is counted twice, a few percent at most."""
    return unshaped_row["median"] + wire_s(unshaped_row, link_gbit)


def add_predictions(rows: list[dict], unshaped_rows: list[dict] | None, link_gbit: float) -> None:
    """Adds wire_s to every row, and model_s where the unshaped run has the same row."""
    base = {(r["size_bytes"], r["method"]): r for r in unshaped_rows or []}
    for r in rows:
        r["wire_s"] = wire_s(r, link_gbit)
        ref = base.get((r["size_bytes"], r["method"]))
        if ref is not None and ref["devices"] == r["devices"]:
            r["model_s"] = alpha_beta_s(ref, link_gbit)


def format_table(rows: list[dict]) -> str:
    extra = [k for k in ("wire_s", "model_s") if any(k in r for r in rows)]
    names = {"wire_s": "wire ms", "model_s": "model ms"}
    w = max([10] + [len(r["method"]) for r in rows])
    head = (f"{'size':>8}  {'method':<{w}} {'median ms':>10} {'[min, max] ms':>18} "
            f"{'x bf16':>7} {'x ring':>7} {'bytes/dev':>11} {'/ideal':>7} {'MSE':>9}"
            + "".join(f" {names[k]:>9}" for k in extra))
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and r["size_bytes"] != last:
            lines.append("")
        last = r["size_bytes"]
        spread = f"[{r['min'] * 1e3:.2f}, {r['max'] * 1e3:.2f}]"
        mse = "-" if r.get("mse") is None else f"{r['mse']:.2e}"
        lines.append(
            f"{format_size(r['size_bytes']):>8}  {r['method']:<{w}} {r['median'] * 1e3:>10.2f} "
            f"{spread:>18} {r.get('speedup_vs_bf16', float('nan')):>7.2f} "
            f"{r.get('speedup_vs_bf16_ring', float('nan')):>7.2f} "
            f"{r['bytes_per_device']:>11.0f} {r['bytes_vs_ideal_bf16_ring']:>7.3f} {mse:>9}"
            + "".join(f" {r[k] * 1e3:>9.2f}" if k in r else f" {'-':>9}" for k in extra))
    return "\n".join(lines)


def format_ratios(rows: list[dict]) -> str:
    """Per size, the matrix of median per-repeat ratios: row method's speed-up over column's."""
    out = []
    for size in dict.fromkeys(r["size_bytes"] for r in rows):
        cell = [r for r in rows if r["size_bytes"] == size and "speedup_vs" in r]
        if not cell:
            continue
        names = [r["method"] for r in cell]
        w = max(len(m) for m in names)
        out.append(f"{format_size(size)}: speed-up of the row over the column (median of "
                   f"per-repeat ratios)")
        out.append(" " * (w + 2) + " ".join(f"{m[:14]:>14}" for m in names))
        for r in cell:
            out.append(f"{r['method']:<{w}}  " + " ".join(
                f"{r['speedup_vs'].get(m, float('nan')):>14.2f}" for m in names))
        out.append("")
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="bf16 message bytes per device")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list: bf16, f32, bf16_ring[-semi], int8-{full,semi}[-rs|-ag]")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--row", type=int, default=DEFAULT_ROW,
                   help="values per message row (d_model): messages are [tokens, row]")
    p.add_argument("--minishards", type=int, default=4, help="scale blocks per shard (upper bound)")
    p.add_argument("--one-message-per-hop", action="store_true",
                   help="pipelined=False: a ring direction's minishards share one ppermute")
    p.add_argument("--devices", type=int, default=8, help="virtual devices (one-process mode)")
    p.add_argument("--processes", type=int, default=0, help="one process per device if > 0")
    p.add_argument("--link-gbit", type=float, default=None,
                   help="shape the loopback, or with --torus every link (root)")
    p.add_argument("--torus", default=None, metavar="DIMS",
                   help="e.g. 2x2 or 4: run one process per node of an emulated torus "
                        "(eval.torus: a namespace per process, a veth per neighbour, each "
                        "shaped to --link-gbit); sets --processes and --mesh")
    p.add_argument("--burst", default="256kb",
                   help="the shaped links' token bucket (tc tbf burst): that much leaves an idle "
                        "link at once; keep it well under a hop's message for the cost model's "
                        "link term to hold")
    p.add_argument("--unshaped", action="store_true",
                   help="with --torus: leave the veths unshaped (the base term of "
                        "eval.cost_model --emulated: compute and per-message costs on the "
                        "torus itself, without the link rate)")
    p.add_argument("--mesh", default=None, metavar="DIMS",
                   help="mesh shape for ':torus' and ':snake' methods (default: --torus)")
    p.add_argument("--no-mse", action="store_true", help="skip the MSE column")
    p.add_argument("--plain-malloc", action="store_true",
                   help="leave glibc malloc as it starts (default: keep freed blocks, and huge "
                        "pages for worker processes; see jax_platform)")
    p.add_argument("--out", default=None, help="write the rows and settings as JSON")
    p.add_argument("--predict-from", default=None, metavar="UNSHAPED.json",
                   help="add the alpha-beta prediction from an unshaped run with as many "
                        "processes (model ms column)")
    p.add_argument("--show", default=None, metavar="RUN.json",
                   help="print a saved run's table (with --predict-from: and its model) instead "
                        "of measuring")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = _parser()
    args = p.parse_args(argv)
    torus = None
    if args.torus:
        from eval.torus import parse_dims

        torus = parse_dims(args.torus)
        args.processes = int(np.prod(torus))
        if (args.link_gbit is None) == (not args.unshaped):
            p.error("--torus needs either --link-gbit (the rate of every link) or --unshaped")
    elif args.unshaped:
        p.error("--unshaped needs --torus")
    mesh_dims = parse_dims_arg(args.mesh) if args.mesh else torus
    if args.show:
        return _show(args.show, args.predict_from)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:  # fail early on a typo
        try:
            cfg = parse_method(m, args.minishards)
        except ValueError as e:
            p.error(str(e))
        if method_options(m)[2] and not folds_rotation(cfg, args.row):
            p.error(f"{m}: ':folded' needs a codec that rotates groups tiling the rows of "
                    f"{args.row} values (e.g. int8, int8-full, int4)")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.link_gbit is not None and args.processes < 1:
        p.error("--link-gbit needs --processes (a shaped link only matters between processes)")
    if args.predict_from and args.link_gbit is None:
        p.error("--predict-from needs --link-gbit")
    params = dict(sizes=sizes, methods=methods, repeats=args.repeats, minishards=args.minishards, row_width=args.row,
                  pipelined=not args.one_message_per_hop, mse=not args.no_mse,
                  mesh_dims=mesh_dims)
    if args.processes > 0:
        rows, mode = _run_processes(args, params, torus)
    else:
        if not args.plain_malloc:
            keep_freed_memory()
        jax.config.update("jax_platforms", "cpu")
        ensure_cpu_devices(args.devices, exact=True)
        rows = bench_on_mesh(**params)
        mode = f"1 process, {rows[0]['devices']} virtual CPU devices"
    if args.link_gbit and not torus:
        unshaped = None
        if args.predict_from:
            with open(args.predict_from) as f:
                unshaped = json.load(f)["rows"]
        add_predictions(rows, unshaped, args.link_gbit)
    report = {
        "mode": mode, "processes": args.processes, "link_gbit": args.link_gbit,
        "burst": args.burst if args.link_gbit else None, "torus": list(torus) if torus else None,
        "settings": params, "malloc": malloc_label(args.plain_malloc, args.processes > 0),
        "jax": jax.__version__, "cpus": os.cpu_count(),
        "machine": platform.machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows,
    }
    print(f"# {mode}; minishards={args.minishards}; pipelined={params['pipelined']}; "
          f"repeats={args.repeats}; malloc: {report['malloc']}")
    print(format_table(rows))
    print()
    print(format_ratios(rows))
    write_json(args.out, report)
    return report


def _show(path: str, predict_from: str | None) -> dict:
    """Mode --show: a saved run's table (and, for a shaped loopback, its model column)."""
    with open(path) as f:
        report = json.load(f)
    link = report.get("link_gbit")
    if link and not report.get("torus"):
        unshaped = None
        if predict_from:
            with open(predict_from) as f:
                unshaped = json.load(f)["rows"]
        add_predictions(report["rows"], unshaped, link)
    print(f"# {report['mode']}; {report['settings']}")
    print(format_table(report["rows"]))
    print()
    print(format_ratios(report["rows"]))
    return report


def _run_processes(args, params: dict, torus) -> tuple[list[dict], str]:
    """Mode --processes / --torus: one worker per device; rows of process 0 with every
    process's median beside them, and the mode line."""
    from eval import multiproc

    results = multiproc.run("eval.bench_collective:worker", args.processes, args=(params,),
                            link_gbit=args.link_gbit, malloc_tunables=not args.plain_malloc,
                            torus=torus, burst=args.burst)
    rows = results[0]["rows"]
    if torus:
        rate = ("unshaped" if args.unshaped else
                f"each direction shaped to {args.link_gbit} Gbit/s, burst {args.burst}")
        mode = (f"{args.processes} processes on an emulated {args.torus} torus (gloo, a "
                f"veth per neighbour, {rate})")
    else:
        mode = f"{args.processes} processes (gloo, 127.0.0.1"
        mode += (f", loopback shaped to {args.link_gbit} Gbit/s, burst {args.burst})"
                 if args.link_gbit else ")")
    for row, *others in zip(rows, *(r["rows"] for r in results[1:])):
        row["median_by_process"] = [row["median"]] + [o["median"] for o in others]
    return rows, mode


if __name__ == "__main__":
    main()
