"""Prefill latency of Gemma 3 with each AllReduce method side by side: a lone prompt through the
server's prompt path (a `PagedRunner` and the `PagedScheduler`'s ragged steps) to its first
token, in one process or one per device on shaped links, with the cost model's predictions.
Modes and example commands: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import time

import numpy as np

from equarx import AllReduceConfig

from eval import common, cost_model
from eval.quality import UNFOLDED, mode_config
from eval.reports import format_columns, write_json
import jax_platform
from jax_platform import keep_freed_memory, malloc_label

GROUP_FLAGS = ("coordinator_address", "num_processes", "process_id", "distributed", "heartbeat_timeout")

_seq_ids = itertools.count()


def model_source(model: str, layers: int | None) -> tuple[str, int | None]:
    """('random:1b?layers=4', 26) from ('1b' or 'random:1b', 4): the load_model source and the
    full model's layer count (None when all layers are used)."""
    from models.gemma3 import get_config

    if model in ("gemma3-270m",) or model.endswith(".gguf"):
        if layers is not None:
            raise ValueError("--layers only applies to random-weight models")
        return model, None
    spec = model.removeprefix("random:")
    full = get_config(spec).num_layers
    if layers is not None:
        if not 1 <= layers <= full:
            raise ValueError(f"--layers must be in [1, {full}] for {spec}, got {layers}")
        spec += ("&" if "?" in spec else "?") + f"layers={layers}"
    used = get_config(spec).num_layers
    return f"random:{spec}", (full if used != full else None)


# ---------------------------------------------------------------------------------------------
# Measurement (runs the same way in one process or in every process of a distributed run)


def set_link(gbit: float) -> None:
    """Shape this network namespace's loopback to `gbit` (the token bucket eval.multiproc uses),
    or with 0 remove the shaping. Run inside the namespace eval.multiproc made.

    An unshaped loopback, not a high tbf rate, is the fast base: with a 256 KiB burst a token
    bucket cannot exceed about burst x timer frequency (0.5-2 Gbit/s), whatever its rate."""
    if gbit == 0:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False,
                       stderr=subprocess.DEVNULL)
        return
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{gbit}gbit",
                    "burst", "256kb", "latency", "50ms"], check=True)


def _switch_link(gbit: float, tag: str) -> None:
    """Every process waits, process 0 changes the rate, every process waits again."""
    import jax
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(f"before {tag}")
    if jax.process_index() == 0:
        set_link(gbit)
    multihost_utils.sync_global_devices(f"after {tag}")


def prompt_steps(runner, sched, prompt: list[int], run: bool = True) -> list:
    """A lone `prompt` through `sched` (a PagedScheduler of `runner`'s info) and `runner`, step
    by step as the engine core runs it, up to the step that samples its first token (on the host
    when this returns); its pages are then freed. Returns each step's (tokens computed, StepShape).
    run=False plans the steps without running them."""
    from serving import IDLE, Sequence, step_inputs

    seq = Sequence(id=next(_seq_ids), prompt=list(prompt), params=IDLE, seed=0)
    sched.add([seq])
    steps = []
    while True:
        plan = sched.schedule()
        inputs = step_inputs(plan, sched.kv, runner.info)
        steps.append((plan.num_tokens, inputs.buckets))
        if run:
            runner.run_step(inputs)  # the last step's: its token on the host
        if any(p.sample for p in plan.pieces):
            break
    sched.finish(seq)
    return steps


