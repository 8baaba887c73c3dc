"""What the eval commands share: one argument parser (the server's flags under the server's
names) and one way to build the engine from them, a `PagedRunner` under an `EngineCore`, as
`gemma3-serve` builds it before it says ready. Imports no jax until an engine is built."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    """Progress on stderr (stdout carries the report)."""
    print(msg, file=sys.stderr, flush=True)


def ints(text: str) -> list[int]:
    """'2048,32768' -> [2048, 32768]."""
    return [int(v) for v in text.split(",") if v.strip()]


def names(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [v.strip() for v in text.split(",") if v.strip()]


def parser(doc: str, modes: dict[str, str] | None = None, *, only: str | None = None,
           engine: bool = True, lists: tuple[str, ...] = (), **defaults) -> argparse.ArgumentParser:
    """The shared flags: --only (a comma list of `modes`, each with its line in --help's epilog;
    default `only` or all), --repeats and --out; with `engine`, the server's flags the engine
    needs. `lists`: flags among --tp and --max-seq-len that take comma lists; `defaults`:
    defaults by destination name."""
    epilog = "modes (--only):\n" + "\n".join(f"  {k:<12}{v}" for k, v in modes.items()) \
        if modes else None
    p = argparse.ArgumentParser(description=doc, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)

    def add(flag, default, help_text="", **kw):
        dest = flag[2:].replace("-", "_")
        default = defaults.get(dest, default)
        if dest in lists:  # a string default: argparse applies the type to it
            kw["type"], default = ints, ",".join(map(str, default if isinstance(default, list)
                                                     else [default]))
        p.add_argument(flag, default=default, help=help_text, **kw)

    if modes:
        add("--only", only or ",".join(modes), "comma-separated modes (below)")
    add("--repeats", 3, "timed runs (medians)", type=int)
    add("--out", None, "write the report as JSON here")
    if not engine:
        return p
    add("--model", "gemma3-270m", "gemma3-270m, a checkpoint path, or random:<size>[?...]")
    add("--dtype", "bfloat16", choices=("bfloat16", "float32"))
    add("--quantization", "none", "weights: none, int8 or fp8", choices=("none", "int8", "fp8"))
    add("--quantization-group-size", 0, "a weight scale per G values (0: a channel)", type=int)
    add("--tp", 1, "tensor-parallel devices (on a CPU: virtual devices)", type=int)
    add("--tp-mesh", None, "the TP devices as a torus grid, e.g. 2x2")
    add("--allreduce", "bf16", "an AllReduce label: f32, bf16, bf16_ring, int8, int8-full+tile, ...")
    add("--kv-cache-dtype", "auto", "what the KV cache holds", choices=("auto", "int8", "fp8"))
    add("--max-seq-len", 2048, type=int)
    add("--max-num-seqs", 8, type=int)
    add("--page-size", 16, type=int)
    add("--long-prefill-token-threshold", 0, "0: 16, or 64 when deterministic", type=int)
    add("--precompile", "all", "step shapes compiled before the engine is ready",
        choices=("all", "warmup"))
    add("--compile-cache-dir", None, "'' for none (default: the server's)")
    return p


def environment() -> dict:
    """Where and when a report was made."""
    import os
    import platform
    import time

    import jax

    return {"jax": jax.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def parse_size(text: str) -> int:
    """'64K' -> 65536, '4M' -> 4 Mi, '4MiB' -> 4 Mi, '1000' -> 1000."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    value = float(text[:-1] if mult > 1 else text)
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value * mult)


def devices(args) -> int:
    """The devices the engine's mesh needs (the largest --tp where it is a list)."""
    if args.tp_mesh:
        return math.prod(int(v) for v in args.tp_mesh.split("x"))
    return max(args.tp) if isinstance(args.tp, list) else args.tp


def server_config(args, **overrides):
    """The `ServerConfig` of these flags (a list flag: its first value), `overrides` winning."""
    from serving import ServerConfig

    first = lambda v: v[0] if isinstance(v, list) else v  # noqa: E731
    fields = {k: first(getattr(args, k)) for k in (
        "model", "dtype", "quantization", "quantization_group_size", "kv_cache_dtype", "tp_mesh",
        "allreduce", "max_seq_len", "max_num_seqs", "page_size", "long_prefill_token_threshold",
        "precompile", "compile_cache_dir")}
    fields["tp"] = devices(args)
    return ServerConfig(**{**fields, **overrides})


def load(args, **overrides):
    """The model of these flags, loaded as the server loads it (compilation cache included)."""
    from serving import configure_jax, load_configured_model

    config = server_config(args, **overrides)
    configure_jax(config)
    return load_configured_model(config)


def build_engine(args, model=None, start: bool = True, **overrides):
    """An `EngineCore` over a `PagedRunner` of these flags (`overrides`: ServerConfig fields),
    its step shapes compiled (--precompile) and its warm-up run as the server does before it is
    ready, over `model` (default: loaded from the flags); started unless `start` is False (then
    its `runner` may be stepped directly)."""
    from serving import EngineCore, PagedRunner

    c = server_config(args, **overrides)
    runner = PagedRunner(model if model is not None else load(args, **overrides),
                         max_num_seqs=c.max_num_seqs, max_seq_len=c.max_seq_len,
                         page_size=c.page_size, kv_cache_tokens=c.kv_cache_tokens or None,
                         long_prefill_token_threshold=c.long_prefill_token_threshold,
                         max_num_batched_tokens=c.max_num_batched_tokens or None,
                         prefix_caching=c.prefix_caching, deterministic=c.deterministic,
                         model_name="bench")
    runner.compile_warmup(lambda msg: None, everything=c.precompile == "all")
    runner.warmup(lambda msg: None)
    core = EngineCore(runner, overlap=c.overlap)
    return core.start() if start else core
