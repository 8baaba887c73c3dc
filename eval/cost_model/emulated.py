"""Calibration against the emulated torus (eval.torus, eval.bench_collective --torus): the link
terms of the compiled programs' transfers added to a base run."""
from __future__ import annotations

from typing import Sequence

from eval.cost_model.link import gbit_to_bytes_s
from eval.cost_model.topology import Topology, Transfer, step_link_s


def program_transfers(program, partition_to_node: Sequence[int]) -> list[list[Transfer]]:
    """The compiled program's collective-permutes, each as one step of (source chip,
    destination chip, bytes) transfers; partition p of the program runs on chip
    partition_to_node[p]. Other collectives (XLA's psum) are not included."""
    from equarx import collectives

    return [[(partition_to_node[a], partition_to_node[b], op.buffer_bytes) for a, b in op.pairs]
            for op in collectives(program) if op.kind == "collective-permute" and op.pairs]


def emulated_link_terms(methods: Sequence[str], sizes: Sequence[int], dims: tuple[int, ...],
                        minishards: int = 4, pipelined: bool = False,
                        row_width: int = 4096) -> dict:
    """For each (size, method) of an eval.bench_collective --torus run: the collective-permute
    steps of the very program it runs (compiled here on len(dims) virtual devices, device i
    = torus node i), as {"steps": n, "link_bytes": [busiest directed link's bytes per step]}.
    Needs jax with prod(dims) CPU devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eval.bench_collective import _meshes, allreduce_program, parse_method, split_method

    topo = Topology("emulated", tuple(dims), wrap=True, link_bytes_s=1.0)
    kinds = {m: split_method(m)[1] for m in methods}
    meshes = _meshes(list(dict.fromkeys(kinds.values())), tuple(dims))
    out = {}
    for size in sizes:
        n_el = size // 2
        width = row_width if n_el % row_width == 0 else n_el
        for m in methods:
            mesh, axes = meshes[kinds[m]]
            x = jax.ShapeDtypeStruct((jax.device_count() * (n_el // width), width),
                                     jnp.bfloat16, sharding=NamedSharding(mesh, P(axes)))
            program = allreduce_program(mesh, axes, parse_method(m, minishards, pipelined)
                                        ).lower(x).compile()
            nodes = [d.id for d in mesh.devices.flat]
            steps = program_transfers(program, nodes)
            out[(size, m)] = {"steps": len(steps),
                              "link_bytes": [step_link_s(topo, s) for s in steps]}
    return out


def predict_emulated(run: dict, base: dict, terms: dict, alpha_s: float = 0.0,
                     efficiency: float = 1.0) -> list[dict]:
    """Predicted seconds of each row of an eval.bench_collective --torus run: the same method and
    size's median in `base` (one process: codec compute only; the unshaped torus: compute,
    per-message costs and process skew, its own transfer time counted twice, a few percent)
    plus, for every collective-permute in turn (XLA:CPU runs them one at a time), alpha and its
    busiest link's bytes at the link rate. XLA's psum rows get none (gloo's own algorithm)."""
    rate = gbit_to_bytes_s(run["link_gbit"]) * efficiency
    one = {(r["size_bytes"], r["method"]): r["median"] for r in base["rows"]}
    out = []
    for r in run["rows"]:
        key = (r["size_bytes"], r["method"])
        t = terms.get(key)
        row = {"size_bytes": r["size_bytes"], "method": r["method"], "measured_s": r["median"],
               "compute_s": one.get(key)}
        if t is not None and t["steps"] and key in one:
            link = sum(t["link_bytes"]) / rate
            row.update(link_s=link, alpha_total_s=alpha_s * t["steps"], steps=t["steps"],
                       predicted_s=one[key] + link + alpha_s * t["steps"])
            row["error"] = row["predicted_s"] / r["median"] - 1
        out.append(row)
    return out


def base_kind(base: dict, run: dict) -> str:
    """What an --emulated base run measured (see predict_emulated), or a ValueError when it
    cannot serve as the base of `run`."""
    if base.get("torus"):
        if list(base["torus"]) != list(run["torus"]) or base.get("link_gbit") is not None:
            raise ValueError("a torus base run must be the same torus with --unshaped veths")
        return "unshaped torus"
    if base.get("processes", 0) > 0:
        raise ValueError("the base run must be one process (--devices N --mesh DIMS) or the "
                         "unshaped torus (--torus DIMS --unshaped)")
    return "one process"


def format_emulated(rows: list[dict], base: str = "compute") -> str:
    head = (f"{'size':>9} {'method':<16} {'measured ms':>11} {base + ' ms':>10} "
            f"{'link ms':>8} {'steps':>5} {'predicted':>9} {'error':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "predicted_s" not in r:
            lines.append(f"{r['size_bytes'] >> 20:>5} MiB {r['method']:<16} "
                         f"{1e3 * r['measured_s']:>11.1f}   (not modelled: XLA psum on gloo)")
            continue
        lines.append(f"{r['size_bytes'] >> 20:>5} MiB {r['method']:<16} "
                     f"{1e3 * r['measured_s']:>11.1f} {1e3 * r['compute_s']:>10.1f} "
                     f"{1e3 * r['link_s']:>8.1f} {r['steps']:>5} "
                     f"{1e3 * r['predicted_s']:>9.1f} {100 * r['error']:>6.0f}%")
    return "\n".join(lines)
