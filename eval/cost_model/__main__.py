"""Cost model tables: `python -m eval.cost_model --tpu`, `--topologies`, `--emulated TORUS.json
BASE.json`."""
from __future__ import annotations

import math

from eval.cost_model.emulated import base_kind, emulated_link_terms, format_emulated, predict_emulated
from eval.cost_model.topology import format_topology_predictions, topology_predictions


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(description="cost model tables")
    p.add_argument("--tpu", action="store_true",
                   help="predicted Gemma 3 prefill speedups on TPU v5e next to the paper's "
                        "(what eval.bench_prefill prints after a run)")
    p.add_argument("--topologies", action="store_true",
                   help="predicted AllReduce and prefill times per TPU topology and method")
    p.add_argument("--tokens", default="2048,4096,8192")
    p.add_argument("--emulated", nargs=2, metavar=("TORUS.json", "BASE.json"),
                   help="predict an eval.bench_collective --torus run from a base run of the "
                        "same methods and sizes: the unshaped torus (--torus DIMS --unshaped) "
                        "or one process (--devices N --mesh DIMS), and compare")
    p.add_argument("--alpha-us", type=float, default=0.0,
                   help="per collective-permute latency for --emulated")
    args = p.parse_args(argv)
    if not (args.tpu or args.topologies or args.emulated):
        p.error("choose at least one of --tpu, --topologies, --emulated")
    if args.tpu:
        from eval.cost_model.tpu import format_tpu_predictions, tpu_predictions
        print(format_tpu_predictions(tpu_predictions()))
    if args.topologies:
        tokens = [int(t) for t in args.tokens.split(",")]
        print(format_topology_predictions(topology_predictions(tokens)))
    if args.emulated:
        from jax_platform import ensure_cpu_devices

        with open(args.emulated[0]) as f:
            run = json.load(f)
        with open(args.emulated[1]) as f:
            base = json.load(f)
        try:
            kind = base_kind(base, run)
        except ValueError as e:
            p.error(str(e))
        dims = tuple(run["torus"])
        ensure_cpu_devices(math.prod(dims), exact=True)
        s = run["settings"]
        terms = emulated_link_terms([m for m in s["methods"] if not m.startswith("bf16:")],
                                    s["sizes"], dims, s["minishards"], s["pipelined"],
                                    s.get("row_width", 4096))
        print(f"# {run['mode']}; measured {run['time']}; base: {kind}, {base['time']}")
        print(format_emulated(predict_emulated(run, base, terms, args.alpha_us * 1e-6),
                              "base"))


if __name__ == "__main__":
    main()
