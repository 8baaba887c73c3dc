"""The group codec's kernels against the memory bandwidth of the device they run on.

Quantization and dequantize-add are memory-bound: their physical limit is the bytes they must
move divided by the memory bandwidth. This times, on the default JAX device:
  copy         y = x + 1 over float32 (reads 4, writes 4 bytes a value): the achievable bandwidth
  rotate       f32 runs of 32 times the 32x32 rotation (reads 4, writes 4); off the CPU a dot
  encode       rotated f32 partial -> int8 payload + scale bytes (reads 4, writes w = 1 + 1/32 +
               1/1024: a scale byte per run, an exponent byte per row of --width 1024); on a CUDA GPU
               one kernel (equarx.triton_codecs)
  decode_add   wire + local f32 partial -> f32 sum (reads w + 4, writes 4)
  hop          decode_add then encode, as one reduce-scatter hop runs them (reads w + 4,
               writes w)
  encode_sum   the same as a schedule runs it (codecs.encode_sum): the local partial a bfloat16
               piece of the token layout's buffer, read in place (reads 2 + w, writes
               w); on a CPU, a native kernel for int8 and int4
  unrotate     the all-gather's last step: codes and scales -> bf16 values with the rotation
               undone (groups.unrotate_codes; reads w, writes 2), on every device over
               the whole message; on a CPU a native kernel (equarx.native_cpu), on a CUDA GPU
               one Triton kernel (equarx.triton_codecs)
  unrotate_jax the same in its pure-JAX form (on a CPU, the default codec's largest cost before
               the native kernel)
and reports each one's bytes / time as GB/s and as a fraction of the copy's. On an accelerator
each timing is of `inner` calls dispatched back to back (so the host's dispatch cost overlaps the
device's work) over their count. With the timings come two checks of the kernels' results: the
round trip's error (rotate, encode, un-rotate against the input) and, off the CPU, how many of
the device's codes equal the CPU's for the same input (the rotation's summation order may differ)
and how many of the real all_reduce's values, over 4 devices emulated on it (`all_reduce_equal_cpu`).

`--forms` adds other forms of the kernels, each with the same bytes, and checks of their bits
(token_local: a row's result the same whatever rows come with it; equal_cpu / equal_pure: the
same bits as the XLA:CPU program / the pure-JAX form):
  encode_piece        encode of one piece of all the rows (the token layout's shape)
  encode_xla          the same in XLA ops (codec_spec.encode: what a GPU ran before its kernel)
  encode_triton_B_W   the GPU kernel with blocks of B values and W warps (GPU only)
  unrotate_triton_B_W the same for the un-rotation (GPU only)
  ..._triton_chunked_B_W, encode_sum_triton_chunked
                      the encode, un-rotation and hop kernels with a row of a width that is not
                      a power of two loaded as power-of-two pieces instead of one padded block
                      (GPU only; equal_default: the same bits as the default kernel)
  rotate_butterfly    the rotation as Hadamard butterflies (groups.butterflies)
  rotate_dot          the rotation as a float32 dot (what runs off the CPU)

  python -m eval.bench_codec --values 64M --repeats 20
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from equarx import codec_spec, codecs, groups, triton_codecs
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
    codes, steps, exponents = codec_spec.wire_parts(wire, (1, x.shape[-1]), group, code)
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
        out.update(all_reduce_equal_cpu(next(iter(x.devices())), code))
    return out


def all_reduce_equal_cpu(device, code: str, n: int = 4) -> dict:
    """The real `equarx.all_reduce` with the default group codec of `code` over n devices
    emulated by vmap (bfloat16 partials of 512 tokens of the 270M's width, 640), run on
    `device` and on the CPU: the share of result values with equal bits, rotating at run time
    and with the rotation folded into the partials (rotated=True). Everything the schedule
    computes is specified to the bit (groups), so only the forward rotation, a dot off the
    CPU, may round otherwise."""
    from equarx import AllReduceConfig, all_reduce

    cpu = jax.devices("cpu")[0]
    key = jax.random.split(jax.random.PRNGKey(7), 2)
    parts = (jax.random.normal(key[0], (n, 512, 640))
             * jnp.exp(jax.random.normal(key[1], (n, 512, 1)))).astype(jnp.bfloat16)
    out = {}
    for rotated in (False, True):
        def f(p, rotated=rotated):
            return jax.vmap(lambda q: all_reduce(q, "emulated", AllReduceConfig(code),
                                                 rotated=rotated), axis_name="emulated")(p)
        mine = np.asarray(jax.jit(f)(jax.device_put(parts, device)), np.float32)
        ref = np.asarray(jax.jit(f)(jax.device_put(parts, cpu)), np.float32)
        out[f"all_reduce_{'folded' if rotated else 'rotating'}_equal_cpu"] = float(
            np.mean(mine.view(np.uint32) == ref.view(np.uint32)))
    return out


def _rotate_butterfly(x, g):
    v = x.reshape(-1, g) * codec_spec.signs(g)
    return groups.butterflies(v).reshape(x.shape)


def _rotate_dot(x, g):
    return jnp.dot(x.reshape(-1, g), jnp.asarray(codec_spec.rotation(g)),
                   precision=lax.Precision.HIGHEST).reshape(x.shape)


def _token_local(fn, *args) -> bool:
    """Whether fn's result for the first rows of its inputs equals its result's first rows,
    bit for bit, for a few row counts (the rows of every input along axis 0)."""
    full = np.asarray(jax.device_get(fn(*args)))
    for k in (1, 3, 64):
        part = np.asarray(jax.device_get(fn(*(a[:k] for a in args))))
        if part.shape != full[:k].shape or part.tobytes() != full[:k].tobytes():
            return False
    return True


def _encode_equal_cpu(fn, piece: jax.Array, group: int, code: str, rows: int = 4096) -> float:
    """The share of fn's wire bytes for the piece's first `rows` rows equal to the XLA:CPU
    program's (`codec_spec.encode` on the CPU device)."""
    cpu = jax.devices("cpu")[0]
    part = piece[:, :rows]
    ref = jax.jit(lambda v: codec_spec.encode(v, group, code))(jax.device_put(part, cpu))
    return float(np.mean(np.asarray(fn(part)) == np.asarray(ref)))


def forms(x: jax.Array, wire_parts: tuple, hop: tuple, group: int, code: str,
          wire_bytes: float, on_gpu: bool) -> dict:
    """The forms of the kernels beside the defaults (see the module's docstring): name ->
    (jitted function, its arguments, bytes a value, a check of its bits or None). `hop`: the
    default `encode_sum` as (its token layout, function, arguments, bytes a value)."""
    rows, width = x.shape
    piece = x.reshape(1, rows, width)
    out = {"encode_piece": (jax.jit(lambda v: groups.encode(v, group, code)), (piece,),
                            4.0 + wire_bytes, None),
           "encode_xla": (jax.jit(lambda v: codec_spec.encode(v, group, code)), (piece,),
                          4.0 + wire_bytes, None)}
    if on_gpu and triton_codecs.supports(width, group, code):
        for block, warps, chunked in ((4096, 4, False), (8192, 8, False), (2048, 4, False),
                                      (4096, 4, True)):
            fn = jax.jit(lambda v, b=block, w=warps, c=chunked: triton_codecs.encode(
                v, group, code, block_values=b, num_warps=w, chunked=c))
            out[f"encode_triton{'_chunked' * chunked}_{block}_{warps}"] = (
                fn, (piece,), 4.0 + wire_bytes, lambda fn=fn: {
                    "equal_cpu": _encode_equal_cpu(fn, piece, group, code),
                    "token_local": _token_local(
                        lambda v: fn(v[None])[0, :v.shape[0] * width].reshape(-1, width), x)})
        pure = jax.jit(lambda *p: groups.unrotate_codes(*p, group, code, jnp.bfloat16,
                                                        native=False))
        for block, warps, chunked in ((4096, 4, False), (8192, 8, False), (4096, 4, True)):
            fn = jax.jit(lambda *p, b=block, w=warps, c=chunked: triton_codecs.unrotate(
                *p, group, code, jnp.bfloat16, block_values=b, num_warps=w, chunked=c))
            out[f"unrotate_triton{'_chunked' * chunked}_{block}_{warps}"] = (
                fn, wire_parts, wire_bytes + 2.0, lambda fn=fn: {
                    "equal_pure": bool(np.array_equal(
                        np.asarray(fn(*wire_parts), np.float32),
                        np.asarray(pure(*wire_parts), np.float32))),
                    "token_local": _token_local(fn, *wire_parts)})
        layout, default, hop_args, hop_bytes = hop
        fn = jax.jit(lambda b, w: triton_codecs.encode_sum(
            b, 1, [w], layout.piece_geometry(0, 1), group, code, chunked=True))
        out["encode_sum_triton_chunked"] = (fn, hop_args, hop_bytes, lambda fn=fn: {
            "equal_default": bool(np.array_equal(np.asarray(fn(*hop_args)),
                                                 np.asarray(default(*hop_args))))})
    for name, f in (("rotate_butterfly", _rotate_butterfly), ("rotate_dot", _rotate_dot)):
        fn = jax.jit(lambda v, f=f: f(v, group))
        out[name] = (fn, (x,), 8.0, lambda fn=fn: {"token_local": _token_local(fn, x)})
    return out


def run(n_values: int, group: int = 32, code: str = "int8", repeats: int = 20,
        inner: int | None = None, on_kernel=None, kernels: list[str] | None = None,
        with_forms: bool = False, with_check: bool = True, hlo_path: str | None = None,
        width: int = 1024) -> dict:
    """Times every kernel (or those named in `kernels`, in that order); `on_kernel(name, row)`
    is called as each one finishes; rows of `width` values (a multiple of `group`). `with_forms`
    adds the other forms (`forms`);
    `hlo_path` collects each kernel's compiled program there."""
    rows = n_values // width
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (rows, width), jnp.float32)
    local = jax.random.normal(jax.random.PRNGKey(1), (rows, width), jnp.float32)
    wire_bytes = codec_spec.wire_bytes_per_value(group, code, width)
    encode = jax.jit(lambda v: groups.encode(v, group, code))
    wire = encode(x)
    table = {
        "copy": (jax.jit(lambda v: v + 1.0), (x,), 8.0),
        "rotate": (jax.jit(lambda v: groups.rotate(v, group)), (x,), 8.0),
        "encode": (encode, (x,), 4.0 + wire_bytes),
        "decode_add": (jax.jit(lambda w, v: codec_spec.decode(w, group, code, v.shape) + v),
                       (wire, local),
                       wire_bytes + 8.0),
        "hop": (jax.jit(lambda w, v: groups.encode(codec_spec.decode(w, group, code, v.shape) + v, group,
                                                   code)), (wire, local), 2 * wire_bytes + 4.0),
    }
    # What a schedule runs: a bfloat16 piece (half the columns of a 2-shard token layout) read
    # in place, an arrival decoded and added, the sum encoded (the native kernel on a CPU).
    # The inputs are made by compiled programs too: op by op, each shape compiled a program
    # per operation.
    layout = plan_token_layout((rows, 2 * width), 2, 1, granule=group)
    buf = jax.jit(lambda a, b: layout.split(jnp.concatenate([a, b], axis=1).astype(
        jnp.bfloat16)))(x, local)
    codec = codecs.GroupCodec(group, code, layout.piece_shape)
    arrival = jax.jit(lambda v: groups.encode(v.reshape(1, rows, width), group, code))(local)
    table["encode_sum"] = (
        jax.jit(lambda b, w: codecs.encode_sum(codec, b, layout, 1, (0, 1), [w])),
        (buf, arrival), 2.0 + 2 * wire_bytes)
    parts = jax.jit(lambda w: codec_spec.wire_parts(w, (1, width), group, code))(wire)
    table["unrotate"] = (
        jax.jit(lambda *p: groups.unrotate_codes(*p, group, code, jnp.bfloat16)),
        parts, wire_bytes + 2.0)
    table["unrotate_jax"] = (
        jax.jit(lambda *p: groups.unrotate_codes(*p, group, code, jnp.bfloat16, native=False)),
        parts, wire_bytes + 2.0)
    platform = jax.devices()[0].platform
    checks = {}
    if with_forms:
        for name, (fn, args, nbytes, chk) in forms(x, parts, (layout, *table["encode_sum"]),
                                                   group, code, wire_bytes,
                                                   platform == "gpu").items():
            table[name] = (fn, args, nbytes)
            if chk is not None:
                checks[name] = chk
    if inner is None:
        inner = 1 if platform == "cpu" else 10
    out = {"device": str(jax.devices()[0].device_kind), "platform": platform,
           "values": rows * width, "width": width, "group": group, "code": code, "inner": inner, "kernels": {}}
    for name in kernels or list(table):
        if name not in table:
            raise ValueError(f"no kernel {name!r} here (on {platform}); have {sorted(table)}")
        fn, args, bytes_per_value = table[name]
        t0 = time.perf_counter()
        try:
            jax.block_until_ready(fn(*args))
        except Exception as e:  # an accelerator form that does not compile there: say so
            if not with_forms:
                raise
            out["kernels"][name] = row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if on_kernel is not None:
                on_kernel(name, row)
            continue
        first = time.perf_counter() - t0
        s = _time(fn, *args, repeats=repeats, inner=inner)
        row = {"ms": s * 1e3, "GB/s": bytes_per_value * rows * width / s / 1e9,
               "first_call_s": round(first, 2)}
        if name in checks:
            row.update(checks[name]())
        if hlo_path:
            with open(hlo_path, "a") as f:
                f.write(f"# ---- {name}\n{fn.lower(*args).compile().as_text()}\n")
        out["kernels"][name] = row
        if on_kernel is not None:
            on_kernel(name, row)
    copy = out["kernels"].get("copy", {}).get("GB/s")
    for k in out["kernels"].values():
        k["of_copy"] = k["GB/s"] / copy if copy and "GB/s" in k else None
    if with_check:
        out["check"] = check(x, group, code)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", default="64M", help="values per array (K/M suffixes)")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--width", type=int, default=1024,
                   help="values a row (a token's piece; a multiple of --group; Gemma 3's are "
                        "not powers of two, which the GPU kernels pad)")
    p.add_argument("--code", default="int8", choices=sorted(codec_spec.CODES))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--inner", type=int, default=None,
                   help="calls per timing (default: 1 on a CPU, 10 on an accelerator)")
    p.add_argument("--kernels", default=None,
                   help="comma-separated kernels to time, in this order (default: all)")
    p.add_argument("--forms", action="store_true",
                   help="add the accelerator forms of the kernels (see the docstring)")
    p.add_argument("--no-check", action="store_true", help="skip the round-trip check")
    p.add_argument("--hlo", default=None, help="append each kernel's compiled program here")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    mult = {"K": 1 << 10, "M": 1 << 20}.get(args.values[-1:].upper(), 1)
    n = int(float(args.values.rstrip("KkMm")) * mult)
    report = run(n, args.group, args.code, args.repeats, args.inner,
                 on_kernel=lambda name, k: print(f"  {name}: {k}", file=sys.stderr, flush=True),
                 kernels=args.kernels.split(",") if args.kernels else None,
                 with_forms=args.forms, with_check=not args.no_check, hlo_path=args.hlo,
                 width=args.width)
    print(f"# {report['device']} ({report['platform']}), {report['values']} values in rows of "
          f"{report['width']}, {report['code']} groups of {report['group']}")
    print(f"{'kernel':<12} {'ms':>8} {'GB/s':>8} {'of copy':>8}")
    for name, k in report["kernels"].items():
        if "error" in k:
            print(f"{name:<12} failed: {k['error']}")
            continue
        share = f"{100 * k['of_copy']:>7.1f}%" if k["of_copy"] is not None else "       -"
        notes = " ".join(f"{key}={val}" for key, val in k.items()
                         if key not in ("ms", "GB/s", "of_copy", "first_call_s"))
        print(f"{name:<12} {k['ms']:>8.3f} {k['GB/s']:>8.1f} {share} {notes}")
    if "check" in report:
        print("check: " + ", ".join(f"{k} {v:.4g}" for k, v in report["check"].items()))
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
