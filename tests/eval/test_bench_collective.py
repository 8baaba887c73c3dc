"""eval.bench_collective: parsing, the table, one tiny in-process run on 8 virtual devices and
one over two processes."""
import pytest

from eval import bench_collective as bench


def test_sizes_and_methods_parse():
    assert [bench.parse_size(s) for s in ("64K", "4M", "1MiB", "1000")] == [
        65536, 4 << 20, 1 << 20, 1000]
    assert bench.format_size(64 << 10) == "64 KiB" and bench.format_size(1000) == "1000 B"
    cfg = bench.parse_method("int8-semi-ag", 16, pipelined=False)
    assert (cfg.method, cfg.variant, cfg.phases, cfg.minishards, cfg.pipelined) == (
        "int8", "semi", "ag", 16, False)
    assert bench.parse_method("bf16_ring", 4).label == "bf16_ring"
    assert bench.parse_method("int8-semi-rs+hadamard", 4).label == "int8-semi-rs+hadamard"
    with pytest.raises(ValueError):
        bench.parse_method("int3", 4)
    with pytest.raises(ValueError):
        bench.parse_size("-1K")
    assert bench.method_options("int8:torus:folded") == ("int8", "torus", True)
    assert bench.method_options("int8") == ("int8", "ring", False)
    with pytest.raises(ValueError, match="mesh suffix"):
        bench.method_options("int8:folded:folded")


def test_a_tiny_run_reports_consistent_rows():
    methods = ["bf16", "bf16_ring", "int8-semi+tile", "int8", "int8:folded"]
    rows = bench.bench_on_mesh([256 << 10], methods, repeats=2, minishards=4)
    by = {r["method"]: r for r in rows}
    assert set(by) == set(methods) and all(r["devices"] == 8 for r in rows)
    assert all(len(r["times_s"]) == 2 and r["min"] <= r["median"] <= r["max"] for r in rows)
    assert by["bf16_ring"]["bytes_vs_ideal_bf16_ring"] == pytest.approx(1.0)
    # 16 tiles per shard: one minishard whose 4 KiB of scales add 1/4 to the int8 payload.
    assert by["int8-semi+tile"]["bytes_vs_ideal_bf16_ring"] == pytest.approx((1 + 4 / 16) / 2)
    # The group codec: a scale byte per 32 values and an exponent byte per row of a piece (the
    # 256 KiB message is 32 rows of 4096: pieces of 512 columns on 8 devices).
    assert by["int8"]["bytes_vs_ideal_bf16_ring"] == pytest.approx((1 + 1 / 32 + 1 / 512) / 2)
    # XLA:CPU promotes a bf16 all-reduce to float32: twice the ideal bf16 bytes.
    assert by["bf16"]["bytes_vs_ideal_bf16_ring"] == pytest.approx(2.0)
    # Two-shot bf16: exact bf16 inputs summed in float32, one rounding, as the psum.
    assert 0 < by["bf16"]["mse"] <= by["bf16_ring"]["mse"] < by["int8"]["mse"] < 2e-3
    assert by["bf16_ring"]["mse"] < by["int8-semi+tile"]["mse"] < 2e-3
    # Rotated bf16 partials (folded weights): the same bytes, the same error up to their
    # bf16 rounding.
    assert by["int8:folded"]["bytes_per_device"] == by["int8"]["bytes_per_device"]
    assert by["int8:folded"]["mse"] == pytest.approx(by["int8"]["mse"], rel=0.2)
    assert by["bf16"]["speedup_vs_bf16"] == pytest.approx(1.0)
    # The compiled size a server inlines twice a layer: the psum is one kernel, a ring many.
    assert by["bf16"]["fusions"] <= 2 < by["int8"]["fusions"] and by["int8"]["instructions"] > 0
    table = bench.format_table(rows)
    assert all(m in table for m in methods) and "256 KiB" in table


def test_two_processes_time_each_call_between_barriers(tmp_path):
    """The multi-process mode end to end (2 processes over gloo, no shaping): every timed call
    sits between two barriers, so both processes time the same interval, and the report says
    how memory was set up."""
    out = tmp_path / "run.json"
    report = bench.main(["--processes", "2", "--sizes", "256K", "--methods", "bf16_ring,int8-full",
                         "--repeats", "3", "--no-mse", "--out", str(out)])
    assert out.is_file() and report["malloc"].startswith("GLIBC_TUNABLES")
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"bf16_ring", "int8-full"} and all(r["devices"] == 2 for r in rows.values())
    for r in rows.values():
        first, second = r["median_by_process"]
        # Barrier to barrier: the processes' medians differ by about one barrier's latency.
        assert abs(first - second) < 0.5 * max(first, second) + 0.005, r["median_by_process"]


@pytest.mark.parametrize("argv", [["--torus", "2x2"],
                                  ["--torus", "2x2", "--link-gbit", "1", "--unshaped"],
                                  ["--unshaped", "--processes", "2"]])
def test_a_torus_is_shaped_or_unshaped_never_both_or_neither(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and "unshaped" in capsys.readouterr().err
