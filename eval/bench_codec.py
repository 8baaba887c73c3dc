"""The group codec's kernels against the memory bandwidth of the default JAX device (GB/s and
the share of a copy's: they are memory-bound), then the round trip's error and, off the CPU,
the device's bits against the CPU's. Kernels, their byte counts, examples: docs/benchmarks.md."""
from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from equarx import codec_spec, codecs, groups, triton_codecs
from equarx.layout import plan_token_layout
from eval import common
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


def check(x: jax.Array, group: int, code: str, cpu_values: int = 1 << 22) -> dict:
    """The round trip's relative error on x's device; off the CPU, the share of its codes (the
    first `cpu_values` values) equal to the CPU's, int8's largest difference in steps, and
    `all_reduce_equal_cpu`."""
    def round_trip(v):
        wire = groups.encode(groups.rotate(v, group), group, code)
        codes, steps, exps = codec_spec.wire_parts(wire, (1, v.shape[-1]), group, code)
        return codes, groups.unrotate_codes(codes, steps, exps, group, code, jnp.float32).reshape(v.shape)

    fn = jax.jit(round_trip)
    codes, back = fn(x)
    out = {"round_trip_rel_err": float(jnp.linalg.norm(back - x) / jnp.linalg.norm(x))}
    if x.devices() != {jax.devices("cpu")[0]}:
        rows = max(1, cpu_values // x.shape[-1])
        mine = np.asarray(codes[:rows]).astype(np.int32)
        ref = np.asarray(fn(jax.device_put(x[:rows], jax.devices("cpu")[0]))[0]).astype(np.int32)
        out["codes_equal_cpu"] = float(np.mean(mine == ref))
        if code == "int8":
            out["max_code_diff"] = float(np.max(np.abs(mine - ref)))
        out.update(all_reduce_equal_cpu(next(iter(x.devices())), code))
    return out


def all_reduce_equal_cpu(device, code: str, n: int = 4) -> dict:
    """The real `equarx.all_reduce` of `code` over n devices emulated by vmap (bfloat16
    partials of 512 x 640) on `device` and on the CPU: the share of equal result bits,
    rotating at run time and folded (rotated=True). Only the forward rotation, a dot off the
    CPU, may round otherwise."""
    from equarx import AllReduceConfig, all_reduce

    key = jax.random.split(jax.random.PRNGKey(7), 2)
    parts = (jax.random.normal(key[0], (n, 512, 640))
             * jnp.exp(jax.random.normal(key[1], (n, 512, 1)))).astype(jnp.bfloat16)
    out = {}
    for rotated in (False, True):
        f = jax.jit(jax.vmap(lambda q, r=rotated: all_reduce(q, "emulated", AllReduceConfig(code),
                                                             rotated=r), axis_name="emulated"))
        mine, ref = (np.asarray(f(jax.device_put(parts, d)), np.float32)
                     for d in (device, jax.devices("cpu")[0]))
        out[f"all_reduce_{'folded' if rotated else 'rotating'}_equal_cpu"] = float(
            np.mean(mine.view(np.uint32) == ref.view(np.uint32)))
    return out


def kernels(n_values: int, group: int, code: str, width: int, forms: bool,
            gpu: bool | None = None) -> tuple[dict, jax.Array]:
    """name -> (jitted function, its arguments, bytes a value[, the default form of a chunked
    kernel]); and the input x."""
    rows = n_values // width
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, width), jnp.float32)
    local = jax.random.normal(jax.random.PRNGKey(1), (rows, width), jnp.float32)
    w = codec_spec.wire_bytes_per_value(group, code, width)
    encode = jax.jit(lambda v: groups.encode(v, group, code))
    wire = encode(x)
    decode = lambda b, v: codec_spec.decode(b, group, code, v.shape)  # noqa: E731
    # A schedule's hop: half the columns of a 2-shard token layout's bfloat16 buffer read in
    # place, an arrival decoded and added, the sum encoded (inputs made by compiled programs:
    # op by op, each shape compiled a program per operation).
    layout = plan_token_layout((rows, 2 * width), 2, 1, granule=group)
    buf = jax.jit(lambda a, b: layout.split(jnp.concatenate([a, b], 1).astype(jnp.bfloat16)))(x, local)
    codec = codecs.GroupCodec(group, code, layout.piece_shape)
    arrival = jax.jit(lambda v: groups.encode(v.reshape(1, rows, width), group, code))(local)
    parts = jax.jit(lambda b: codec_spec.wire_parts(b, (1, width), group, code))(wire)
    table = {
        "copy": (jax.jit(lambda v: v + 1.0), (x,), 8.0),
        "rotate": (jax.jit(lambda v: groups.rotate(v, group)), (x,), 8.0),
        "encode": (encode, (x,), 4.0 + w),
        "decode_add": (jax.jit(lambda b, v: decode(b, v) + v), (wire, local), w + 8.0),
        "hop": (jax.jit(lambda b, v: groups.encode(decode(b, v) + v, group, code)), (wire, local), 2 * w + 4.0),
        "encode_sum": (jax.jit(lambda b, a: codecs.encode_sum(codec, b, layout, 1, (0, 1), [a])),
                       (buf, arrival), 2.0 + 2 * w),
        "unrotate": (jax.jit(lambda *p: groups.unrotate_codes(*p, group, code, jnp.bfloat16)), parts, w + 2.0),
        "unrotate_jax": (jax.jit(lambda *p: groups.unrotate_codes(*p, group, code, jnp.bfloat16, native=False)),
                         parts, w + 2.0)}
    gpu = jax.devices()[0].platform == "gpu" if gpu is None else gpu
    if forms and gpu and triton_codecs.supports(width, group, code):
        for name, fn, args, per_value in (
                ("encode", lambda v, c: triton_codecs.encode(v[None], group, code, chunked=c), (x,), 4.0 + w),
                ("unrotate", lambda *p, c: triton_codecs.unrotate(*p[:3], group, code, jnp.bfloat16,
                                                                  chunked=c), parts, w + 2.0),
                ("encode_sum", lambda b, a, c: triton_codecs.encode_sum(
                    b, 1, [a], layout.piece_geometry(0, 1), group, code, chunked=c), (buf, arrival),
                 2.0 + 2 * w)):  # with the default kernel's form, to compare bits
            table[name + "_chunked"] = (jax.jit(functools.partial(fn, c=True)), args, per_value,
                                        jax.jit(functools.partial(fn, c=False)))
    return table, x