def measure(source: str, tp: int, lengths: list[int], methods: list[str], iters: int,
            warmup: int = 1, minishards: int = 4, pipelined: bool = True,
            dtype: str = "bfloat16", seed: int = 0, links: list[float] | None = None,
            tp_mesh: str | None = None, device_order: list[int] | None = None,
            max_num_batched_tokens: int = 256, page_size: int = 16, log=print) -> dict:
    """Time every method at every length on the first `tp` devices; returns rows + facts.

    links: in a shaped namespace, link rates (Gbit/s) alternated within every iteration, so
    both rates' rows (`link_gbit`) share the same minutes of a shared machine. tp_mesh: the
    model's TP mesh ("2x2"); device_order: the devices in mesh order (eval.torus.snake_order).
    """
    import jax

    from eval.bench_collective import process_barrier
    from equarx import bytes_sent_per_device
    from models.gemma3 import load_model
    from serving import PagedRunner, PagedScheduler, ServerConfig

    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1, warmup >= 0; got {iters}, {warmup}")
    configs = {m: AllReduceConfig.from_label(m.removesuffix(UNFOLDED), minishards=minishards,
                                             pipelined=pipelined) for m in methods}
    link_list = list(links) if links else [None]
    server = ServerConfig()
    max_seq_len = max(server.max_seq_len, max(lengths) + 1)
    t0 = time.perf_counter()
    devices = ([jax.devices()[i] for i in device_order] if device_order
               else jax.devices()[:tp])
    base = load_model(source, tp=tp, tp_mesh=tp_mesh, allreduce=configs[methods[0]],
                      dtype=dtype, max_seq_len=max_seq_len, devices=devices, seed=seed,
                      fold_rotation=False)
    load_s = time.perf_counter() - t0
    # Each method runs as load_model serves it (its rotation folded into the weights where it
    # has one); "int8:unfolded" runs the same codec rotating at run time. No prefix cache: every
    # prompt is computed whole.
    runners = {m: PagedRunner(base.with_allreduce(configs[m], fold_rotation=not m.endswith(UNFOLDED)),
                              max_num_seqs=server.max_num_seqs, max_seq_len=max_seq_len,
                              page_size=page_size, max_num_batched_tokens=max_num_batched_tokens,
                              prefix_caching=False, model_name="bench") for m in methods}
    scheds = {m: PagedScheduler(r.info) for m, r in runners.items()}
    barrier = process_barrier(base.mesh)  # see there: each prefill's traffic is its own
    rng = np.random.default_rng(seed)
    rows = []
    for length in lengths:
        prompt = rng.integers(4, base.config.vocab_size, length).tolist()
        steps = prompt_steps(runners[methods[0]], scheds[methods[0]], prompt, run=False)
        wire, compile_s = {}, {}
        for m, r in runners.items():
            keys = [r.model.ragged_key(b, r.pages) for _, b in steps]
            t0 = time.perf_counter()
            r.model.compile_ragged(keys)
            compile_s[m] = time.perf_counter() - t0
            wire[m] = sum(bytes_sent_per_device(r.model.programs.runnable(k)) for k in keys)
            for _ in range(warmup):
                prompt_steps(r, scheds[m], prompt)
        times = {(lk, m): [] for lk in link_list for m in methods}
        for i in range(iters):
            for lk in link_list:
                if lk is not None and len(link_list) > 1:
                    _switch_link(lk, f"{length}/{i}/{lk}")
                for m in methods[i % len(methods):] + methods[:i % len(methods)]:
                    barrier()
                    t0 = time.perf_counter()
                    prompt_steps(runners[m], scheds[m], prompt)
                    barrier()
                    times[lk, m].append(time.perf_counter() - t0)
        for lk in link_list:
            log(f"  length {length}" + (f" at {lk} Gbit/s" if lk else "") + ": " + ", ".join(
                f"{m} {1e3 * statistics.median(times[lk, m]):.1f} ms" for m in methods))
            for m in methods:
                t = times[lk, m]
                row = {"length": length, "tp": tp, "method": m, "label": configs[m].label,
                       "steps": len(steps), "pieces": [n for n, _ in steps],
                       "step_tokens": [b.tokens for _, b in steps],
                       "median_ms": 1e3 * statistics.median(t), "p90_ms": 1e3 * float(np.percentile(t, 90)),
                       "times_ms": [1e3 * v for v in t], "wire_bytes": wire[m],
                       "compile_s": compile_s[m]}
                if lk is not None:
                    row["link_gbit"] = lk
                for ref in ("bf16", "bf16_ring"):
                    row[f"speedup_vs_{ref}"] = (statistics.median(
                        a / b for a, b in zip(times[lk, ref], t)) if ref in methods else None)
                rows.append(row)
    c, info = base.config, runners[methods[0]].info
    return {"config": {k: getattr(c, k) for k in ("name", "num_layers", "d_model", "ffn_hidden",
                       "num_heads", "num_kv_heads", "head_dim", "vocab_size")},
            "engine": {"max_num_batched_tokens": info.max_num_batched_tokens,
                       "page_size": info.page_size, "max_num_seqs": info.max_num_seqs,
                       "max_seq_len": info.max_seq_len},
            "load_s": load_s, "rows": rows}


