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


def test_the_gpu_forms_build_and_give_the_default_kernels_bits(monkeypatch):
    # What `--forms` runs on a CUDA GPU, here with the kernels in Pallas' interpreter: each
    # chunked kernel against its one-block form (a device session has minutes, not retries).
    import functools

    import numpy as np

    from equarx import triton_codecs

    for name in ("encode", "unrotate", "encode_sum"):
        monkeypatch.setattr(triton_codecs, name,
                            functools.partial(getattr(triton_codecs, name), interpret=True))
    table, _ = bench_codec.kernels(64 * 640, 32, "int8", 640, forms=True, gpu=True)
    chunked = [name for name in table if name.endswith("_chunked")]
    assert chunked == ["encode_chunked", "unrotate_chunked", "encode_sum_chunked"]
    for name in chunked:
        fn, args, per_value, default = table[name]
        assert per_value == table[name.removesuffix("_chunked")][2]
        assert np.array_equal(np.asarray(fn(*args), np.float32),
                              np.asarray(default(*args), np.float32)), name
