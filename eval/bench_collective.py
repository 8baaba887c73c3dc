"""equarx.all_reduce methods side by side: time, bytes each device sends, compiled size, MSE;
in one process over virtual CPU devices, one process per device on shaped links, or on an
emulated torus. What each column means and example commands: docs/benchmarks.md."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equarx import (AllReduceConfig, all_reduce, bytes_sent_per_device, folds_rotation, groups,
                    ideal_ring_bytes)
from equarx.accounting import program_size
from eval import common
from eval.common import parse_size
from eval.reports import format_columns, write_json
from eval.torus import parse_dims, snake_order
from jax_platform import ensure_cpu_devices, keep_freed_memory, malloc_label

MESH_KINDS = ("ring", "snake", "torus")


def format_size(nbytes: int) -> str:
    for unit, mult in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult} {unit}"
    return f"{nbytes} B"


def method_options(name: str) -> tuple[str, str, bool]:
    """'int8:torus:folded' -> (label, mesh kind, folded); the mesh kind 'ring' without one."""
    label, *opts = name.split(":")
    kinds = [o for o in opts if o in MESH_KINDS]
    if [o for o in opts if o not in MESH_KINDS and o != "folded"] or len(kinds) > 1 \
            or len(opts) > len(set(opts)):
        raise ValueError(f"mesh suffix must be one of {MESH_KINDS[1:]} (and/or ':folded'), got {name!r}")
    return label, (kinds[0] if kinds else "ring"), "folded" in opts


def split_method(name: str) -> tuple[str, str]:
    """'int8-full+tile:torus' -> ('int8-full+tile', 'torus')."""
    return method_options(name)[:2]


def parse_method(name: str, minishards: int, pipelined: bool = True) -> AllReduceConfig:
    return AllReduceConfig.from_label(split_method(name)[0], minishards=minishards,
                                      pipelined=pipelined)


def _meshes(kinds: list[str], dims: tuple[int, ...] | None) -> dict[str, tuple[Mesh, tuple]]:
    """Per mesh kind: a 1-D mesh "tp" in process order, one whose neighbours are torus
    neighbours (snake), or the torus of `dims` (axes x, y[, z], reduced over all)."""
    devices = np.array(jax.devices())
    out = {}
    for kind in kinds:
        if kind != "ring" and (dims is None or int(np.prod(dims)) != devices.size):
            raise ValueError(f"':{kind}' methods need --mesh (or --torus) dimensions whose "
                             f"product is the {devices.size} devices, got {dims}")
        if kind == "torus":
            axes = ("x", "y", "z")[:len(dims)]
            out[kind] = (Mesh(devices.reshape(dims), axes), axes)
        else:
            order = devices[snake_order(tuple(dims))] if kind == "snake" else devices
            out[kind] = (Mesh(order, ("tp",)), ("tp",))
    return out


def allreduce_program(mesh: Mesh, axes: tuple, cfg: AllReduceConfig, rotated: bool = False):
    """`cfg`'s all_reduce over every axis of `mesh`, jitted, on rows sharded over `axes`."""
    over = axes[0] if len(axes) == 1 else axes
    return jax.jit(jax.shard_map(lambda a: all_reduce(a, over, cfg, rotated=rotated), mesh=mesh,
                                 in_specs=P(axes), out_specs=P(axes)))


def _folded_input(x: jax.Array, cfg: AllReduceConfig) -> jax.Array:
    """x's rows rotated in runs of the codec's groups, in x's dtype (`rotated=True` input)."""
    return jax.jit(lambda v: groups.rotate(v, cfg.group_size).astype(v.dtype),
                   out_shardings=x.sharding)(x)


def process_barrier(mesh: Mesh):
    """With several processes, a function returning once every process called it (a one-value
    psum): a program returns when its own output is complete while its peers may still be
    receiving, so timing barrier to barrier charges each AllReduce all of its traffic. One
    process: a no-op."""
    if jax.process_count() == 1:
        return lambda: None
    axes = mesh.axis_names
    local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    token = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P(axes)), np.zeros(local, np.float32), (mesh.size,))
    sync = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, axes), mesh=mesh, in_specs=P(axes),
                                 out_specs=P(axes))).lower(token).compile()
    return lambda: sync(token).block_until_ready()