def worker(params: dict) -> dict:
    """Entry point of each process in --processes mode (see eval.multiproc)."""
    import jax

    result = measure(**params, log=lambda *_: None)
    result["process"] = jax.process_index()
    return result


def calibrate(n: int, gbits: list[float], message_elements: list[int], methods: list[str],
              minishards: int, repeats: int, pipelined: bool = True, log=print,
              malloc_tunables: bool = True) -> dict:
    """Measure eval.bench_collective's AllReduce at each rate (N processes) and in one process;
    the difference is communication. Returns the samples and the alpha-beta fit."""
    from eval import bench_collective, multiproc

    # Not the naive strawman; an unfolded variant sends what its folded one does.
    methods = [m for m in methods if not m.endswith(UNFOLDED) and mode_config(m) is not None]
    params = dict(sizes=[2 * e for e in message_elements], methods=methods, repeats=repeats,
                  minishards=minishards, pipelined=pipelined, mse=False)
    one = {(r["size_bytes"], r["method"]): r["median"]
           for r in bench_collective.bench_on_mesh(**params)}
    samples = []
    for gbit in gbits:
        log(f"  calibrating at {gbit} Gbit/s ...")
        rows = multiproc.run("eval.bench_collective:worker", n, args=(params,), link_gbit=gbit,
                             malloc_tunables=malloc_tunables)[0]["rows"]
        for r in rows:
            samples.append(cost_model.CommSample(
                label=r["method"], n_elements=r["size_bytes"] // 2, n_devices=n, link_gbit=gbit,
                comm_s=r["median"] - one[(r["size_bytes"], r["method"])], minishards=minishards,
                pipelined=pipelined))
    return {"samples": [s.__dict__ for s in samples], "one_process_s": {
        f"{size}:{m}": t for (size, m), t in one.items()}}


def header(report: dict) -> str:
    cfg = report["config"]
    layers = (f"layers: {cfg['num_layers']} of {report['full_layers']}"
              if report.get("full_layers") else f"layers: {cfg['num_layers']} (all)")
    s, e = report["settings"], report["engine"]
    return (f"# {report['model']} ({cfg['name']}): d_model {cfg['d_model']}, {layers}; "
            f"{s['dtype']}; a lone prompt in the paged engine (steps of at most "
            f"{e['max_num_batched_tokens']} tokens, pages of {e['page_size']}) to its first "
            f"token; {s['iters']} interleaved iterations after {s['warmup']} warm-up"
            f"\n# {report['mode']}; {report['machine']}, "
            f"{report['cpus']} CPUs, jax {report['jax']}"
            + (f"; malloc: {s['malloc']}" if s.get("malloc") else ""))


def add_comm_share(rows: list[dict], base_gbit: float, link_gbit: float) -> list[dict]:
    """Paired runs: give every row at the target link its measured communication share, (its
    time minus the same method's time at the base link) / its time. This is the measured side
    of "communication is a third of prefill", next to the cost model's estimate."""
    base = {(r["length"], r["method"]): r["median_ms"]
            for r in rows if r.get("link_gbit") == base_gbit}
    out = []
    for r in rows:
        b = base.get((r["length"], r["method"]))
        if r.get("link_gbit") == link_gbit and b is not None and r["median_ms"] > 0:
            r = {**r, "comm_share": (r["median_ms"] - b) / r["median_ms"]}
        out.append(r)
    return out


def comm_share_line(rows: list[dict], method: str = "bf16") -> str | None:
    """'# measured: ...' for the method's row at the longest length, when it has a share."""
    have = [r for r in rows if r["method"] == method and "comm_share" in r]
    if not have:
        return None
    r = max(have, key=lambda r: r["length"])
    line = (f"# measured: {method} communication (time at {r['link_gbit']:g} Gbit/s minus time "
            f"on the base link) is {100 * r['comm_share']:.0f}% of its prefill at length "
            f"{r['length']}")
    share = r["comm_share"]
    if 0 < share < 1:
        # Communication time ~ 1 / rate; a third of the total is half the base-link time.
        third = r["link_gbit"] * (share / (1 - share)) / 0.5
        line += f"; a third would take about {third:.2g} Gbit/s"
    return line


