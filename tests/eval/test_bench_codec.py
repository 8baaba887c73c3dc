"""eval.bench_codec: every codec kernel is timed, with the bytes it must move per value."""
import json

import pytest

from eval import bench_codec


def test_every_kernel_is_timed_with_its_bytes(tmp_path):
    out = tmp_path / "codec.json"
    report = bench_codec.main(["--values", "64K", "--repeats", "2", "--out", str(out)])
    assert report["values"] == 64 * 1024
    # int8 groups of 32: 1 byte a value, a scale byte per 32 values and an exponent byte per
    # row (of 1024) on the wire.
    wire = 1 + 1 / 32 + 1 / 1024
    moved = {"copy": 8.0, "rotate": 8.0, "encode": 4 + wire, "decode_add": wire + 8,
             "hop": 2 * wire + 4, "encode_sum": 2 * wire + 2, "unrotate": wire + 2,
             "unrotate_jax": wire + 2}
    assert set(report["kernels"]) == set(moved)
    for name, k in report["kernels"].items():
        assert k["ms"] > 0
        assert k["GB/s"] * 1e9 * k["ms"] / 1e3 / report["values"] == pytest.approx(moved[name])
    assert report["kernels"]["copy"]["of_copy"] == 1.0
    assert json.loads(out.read_text())["kernels"].keys() == report["kernels"].keys()
    # The round trip's error is measured, not assumed: int8 groups of 32 of Gaussian values lose
    # about half a percent (the step over sqrt(12) against the values' spread).
    assert 2e-3 < report["check"]["round_trip_rel_err"] < 1e-2


def test_check_compares_a_device_codes_with_the_cpu():
    # Another device (here a second CPU device) encodes the same input to the same codes; the
    # coarser codes lose more in the round trip.
    import jax

    x = jax.random.normal(jax.random.PRNGKey(3), (64, 1024))
    on_other = jax.device_put(x, jax.devices()[1])
    int8 = bench_codec.check(on_other, 32, "int8")
    assert int8["codes_equal_cpu"] == 1.0 and int8["max_code_diff"] == 0.0
    assert int8["all_reduce_rotating_equal_cpu"] == int8["all_reduce_folded_equal_cpu"] == 1.0
    int4 = bench_codec.check(on_other, 32, "int4")
    assert int4["round_trip_rel_err"] > 5 * int8["round_trip_rel_err"]


def test_fp8_times_its_unrotate_too():
    # e4m3 codes un-rotate from the codes as integer codes do (groups.unrotate_codes), with
    # int8's bytes on the wire.
    report = bench_codec.run(16 * 1024, code="fp8", repeats=1)
    k = report["kernels"]["unrotate"]
    assert k["GB/s"] * 1e9 * k["ms"] / 1e3 / report["values"] == pytest.approx(1 + 1 / 32 + 1 / 1024 + 2)


def test_forms_are_timed_with_their_bytes_and_their_bits_checked():
    # Without a GPU the forms are the XLA ones; the butterflies are token-local on any backend.
    report = bench_codec.run(64 * 1024, repeats=1, with_forms=True, with_check=False)
    k = report["kernels"]
    assert {"encode_piece", "encode_xla", "rotate_butterfly", "rotate_dot"} <= set(k)
    assert not any(name.startswith(("encode_triton", "unrotate_triton")) for name in k)
    for name, like in (("encode_piece", "encode"), ("encode_xla", "encode"),
                       ("rotate_butterfly", "rotate"), ("rotate_dot", "rotate")):
        assert k[name]["GB/s"] * k[name]["ms"] == pytest.approx(k[like]["GB/s"] * k[like]["ms"])
    assert k["rotate_butterfly"]["token_local"] is True
    assert "check" not in report


def test_the_gpu_forms_build_and_check_their_bits(monkeypatch):
    # What `--forms` runs on a CUDA GPU, here with the kernels in Pallas' interpreter: every
    # form's check must run and hold (a device session has minutes, not retries).
    import functools

    import jax
    import jax.numpy as jnp

    from equarx import codec_spec, codecs, groups, triton_codecs
    from equarx.layout import plan_token_layout

    for name in ("encode", "unrotate", "encode_sum"):
        monkeypatch.setattr(triton_codecs, name,
                            functools.partial(getattr(triton_codecs, name), interpret=True))
    rows, width = 64, 640
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, width))
    layout = plan_token_layout((rows, 2 * width), 2, 1, granule=32)
    # The inputs as compiled programs (not one program per eager op).
    buf = jax.jit(lambda v: layout.split(jnp.concatenate([v, v / 2], axis=1).astype(
        jnp.bfloat16)))(x)
    codec = codecs.GroupCodec(32, "int8", layout.piece_shape)
    arrival = jax.jit(lambda v: groups.encode((v / 2).reshape(1, rows, width), 32, "int8"))(x)
    hop = (layout, jax.jit(lambda b, w: codecs.encode_sum(codec, b, layout, 1, (0, 1), [w])),
           (buf, arrival), 3.0)
    parts = jax.jit(lambda v: codec_spec.wire_parts(groups.encode(v, 32, "int8"), (1, width),
                                                    32, "int8"))(x)
    forms = bench_codec.forms(x, parts, hop, 32, "int8", 1.03, on_gpu=True)
    gpu = [name for name in forms if "triton" in name]
    assert {"encode_triton_chunked_4096_4", "unrotate_triton_chunked_4096_4",
            "encode_sum_triton_chunked"} <= set(gpu) and len(gpu) == 8
    for name in gpu:
        assert all(v not in (False, 0.0) for v in forms[name][3]().values()), name