def _mse(mesh, axes, x, program, given) -> float:
    """The MSE of a timed program's bf16 output for `given` (x, or x rotated) against the
    float32 sum of x (apart from the program: fused into it, XLA could drop the final bf16
    rounding)."""
    exact = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a.astype(jnp.float32), axes),
                                  mesh=mesh, in_specs=P(axes), out_specs=P(axes)))(x)
    err = jax.jit(jax.shard_map(
        lambda y, e: jax.lax.pmean(jnp.mean((y.astype(jnp.float32) - e) ** 2), axes),
        mesh=mesh, in_specs=(P(axes), P(axes)), out_specs=P()))
    return float(err(program(given), exact))


def bench_on_mesh(sizes: list[int], methods: list[str], repeats: int, minishards: int,
                  pipelined: bool = True, mse: bool = True, seed: int = 0, row_width: int = 4096,
                  mesh_dims: tuple[int, ...] | None = None) -> list[dict]:
    """Every method at every size (bf16 message bytes a device) on all of jax.devices(); the
    same in one process or in every process of a distributed run. Messages are [tokens,
    row_width] (a model's activations), or one row where row_width does not divide them."""
    n = jax.device_count()
    opts = {m: method_options(m) for m in methods}
    meshes = _meshes(list(dict.fromkeys(o[1] for o in opts.values())), mesh_dims)
    configs = {m: parse_method(m, minishards, pipelined) for m in methods}
    barrier = process_barrier(next(iter(meshes.values()))[0])
    rows = []
    for size in sizes:
        n_el = size // 2
        width = row_width if n_el % row_width == 0 else n_el
        rng = np.random.default_rng(seed + 1000 * jax.process_index())
        local = rng.standard_normal((jax.local_device_count() * (n_el // width), width),
                                    dtype=np.float32).astype(jnp.bfloat16)
        xs = {kind: jax.make_array_from_process_local_data(
            NamedSharding(mesh, P(axes)), local, (n * (n_el // width), width))
            for kind, (mesh, axes) in meshes.items()}
        compiled, facts, inputs = {}, {}, {}
        for m, (_, kind, folded) in opts.items():
            mesh, axes = meshes[kind]
            inputs[m] = _folded_input(xs[kind], configs[m]) if folded else xs[kind]
            t0 = time.perf_counter()
            compiled[m] = allreduce_program(mesh, axes, configs[m], folded).lower(inputs[m]).compile()
            fusions, instructions = program_size(compiled[m])
            facts[m] = {"compile_s": time.perf_counter() - t0, "fusions": fusions,
                        "instructions": instructions,
                        "bytes_per_device": bytes_sent_per_device(compiled[m])}
            compiled[m](inputs[m]).block_until_ready()  # warm-up
        times = {m: [] for m in methods}
        for r in range(repeats):
            for m in methods[r % len(methods):] + methods[:r % len(methods)]:
                barrier()
                t0 = time.perf_counter()
                compiled[m](inputs[m]).block_until_ready()
                barrier()
                times[m].append(time.perf_counter() - t0)
        for m in methods:
            t = times[m]
            row = {"size_bytes": size, "method": m, "label": configs[m].label, "mesh": opts[m][1],
                   "devices": n, "times_s": t, "median": statistics.median(t), "min": min(t),
                   "max": max(t), **facts[m],
                   "bytes_vs_ideal_bf16_ring": facts[m]["bytes_per_device"] / ideal_ring_bytes(n_el, 2, n),
                   "mse": _mse(*meshes[opts[m][1]], xs[opts[m][1]], compiled[m], inputs[m])
                   if mse else None}
            for ref in ("bf16", "bf16_ring"):  # the median of the per-repeat ratios
                if ref in times:
                    row[f"speedup_vs_{ref}"] = statistics.median(a / b for a, b in zip(times[ref], t))
            rows.append(row)
    return rows


def worker(params: dict) -> dict:
    """Entry point of each process in --processes mode (see eval.multiproc)."""
    return {"process": jax.process_index(), "rows": bench_on_mesh(**params)}


def format_table(rows: list[dict]) -> str:
    num = lambda k, f: lambda r: "-" if r.get(k) is None else format(r[k], f)  # noqa: E731
    return format_columns(rows, [
        ("size", ">8", lambda r: format_size(r["size_bytes"])),
        ("method", f"<{max(10, *(len(r['method']) for r in rows))}", lambda r: r["method"]),
        ("median ms", ">10", lambda r: f"{r['median'] * 1e3:.2f}"),
        ("[min, max] ms", ">18", lambda r: f"[{r['min'] * 1e3:.2f}, {r['max'] * 1e3:.2f}]"),
        ("x bf16", ">7", num("speedup_vs_bf16", ".2f")),
        ("x ring", ">7", num("speedup_vs_bf16_ring", ".2f")),
        ("bytes/dev", ">11", num("bytes_per_device", ".0f")),
        ("/ideal", ">7", num("bytes_vs_ideal_bf16_ring", ".3f")),
        ("fusions", ">7", num("fusions", "d")), ("MSE", ">9", num("mse", ".2e"))])


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, engine=False, repeats=5)
    p.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M", help="bf16 message bytes a device")
    p.add_argument("--methods", default="bf16,bf16_ring,int8,int8-full+tile",
                   help="comma list of AllReduce labels, each with optional suffixes")
    p.add_argument("--row", type=int, default=4096, help="values a message row (d_model)")
    p.add_argument("--minishards", type=int, default=4, help="scale blocks per shard (upper bound)")
    p.add_argument("--one-message-per-hop", action="store_true",
                   help="pipelined=False: a ring direction's minishards share one ppermute")
    p.add_argument("--devices", type=int, default=8, help="virtual devices (one process)")
    p.add_argument("--processes", type=int, default=0, help="one process per device if > 0")
    p.add_argument("--link-gbit", type=float, help="shape the loopback, or with --torus every link")
    p.add_argument("--torus", metavar="DIMS", help="one process per node of an emulated torus, "
                   "e.g. 2x2 (sets --processes and --mesh)")
    p.add_argument("--unshaped", action="store_true", help="with --torus: links left unshaped")
    p.add_argument("--burst", default="256kb", help="the shaped links' token bucket (tc tbf)")
    p.add_argument("--mesh", metavar="DIMS", help="the mesh of ':torus' and ':snake' methods")
    p.add_argument("--no-mse", action="store_true", help="skip the MSE column")
    args = p.parse_args(argv)
    torus = parse_dims(args.torus) if args.torus else None
    if torus and (args.link_gbit is None) == (not args.unshaped):
        p.error("--torus needs either --link-gbit (the rate of every link) or --unshaped")
    if args.unshaped and not torus:
        p.error("--unshaped needs --torus")
    if args.link_gbit is not None and not (args.processes or torus):
        p.error("--link-gbit needs --processes (a shaped link only matters between processes)")
    methods = common.names(args.methods)
    for m in methods:  # fail early on a typo
        try:
            cfg = parse_method(m, args.minishards)
        except ValueError as e:
            p.error(str(e))
        if method_options(m)[2] and not folds_rotation(cfg, args.row):
            p.error(f"{m}: ':folded' needs a codec whose rotation tiles rows of {args.row}")
    params = dict(sizes=[parse_size(s) for s in args.sizes.split(",")], methods=methods,
                  repeats=args.repeats, minishards=args.minishards, row_width=args.row,
                  pipelined=not args.one_message_per_hop, mse=not args.no_mse,
                  mesh_dims=parse_dims(args.mesh) if args.mesh else torus)
    processes = int(np.prod(torus)) if torus else args.processes
    if processes:
        from eval import multiproc

        results = multiproc.run("eval.bench_collective:worker", processes, args=(params,),
                                link_gbit=args.link_gbit, torus=torus, burst=args.burst)
        rows = results[0]["rows"]
        for row, *others in zip(rows, *(r["rows"] for r in results[1:])):
            row["median_by_process"] = [row["median"]] + [o["median"] for o in others]
        link = "unshaped" if not args.link_gbit else f"{args.link_gbit} Gbit/s, burst {args.burst}"
        mode = (f"{processes} processes, " + (f"an emulated {args.torus} torus" if torus else
                                             "127.0.0.1") + f" ({link})")
    else:
        keep_freed_memory()
        jax.config.update("jax_platforms", "cpu")
        ensure_cpu_devices(args.devices, exact=True)
        rows = bench_on_mesh(**params)
        mode = f"1 process, {rows[0]['devices']} virtual CPU devices"
    report = {"mode": mode, "processes": processes, "link_gbit": args.link_gbit,
              "torus": list(torus) if torus else None, "settings": params,
              "malloc": malloc_label(False, processes > 0), **common.environment(), "rows": rows}
    print(f"# {mode}; minishards={args.minishards}; pipelined={params['pipelined']}; "
          f"repeats={args.repeats}; malloc: {report['malloc']}")
    print(format_table(rows))
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