def format_table(rows: list[dict]) -> str:
    x = lambda k: lambda r: "-" if r.get(k) is None else f"{r[k]:.2f}x"  # noqa: E731
    cols = [("length", ">6", lambda r: r["length"]), ("steps", ">5", lambda r: r["steps"]),
            ("tp", ">3", lambda r: r["tp"])]
    if any("link_gbit" in r for r in rows):
        cols.append(("Gbit/s", ">6", lambda r: f"{r['link_gbit']:g}"))
    cols += [("method", "<14", lambda r: r["method"]),
             ("median ms", ">10", lambda r: f"{r['median_ms']:.1f}"),
             ("p90 ms", ">9", lambda r: f"{r['p90_ms']:.1f}"), ("x bf16", ">7", x("speedup_vs_bf16")),
             ("predicted", ">9", x("predicted_speedup_vs_bf16")),
             ("x ring", ">7", x("speedup_vs_bf16_ring")),
             ("wire MB", ">8", lambda r: f"{r['wire_bytes'] / 1e6:.2f}")]
    if any("comm_share" in r for r in rows):
        cols.append(("comm %", ">6", lambda r: f"{100 * r['comm_share']:.0f}" if "comm_share" in r else ""))
    return format_columns(rows, cols)


def _one_process(params: dict) -> dict:
    jax_platform.ensure_cpu_devices(params["tp"])
    return measure(**params)