def run(n_values: int, group: int = 32, code: str = "int8", repeats: int = 20,
        inner: int | None = None, names: list[str] | None = None, forms: bool = False,
        with_check: bool = True, width: int = 1024) -> dict:
    """Times every kernel (or those in `names`, in that order), rows of `width` values."""
    table, x = kernels(n_values, group, code, width, forms)
    platform = jax.devices()[0].platform
    inner = inner or (1 if platform == "cpu" else 10)
    out = {"device": str(jax.devices()[0].device_kind), "platform": platform, "values": x.size,
           "width": width, "group": group, "code": code, "inner": inner, "kernels": {}}
    for name in names or list(table):
        if name not in table:
            raise ValueError(f"no kernel {name!r} here (on {platform}); have {sorted(table)}")
        fn, args, per_value, *default = table[name]
        s = _time(fn, *args, repeats=repeats, inner=inner)
        row = out["kernels"][name] = {"ms": s * 1e3, "GB/s": per_value * x.size / s / 1e9}
        if default:
            row["equal_default"] = bool(np.array_equal(np.asarray(fn(*args), np.float32),
                                                       np.asarray(default[0](*args), np.float32)))
        print(f"  {name}: {row}", file=sys.stderr, flush=True)
    copy = out["kernels"].get("copy", {}).get("GB/s")
    for k in out["kernels"].values():
        k["of_copy"] = k["GB/s"] / copy if copy else None
    if with_check:
        out["check"] = check(x, group, code)
    return out


def main(argv=None) -> dict:
    p = common.parser(__doc__, engine=False, repeats=20)
    p.add_argument("--values", default="64M", help="values per array (K/M suffixes)")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--width", type=int, default=1024, help="values a row (a multiple of --group)")
    p.add_argument("--code", default="int8", choices=sorted(codec_spec.CODES))
    p.add_argument("--inner", type=int, help="calls per timing (default: 1 on a CPU, 10 elsewhere)")
    p.add_argument("--kernels", help="comma-separated kernels to time, in this order (default: "
                   "all): copy, rotate, encode, decode_add, hop, encode_sum, unrotate, unrotate_jax")
    p.add_argument("--forms", action="store_true", help="add the chunked GPU kernels")
    p.add_argument("--no-check", action="store_true", help="skip the checks of the results")
    args = p.parse_args(argv)
    report = run(common.parse_size(args.values), args.group, args.code, args.repeats,
                 args.inner, common.names(args.kernels or ""), args.forms, not args.no_check, args.width)
    print(f"# {report['device']} ({report['platform']}), {report['values']} values in rows of "
          f"{report['width']}, {report['code']} groups of {report['group']}")
    for name, k in report["kernels"].items():
        share = f"{100 * k['of_copy']:>7.1f}%" if k["of_copy"] is not None else "       -"
        print(f"{name:<18} {k['ms']:>8.3f} ms {k['GB/s']:>8.1f} GB/s {share}"
              + ("" if "equal_default" not in k else f" equal_default={k['equal_default']}"))
    if "check" in report:
        print("check: " + ", ".join(f"{k} {v:.4g}" for k, v in report["check"].items()))
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
