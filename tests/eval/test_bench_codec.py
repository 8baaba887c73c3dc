"""eval.bench_codec: every codec kernel is timed, with the bytes it must move per value."""
import json

import pytest

from eval import bench_codec


def test_every_kernel_is_timed_with_its_bytes(tmp_path):
    out = tmp_path / "codec.json"
    report = bench_codec.main(["--values", "64K", "--repeats", "2", "--out", str(out)])
    assert report["values"] == 64 * 1024
    # int8 groups of 32: 1 byte a value plus a bfloat16 scale per 32 values on the wire.
    wire = 1 + 2 / 32
    moved = {"copy": 8.0, "rotate": 8.0, "encode": 4 + wire, "decode_add": wire + 8,
             "hop": 2 * wire + 4, "unrotate": wire + 2}
    assert set(report["kernels"]) == set(moved)
    for name, k in report["kernels"].items():
        assert k["ms"] > 0
        assert k["GB/s"] * 1e9 * k["ms"] / 1e3 / report["values"] == pytest.approx(moved[name])
    assert report["kernels"]["copy"]["of_copy"] == 1.0
    assert json.loads(out.read_text())["kernels"].keys() == report["kernels"].keys()


def test_fp8_times_its_unrotate_too():
    # e4m3 codes un-rotate from the codes as integer codes do (groups.unrotate_codes), with
    # int8's bytes on the wire.
    report = bench_codec.run(16 * 1024, code="fp8", repeats=1)
    k = report["kernels"]["unrotate"]
    assert k["GB/s"] * 1e9 * k["ms"] / 1e3 / report["values"] == pytest.approx(1 + 2 / 32 + 2)