def _parser() -> argparse.ArgumentParser:
    # The shared parser's --repeats (5 here; --iters is its older name) and --out.
    p = common.parser(__doc__, engine=False, repeats=5)
    p.add_argument("--iters", dest="repeats", type=int, default=argparse.SUPPRESS, help="--repeats")
    p.add_argument("--model", default="random:1b", help="gemma3-270m, a .gguf, random:<size>")
    p.add_argument("--layers", type=int, default=None, help="use fewer layers (random weights)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--lengths", default="256,512,1024", help="comma list of prompt lengths")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="the step budget")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (the server's)")
    p.add_argument("--allreduce", default="bf16,bf16_ring,int8", help="comma list of labels")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--minishards", type=int, default=4)
    p.add_argument("--one-message-per-hop", action="store_true", help="pipelined=False")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--processes", type=int, default=0, help="one process per device if > 0")
    p.add_argument("--link-gbit", type=float, help="shape the loopback to this many Gbit/s (root)")
    p.add_argument("--torus", metavar="DIMS", help="e.g. 2x2: a process per node of an emulated "
                   "torus, links at --link-gbit (root); sets --processes; a 1-D mesh in snake order")
    p.add_argument("--tp-mesh", metavar="AxB", help="the model's TP mesh (AllReduces over every axis)")
    p.add_argument("--base-link-gbit", type=float, help="with --link-gbit X: alternate with this "
                   "rate (0: unshaped) and predict the X rows from these rows of the same run")
    p.add_argument("--calibrate-gbit", default=None, help="comma list of rates to fit the link at")
    p.add_argument("--calibration", default=None, help="reuse the calibration of a report JSON")
    p.add_argument("--calibration-repeats", type=int, default=5)
    p.add_argument("--no-tpu-prediction", action="store_true")
    p.add_argument("--plain-malloc", action="store_true", help="leave glibc malloc as it starts "
                   "(default: jax_platform's tunables for worker processes)")
    # One process of a multi-host group (e.g. each host of a TPU slice runs this command).
    jax_platform.add_group_arguments(p, only=GROUP_FLAGS)
    return p


def _checked_args(p: argparse.ArgumentParser, argv: list[str] | None):
    """Parsed arguments with the flag combinations checked: (args, methods, lengths, torus);
    --torus sets --processes."""
    args = p.parse_args(argv)
    methods = common.names(args.allreduce)
    for m in methods:  # fail early on a typo
        try:
            AllReduceConfig.from_label(m.removesuffix(UNFOLDED), minishards=args.minishards)
        except ValueError as e:
            p.error(str(e))
    lengths = sorted(set(common.ints(args.lengths)))
    torus = None
    if args.torus:
        from eval.torus import parse_dims

        torus = parse_dims(args.torus)
        args.processes = int(np.prod(torus))
        if args.link_gbit is None:
            p.error("--torus needs --link-gbit (the rate of every link)")
        if args.calibrate_gbit or args.calibration or args.base_link_gbit is not None:
            p.error("--torus measures only: the calibration and the paired base link model a "
                    "shared loopback")
    if args.link_gbit is not None and args.processes < 1:
        p.error("--link-gbit needs --processes (a shaped link only matters between processes)")
    if args.processes and args.processes != args.tp:
        p.error("--processes must equal --tp (one device per process)")
    if args.link_gbit is not None and args.link_gbit <= 0:
        p.error("--link-gbit must be positive")
    return args, methods, lengths, torus


def main(argv: list[str] | None = None) -> dict:
    p = _parser()
    args, methods, lengths, torus = _checked_args(p, argv)
    try:
        group = jax_platform.group_from(vars(args))
    except ValueError as e:
        p.error(str(e))
    if group.enabled and args.processes:
        p.error("--processes launches local workers; --coordinator-address/--distributed join a group")
    if group.enabled:
        jax_platform.join_process_group(group)  # before any jax computation
    source, full_layers = model_source(args.model, args.layers)
    params = dict(source=source, tp=args.tp, lengths=lengths, methods=methods,
                  iters=args.repeats, warmup=args.warmup, minishards=args.minishards,
                  pipelined=not args.one_message_per_hop, dtype=args.dtype,
                  max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size)
    if args.tp_mesh:
        params["tp_mesh"] = args.tp_mesh
    if torus and not args.tp_mesh:
        from eval.torus import snake_order

        params["device_order"] = snake_order(torus)
    if not args.plain_malloc:
        keep_freed_memory()
    report = {"settings": {**params, "processes": args.processes, "link_gbit": args.link_gbit,
                           "malloc": malloc_label(args.plain_malloc, args.processes > 0)},
              **common.environment()}
    baseline, fit = None, None
    if group.enabled:
        result, mode = _run_group(params)
        if mode is None:  # not process 0: it measured, process 0 reports
            return result
    elif args.processes > 0:
        baseline = _baseline_for(args, params, torus)
        fit = _calibrate_for_run(args, source, lengths, methods, report)
        result, mode = _run_processes(args, params, torus)
    else:
        result = _one_process(params)
        mode = f"1 process, {args.tp} virtual CPU devices"
    rows = result["rows"]
    cfg = result["config"]
    if fit is not None and args.link_gbit:
        rows = _predict(rows, baseline, fit, cfg, args)
    if args.processes > 0 and args.base_link_gbit is not None and args.link_gbit:
        rows = add_comm_share(rows, args.base_link_gbit, args.link_gbit)
    report.update(mode=mode, model=source, config=cfg, engine=result["engine"],
                  full_layers=full_layers, rows=rows)
    if not args.no_tpu_prediction:
        report["tpu_predictions"] = cost_model.tpu_predictions()
    _print_report(report)
    write_json(args.out, report)
    return report


def _run_group(params: dict) -> tuple[dict, str | None]:
    """Mode: one process of a jax.distributed group; every process measures, process 0 reports
    (the others get no mode)."""
    import jax

    result = worker(params)
    if jax.process_index() != 0:
        return result, None
    return result, f"{jax.process_count()} processes (jax.distributed, {jax.device_count()} devices)"


def _baseline_for(args, params: dict, torus) -> dict | None:
    """Mode --processes: the one-process run the link predictions start from (measured first
    when a shaped link is predicted rather than paired)."""
    jax_platform.ensure_cpu_devices(args.tp)  # the one-process runs use tp virtual devices
    paired = args.base_link_gbit is not None and args.link_gbit is not None
    if args.link_gbit is not None and not paired and not torus:
        print("# one-process run first (compute + quantization, no link) ...")
        return _one_process(params)
    return None


def _calibrate_for_run(args, source: str, lengths: list[int], methods: list[str],
                       report: dict) -> cost_model.Fit | None:
    """Mode --processes with --calibrate-gbit/--calibration: the link fit, recorded in the report."""
    if args.calibration:
        with open(args.calibration) as f:
            calibration = json.load(f)["cost_model"]["calibration"]
    elif args.calibrate_gbit:
        # The messages the prompt's AllReduces carry: a step's padded tokens x d_model.
        d_model, tokens = _message_shape(source, lengths, args.max_num_batched_tokens)
        calibration = calibrate(args.tp, [float(g) for g in args.calibrate_gbit.split(",")],
                                [t * d_model for t in tokens], methods,
                                args.minishards, args.calibration_repeats,
                                pipelined=not args.one_message_per_hop,
                                malloc_tunables=not args.plain_malloc)
    else:
        return None
    try:
        fit = cost_model.fit_link([cost_model.CommSample(**s) for s in calibration["samples"]])
    except ValueError as e:  # e.g. messages inside the token bucket's burst
        raise SystemExit(f"cannot fit the link model: {e}; calibration samples: "
                         f"{json.dumps(calibration['samples'])}")
    print(f"# cost model fit: {fit.describe()}")
    report["cost_model"] = {"fit": fit.__dict__, "describe": fit.describe(),
                            "calibration": calibration}
    return fit


def _run_processes(args, params: dict, torus) -> tuple[dict, str]:
    """Mode --processes (and --torus): one worker process per device, the loopback or each torus
    link shaped to --link-gbit; with --base-link-gbit the workers alternate two rates."""
    from eval import multiproc

    paired = args.base_link_gbit is not None and args.link_gbit is not None
    links = [args.base_link_gbit, args.link_gbit] if paired else None
    print(f"# {args.processes} processes ...")
    results = multiproc.run("eval.bench_prefill:worker", args.processes,
                            args=({**params, "links": links},), link_gbit=args.link_gbit,
                            malloc_tunables=not args.plain_malloc, torus=torus)
    result = results[0]
    for row, *others in zip(result["rows"], *(r["rows"] for r in results[1:])):
        row["median_ms_by_process"] = [row["median_ms"]] + [o["median_ms"] for o in others]
    mode = f"{args.processes} processes (gloo over TCP on 127.0.0.1"
    if torus:
        mode = (f"{args.processes} processes on an emulated {args.torus} torus (gloo, a veth "
                f"per neighbour, each direction shaped to {args.link_gbit} Gbit/s; model "
                f"mesh {args.tp_mesh or '1-D, snake order'})")
    elif paired:
        base = (f"{args.base_link_gbit} Gbit/s" if args.base_link_gbit
                else "the unshaped loopback (rows with Gbit/s 0)")
        mode += (f", loopback shaped to {args.link_gbit} Gbit/s, alternating every "
                 f"iteration with {base})")
    else:
        mode += f", loopback shaped to {args.link_gbit} Gbit/s)" if args.link_gbit else ")"
    return result, mode


def _print_report(report: dict) -> None:
    print(header(report))
    print(format_table(report["rows"]))
    share = comm_share_line(report["rows"])
    if share:
        print(share)
    if "cost_model" in report:
        print("# cost model fit: " + report["cost_model"]["describe"])
    if "tpu_predictions" in report:
        print(cost_model.format_tpu_predictions(report["tpu_predictions"]))


def _predict(rows: list[dict], baseline: dict | None, fit: cost_model.Fit, cfg: dict,
             args) -> list[dict]:
    """Predictions for the rows at the target link, from the fast-link rows of the same run
    (--base-link-gbit) or else from the one-process run."""
    if args.base_link_gbit is not None:
        base_rows = [r for r in rows if r.get("link_gbit") == args.base_link_gbit]
    else:
        base_rows = baseline["rows"]
    base_ms = {(r["length"], r["method"]): r["median_ms"] for r in base_rows}
    target = [r for r in rows if r.get("link_gbit", args.link_gbit) == args.link_gbit]
    predicted = cost_model.predict_rows(
        target, base_ms, fit, args.link_gbit, d_model=cfg["d_model"],
        num_layers=cfg["num_layers"], minishards=args.minishards,
        pipelined=not args.one_message_per_hop, base_gbit=args.base_link_gbit or None)
    by_id = {id(r): p for r, p in zip(target, predicted)}
    return [by_id.get(id(r), r) for r in rows]


def _message_shape(source: str, lengths: list[int], budget: int) -> tuple[int, list[int]]:
    """(d_model, the padded tokens of each length's longest step: the budget or the whole
    prompt, to a power of two) without loading the model."""
    from models.gemma3 import get_config
    from models.shapes import pow2

    if source.startswith("random:"):
        d_model = get_config(source.removeprefix("random:")).d_model
    else:
        from models.gemma3.gguf import default_gguf_path, read_gguf_config

        path = default_gguf_path() if source == "gemma3-270m" else source
        d_model = read_gguf_config(path)["d_model"]
    return d_model, sorted({pow2(min(n, budget)) for n in lengths})


if __name__ == "__main__":
    main()
