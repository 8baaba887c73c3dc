"""eval.bench_engine end to end on random:tiny: every part runs and the report has its figures
(the figures themselves are the 270M's, docs/engine.md)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_engine_runs_on_a_tiny_model(tmp_path):
    out = tmp_path / "engine.json"
    # A context of 128 in pages of 16: one page bucket, so few step shapes to compile before
    # the timed runs; the long prompt still runs as 7 pieces beside the streams. The step shapes
    # the warm-up leaves compile when first met (a server without its background compile).
    cmd = [sys.executable, "-m", "eval.bench_engine", "--model", "random:tiny", "--dtype", "float32",
           "--max-seq-len", "128", "--long-prefill-token-threshold", "16", "--page-size", "16",
           "--prefix-tokens", "60",
           "--long-tokens", "100", "--itl-tokens", "100", "--baseline-s", "0.1", "--tokens", "8", "--burst-tokens", "100",
           "--requests", "1", "--repeats", "1", "--compile-cache-dir", "", "--no-background-compile",
           "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["page_size"] == 16
    tp = report["throughput"]
    assert tp["default"]["tok_s"] > 0 and tp["deterministic"]["tok_s"] > 0
    assert tp["deterministic_cost"] == 1 - tp["deterministic"]["tok_s"] / tp["default"]["tok_s"]
    assert 0 < report["prefix"]["second_ttft_s"] and report["prefix"]["prefix_tokens"] == 60
    # The second request found the shared prefix's whole pages cached.
    assert report["prefix"]["hit_tokens"] >= 60 // 16 * 16
    itl = report["itl"]["default"]
    assert itl["admission_gaps"] > 0 and itl["ratio"] > 0
    assert "TTFT with a 60-token prefix hit" in r.stdout
    burst = report["burst"]
    for run in (burst["first"], burst["second"]):
        assert len(run["ttft_s"]) == 8 and 0 < max(run["ttft_s"]) <= run["wall_s"]
        assert 0 < run["longest_gap_s"] < run["wall_s"]
    assert burst["ratio"] == burst["first"]["wall_s"] / burst["second"]["wall_s"]
    assert "a first burst of 8 requests" in r.stdout
