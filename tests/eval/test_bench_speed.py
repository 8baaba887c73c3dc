"""eval.bench_speed end to end on a tiny random model: every mode runs in-process (ready in two
fresh processes) and reports real figures (the figures themselves are a GPU's, or a CPU's at a
small size)."""
import json

from eval import bench_speed


def test_bench_speed_runs_on_a_tiny_model(tmp_path):
    out = tmp_path / "speed.json"
    report = bench_speed.main([
        "--model", "random:tiny?layers=1&vocab=512", "--dtype", "float32", "--max-seq-len", "128",
        "--streams", "1,2", "--tokens", "4", "--prompt-tokens", "16", "--long-prompt", "100",
        "--only", "streams,ttft,step,census,compiles,ready", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["tokenizer"] == "byte" and report["max_num_seqs"] == 2
    for n in ("1", "2"):
        run = report["streams"][n]
        assert len(run["tok_s"]) == 2 and run["tok_s_median"] > 0
        assert run["itl_median_s"] > 0 and run["ttft_median_s"] > 0
    assert report["ttft"]["prompt_tokens"] == 100 and report["ttft"]["ttft_median_s"] > 0
    step = report["step"]
    assert step["step_ms"] > 0 and step["overlapped_step_ms"] > 0 and step["model_program_ms"] > 0
    census = report["census"]
    assert census["entry_kernels"] > 0 and census["parameters"] > 0 and census["layers"] == 1
    # A plain step runs the model's program and the sampler's; an overlapped one also the feed.
    plain, overlapped = census["per_step_plain"], census["per_step_overlapped"]
    assert plain["programs"] >= 2 and plain["device_puts"] >= 1
    assert overlapped["programs"] == plain["programs"] + 1 and "feed_tokens" in overlapped["by_name"]
    compiles = report["compiles"]
    assert compiles["streams"] == [1, 2]
    assert isinstance(compiles["compiles"], int) and compiles["compiles"] >= 0
    assert isinstance(compiles["cache_reads"], int) and compiles["cache_reads"] >= 0
    # Cold, the warm-up's programs compile; over the cache the first filled they are read.
    cold, cached = report["ready"]["cold"], report["ready"]["cached"]
    assert cold["ready_s"] > 0 and cold["compiles"] > 0
    assert cached["compiles"] == 0 and cached["cache_reads"] >= cold["compiles"]
