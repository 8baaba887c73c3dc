"""The group codec's kernels against the memory bandwidth of the device they run on.

Quantization and dequantize-add are memory-bound: their physical limit is the bytes they must
move divided by the memory bandwidth. This times, on the default JAX device:
  copy         y = x + 1 over float32 (reads 4, writes 4 bytes a value): the achievable bandwidth
  rotate       f32 runs of 32 times the 32x32 rotation (reads 4, writes 4)
  encode       rotated f32 partial -> int8 payload + scale bytes (reads 4, writes w = 1 + 1/32 +
               1/1024: a scale byte per run, an exponent byte per row of 1024)
  decode_add   wire + local f32 partial -> f32 sum (reads w + 4, writes 4)
  hop          decode_add then encode, as one reduce-scatter hop runs them (reads w + 4,
               writes w)
  encode_sum   the same as a schedule runs it (codecs.encode_sum): the local partial a bfloat16
               piece of the token layout's buffer, read in place (reads 2 + w, writes
               w); on a CPU, a native kernel for int8 and int4
  unrotate     the all-gather's last step: codes and scales -> bf16 values with the rotation
               undone (groups.unrotate_codes; reads w, writes 2), on every device over
               the whole message; on a CPU, a native kernel (equarx.native_cpu)
  unrotate_jax the same in its pure-JAX form (what an accelerator runs; on a CPU, the default
               codec's largest cost before the native kernel)
and reports each one's bytes / time as GB/s and as a fraction of the copy's. On an accelerator
each timing is of `inner` calls dispatched back to back (so the host's dispatch cost overlaps the
device's work) over their count. With the timings come two checks of the kernels' results: the
round trip's error (rotate, encode, un-rotate against the input) and, off the CPU, how many of
the device's codes equal the CPU's for the same input (the rotation's summation order may differ).

  python -m eval.bench_codec --values 64M --repeats 20
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from equarx import codecs, groups
from equarx.layout import plan_token_layout
from eval.reports import write_json


def _time(fn, *args, repeats: int, inner: int = 1) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return float(np.median(times))


def _round_trip(x: jax.Array, group: int, code: str) -> tuple[jax.Array, jax.Array]:
    wire = groups.encode(groups.rotate(x, group), group, code)
    codes, steps, exponents = groups.wire_parts(wire, (1, x.shape[-1]), group, code)
    back = groups.unrotate_codes(codes, steps, exponents, group, code, jnp.float32)
    return codes, back.reshape(x.shape)


def check(x: jax.Array, group: int, code: str, cpu_values: int = 1 << 22) -> dict:
    """The round trip's relative error on x's device; off the CPU, the share of its code bytes
    (on the first `cpu_values` values) equal to the CPU's, and for int8 their largest
    difference in code steps."""
    fn = jax.jit(lambda v: _round_trip(v, group, code))
    codes, back = fn(x)
    err = float(jnp.linalg.norm(back - x) / jnp.linalg.norm(x))
    out = {"round_trip_rel_err": err}
    if x.devices() != {jax.devices("cpu")[0]}:
        rows = max(1, cpu_values // x.shape[-1])
        cpu_codes, _ = fn(jax.device_put(x[:rows], jax.devices("cpu")[0]))
        mine = np.asarray(codes[:rows]).astype(np.int32)
        ref = np.asarray(cpu_codes).astype(np.int32)
        out["codes_equal_cpu"] = float(np.mean(mine == ref))
        if code == "int8":
            out["max_code_diff"] = float(np.max(np.abs(mine - ref)))
    return out


def run(n_values: int, group: int = 32, code: str = "int8", repeats: int = 20,
        inner: int | None = None, on_kernel=None) -> dict:
    """Times every kernel; `on_kernel(name, row)` is called as each one finishes."""
    rows = n_values // 1024
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (rows, 1024), jnp.float32)
    local = jax.random.normal(jax.random.PRNGKey(1), (rows, 1024), jnp.float32)
    wire_bytes = groups.wire_bytes_per_value(group, code, 1024)
    encode = jax.jit(lambda v: groups.encode(v, group, code))
    wire = encode(x)
    kernels = {
        "copy": (jax.jit(lambda v: v + 1.0), (x,), 8.0),
        "rotate": (jax.jit(lambda v: groups.rotate(v, group)), (x,), 8.0),
        "encode": (encode, (x,), 4.0 + wire_bytes),
        "decode_add": (jax.jit(lambda w, v: groups.decode(w, group, code, v.shape) + v),
                       (wire, local),
                       wire_bytes + 8.0),
        "hop": (jax.jit(lambda w, v: groups.encode(groups.decode(w, group, code, v.shape) + v, group,
                                                   code)), (wire, local), 2 * wire_bytes + 4.0),
    }
    # What a schedule runs: a bfloat16 piece (half the columns of a 2-shard token layout) read
    # in place, an arrival decoded and added, the sum encoded (the native kernel on a CPU).
    layout = plan_token_layout((rows, 2048), 2, 1, granule=group)
    buf = layout.split(jnp.concatenate([x, local], axis=1).astype(jnp.bfloat16))
    codec = codecs.GroupCodec(group, code, layout.piece_shape)
    kernels["encode_sum"] = (
        jax.jit(lambda b, w: codecs.encode_sum(codec, b, layout, 1, (0, 1), [w])),
        (buf, groups.encode(local.reshape(1, rows, 1024), group, code)), 2.0 + 2 * wire_bytes)
    parts = groups.wire_parts(wire, (1, 1024), group, code)
    kernels["unrotate"] = (
        jax.jit(lambda *p: groups.unrotate_codes(*p, group, code, jnp.bfloat16)),
        parts, wire_bytes + 2.0)
    kernels["unrotate_jax"] = (
        jax.jit(lambda *p: groups.unrotate_codes(*p, group, code, jnp.bfloat16, native=False)),
        parts, wire_bytes + 2.0)
    platform = jax.devices()[0].platform
    if inner is None:
        inner = 1 if platform == "cpu" else 10
    out = {"device": str(jax.devices()[0].device_kind), "platform": platform,
           "values": rows * 1024, "group": group, "code": code, "inner": inner, "kernels": {}}
    for name, (fn, args, bytes_per_value) in kernels.items():
        s = _time(fn, *args, repeats=repeats, inner=inner)
        out["kernels"][name] = {"ms": s * 1e3, "GB/s": bytes_per_value * rows * 1024 / s / 1e9}
        if on_kernel is not None:
            on_kernel(name, out["kernels"][name])
    copy = out["kernels"]["copy"]["GB/s"]
    for k in out["kernels"].values():
        k["of_copy"] = k["GB/s"] / copy
    out["check"] = check(x, group, code)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", default="64M", help="values per array (K/M suffixes)")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--code", default="int8", choices=sorted(groups.CODES))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--inner", type=int, default=None,
                   help="calls per timing (default: 1 on a CPU, 10 on an accelerator)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    mult = {"K": 1 << 10, "M": 1 << 20}.get(args.values[-1:].upper(), 1)
    n = int(float(args.values.rstrip("KkMm")) * mult)
    report = run(n, args.group, args.code, args.repeats, args.inner,
                 on_kernel=lambda name, k: print(f"  {name}: {k['ms']:.3f} ms", file=sys.stderr,
                                                 flush=True))
    print(f"# {report['device']} ({report['platform']}), {report['values']} values, "
          f"{report['code']} groups of {report['group']}")
    print(f"{'kernel':<12} {'ms':>8} {'GB/s':>8} {'of copy':>8}")
    for name, k in report["kernels"].items():
        print(f"{name:<12} {k['ms']:>8.3f} {k['GB/s']:>8.1f} {100 * k['of_copy']:>7.1f}%")
    print("check: " + ", ".join(f"{k} {v:.4g}" for k, v in report["check"].items()))
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
