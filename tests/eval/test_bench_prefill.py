"""bench_prefill in one process on a tiny model: the prompt's steps as the scheduler cuts it, the
report's schema, its byte counts."""
import json

import pytest

from equarx import ideal_ring_bytes
from eval import bench_prefill


def test_model_source_says_how_many_layers_are_used():
    assert bench_prefill.model_source("27b", 4) == ("random:27b?layers=4", 62)
    assert bench_prefill.model_source("random:1b", None) == ("random:1b", None)
    assert bench_prefill.model_source("gemma3-270m", None) == ("gemma3-270m", None)
    with pytest.raises(ValueError):
        bench_prefill.model_source("1b", 27)
    with pytest.raises(ValueError):
        bench_prefill.model_source("gemma3-270m", 4)


def test_one_process_run_writes_rows_and_table(tmp_path, capsys):
    """A lone prompt runs as the scheduler cuts it: pieces of the step budget (32 here), the
    last one the rest, each step padded to a power of two."""
    out = tmp_path / "r.json"
    report = bench_prefill.main([
        "--model", "random:tiny", "--tp", "2", "--lengths", "40,100", "--allreduce",
        "bf16,int8-full", "--max-num-batched-tokens", "32", "--iters", "2", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == report["rows"]
    assert report["engine"]["max_num_batched_tokens"] == 32 and report["engine"]["page_size"] == 16
    rows = {(r["length"], r["method"]): r for r in report["rows"]}
    assert set(rows) == {(n, m) for n in (40, 100) for m in ("bf16", "int8-full")}
    for (length, method), r in rows.items():
        assert r["pieces"] == {40: [32, 8], 100: [32, 32, 32, 4]}[length]
        assert r["steps"] == len(r["pieces"]) and r["step_tokens"] == {40: [32, 8],
                                                                       100: [32, 32, 32, 8]}[length]
        assert r["tp"] == 2 and r["speedup_vs_bf16"] > 0 and r["compile_s"] >= 0
        assert 0 < r["median_ms"] <= r["p90_ms"] and len(r["times_ms"]) == 2
        if method == "bf16":
            assert r["speedup_vs_bf16"] == 1.0
        else:
            # 3 layers x 2 AllReduces of T x 64 values a step: int8 sends less than even an
            # ideal bf16 ring.
            ideal_bf16 = sum(6 * ideal_ring_bytes(t * 64, 2, 2) for t in r["step_tokens"])
            assert r["wire_bytes"] < min(ideal_bf16, rows[length, "bf16"]["wire_bytes"])
    text = capsys.readouterr().out
    assert "layers: 3 (all)" in text and "PREDICTIONS" in text and "int8-full" in text
    assert "steps of at most 32 tokens" in text


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_prefill.main(["--link-gbit", "1"])  # a link needs processes
    with pytest.raises(SystemExit):
        bench_prefill.main(["--allreduce", "bf16,int3"])  # not an AllReduceConfig label


def test_measured_communication_share_of_paired_runs():
    """Each row at the target link gets (its time - the same method's base-link time) / its
    time; rows without a base partner are left alone, and the table shows the column."""
    from eval import bench_prefill as prefill_report

    def row(length, method, link, ms):
        return {"length": length, "steps": 1, "tp": 2, "method": method, "link_gbit": link,
                "median_ms": ms, "p90_ms": ms, "wire_bytes": 1e6}

    rows = [row(512, "bf16", 0, 300.0), row(512, "bf16", 1.5, 450.0),
            row(1024, "bf16", 0, 400.0), row(1024, "bf16", 1.5, 600.0),
            row(1024, "int8-full", 1.5, 480.0)]
    out = prefill_report.add_comm_share(rows, 0, 1.5)
    shares = {(r["length"], r["method"], r["link_gbit"]): r.get("comm_share") for r in out}
    assert shares[(512, "bf16", 1.5)] == pytest.approx(1 / 3)
    assert shares[(1024, "bf16", 1.5)] == pytest.approx(1 / 3)
    assert shares[(1024, "bf16", 0)] is None and shares[(1024, "int8-full", 1.5)] is None
    line = prefill_report.comm_share_line(out)
    assert "33% of its prefill at length 1024" in line and "about 1.5 Gbit/s" in line
    # 75% communication at 1.5 Gbit/s: a third needs 6x less communication time, a 6x faster link.
    slow = prefill_report.add_comm_share(
        [row(1024, "bf16", 0, 400.0), row(1024, "bf16", 1.5, 1600.0)], 0, 1.5)
    assert "about 9 Gbit/s" in prefill_report.comm_share_line(slow)
    assert "comm %" in prefill_report.format_table(out).splitlines()[0]
