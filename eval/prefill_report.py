"""Printing and plotting eval.bench_prefill reports."""
from __future__ import annotations

import textwrap


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


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


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
    links = any("link_gbit" in r for r in rows)
    head = (f"{'length':>6} {'steps':>5} {'tp':>3} " + (f"{'Gbit/s':>6} " if links else "")
            + f"{'method':<14} {'median ms':>10} {'p90 ms':>9} "
            f"{'x bf16':>7} {'predicted':>9} {'x ring':>7} {'wire MB':>8}"
            + (f" {'comm %':>6}" if any("comm_share" in r for r in rows) else ""))
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        group = (r["length"], r.get("link_gbit"))
        if last is not None and group != last:
            lines.append("")
        last = group
        link = f"{r['link_gbit']:>6g} " if links else ""
        lines.append(f"{r['length']:>6} {r['steps']:>5} {r['tp']:>3} {link}{r['method']:<14} "
                     f"{r['median_ms']:>10.1f} "
                     f"{r['p90_ms']:>9.1f} {_x(r.get('speedup_vs_bf16')):>7} "
                     f"{_x(r.get('predicted_speedup_vs_bf16')):>9} "
                     f"{_x(r.get('speedup_vs_bf16_ring')):>7} {r['wire_bytes'] / 1e6:>8.2f}"
                     + (f" {100 * r['comm_share']:>6.0f}" if "comm_share" in r else ""))
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Speedup against bf16 per method over prompt length; predictions dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    methods = []
    for r in report["rows"]:
        if r["method"] not in methods and r["method"] != "bf16":
            methods.append(r["method"])
    target = report["settings"].get("link_gbit")
    for i, m in enumerate(methods):
        rows = [r for r in report["rows"] if r["method"] == m and r.get("speedup_vs_bf16")
                and r.get("link_gbit", target) == target]
        if not rows:
            continue
        color = f"C{i}"
        ax.plot([r["length"] for r in rows], [r["speedup_vs_bf16"] for r in rows], "o-",
                color=color, label=f"{m} measured")
        pred = [r for r in rows if r.get("predicted_speedup_vs_bf16")]
        if pred:
            ax.plot([r["length"] for r in pred], [r["predicted_speedup_vs_bf16"] for r in pred],
                    "x--", color=color, label=f"{m} predicted")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("prefill speedup vs bf16 AllReduce")
    cfg = report["config"]
    mode = textwrap.fill(report["mode"], 90)
    ax.set_title(f"{cfg['name']}, {cfg['num_layers']} layers, tp={report['settings']['tp']}\n"
                 f"{mode}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
