"""eval.bench_engine end to end on random:tiny, each run in a fresh process as the command runs:
every mode reports its figures, and the figures say what the engine does (whole pages of a
shared prefix cached, compiles after ready counted, the cache read back on a restart, a
sequence's pages within what the dense cache holds)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The suite's compilation cache (tests/conftest.py), so that the engines these runs build read
# back the programs an earlier one compiled; `ready` makes its own empty one.
TINY = ["--model", "random:tiny", "--dtype", "float32", "--max-seq-len", "128", "--repeats", "1",
        "--tokens", "4", "--prompt-tokens", "16", "--long-prompt", "100", "--compile-cache-dir",
        os.environ.get("GEMMA3_TEST_COMPILATION_CACHE", ""), "--max-num-seqs", "2"]


def run(tmp_path, *args) -> dict:
    out = tmp_path / "engine.json"
    r = subprocess.run([sys.executable, "-m", "eval.bench_engine", *TINY, *args, "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(r.stdout) == report
    return report


def test_every_text_mode_in_one_run(tmp_path):
    # One process for every mode on random:tiny (its start-up and the engine's programs paid
    # once). Shapes compile on first use (untimed runs come first); tests/serving/test_precompile.py
    # checks that with --precompile all nothing compiles after ready. 8 slots, the step and
    # census modes' own: each engine kind is then one engine configuration, whose programs
    # compile once for all the modes.
    report = run(tmp_path, "--only", "lone,batch,streams,ttft,step,census,prefix,itl,grammar,"
                 "capacity,compiles,ready", "--streams", "1,2", "--engines",
                 "default,deterministic", "--precompile", "warmup", "--max-num-seqs", "8")
    assert report["tokenizer"] == "byte" and report["layers"] == 3
    names = ["default@128", "deterministic@128"]
    for name in names:
        assert report["engines"][name]["kv_bytes"] > 0
        assert report["lone"][name]["itl_s_median"] > 0
        batch = report["batch"][name]
        assert len(batch["runs"]) == 1 and batch["tok_s_median"] > 0 and batch["ttft_s_median"] > 0
        assert set(report["streams"][name]) == {"1", "2"}
        assert report["ttft"][name]["runs"][0]["prompt_tokens"] == 100
        step = report["step"][name]
        assert step["rows"] == 8 and step["context"] == 64 and step["step_ms"] > 0
    # The model program alone is part of the engine's step (deterministic mode splits it).
    assert 0 < report["step"]["default@128"]["model_program_ms"]
    assert "model_program_ms" not in report["step"]["deterministic@128"]
    census = report["census"]
    assert census["program"].startswith("ragged step T=8 S=8 Q=1")
    assert census["entry_kernels"] > 0 and census["parameters"] > 0 and census["layers"] == 3
    # A plain step dispatches the model's program and the sampler's, and puts its inputs.
    step = census["per_step"]
    assert step["programs"] >= 2 and step["device_puts"] >= 1, step
    prefix = report["prefix"]
    # The second request found the shared prefix's whole pages of 16 cached.
    assert prefix["prefix_tokens"] == 65 and prefix["hit_tokens"] == 64
    itl = report["itl"]["default"]
    assert itl["admission_gaps"] > 0 and itl["ratio"] > 0 and itl["prompt_tokens"] == 100
    grammar = report["grammar"]
    assert grammar["plain"]["tok_s_median"] > 0 and grammar["grammar"]["tok_s_median"] > 0
    assert grammar["grammar_itl_cost"] == (grammar["grammar"]["itl_s_median"]
                                           / grammar["plain"]["itl_s_median"] - 1)
    cap = report["capacity"]
    assert cap["sequences_that_fit"] * cap["bytes_per_sequence"] <= cap["dense_cache_bytes"]
    assert cap["pool_bytes"] <= cap["dense_cache_bytes"]
    assert 0 < cap["most_running"] <= cap["sequences_that_fit"] and cap["preemptions"] == 0
    # --precompile warmup: the rounds' other step shapes are compiled (or read from the suite's
    # cache) after ready, and counted.
    compiled = report["compiles"]
    assert compiled["streams"] == [1, 8] and compiled["compiles"] + compiled["cache_reads"] > 0
    cold, cached = report["ready"]["cold"], report["ready"]["cached"]
    assert cold["compiles"] > 0 and cached["compiles"] == 0
    assert cached["cache_reads"] >= cold["compiles"]


def test_images(tmp_path):
    report = run(tmp_path, "--only", "images", "--model", "random:tiny?vision=tiny",
                 "--max-seq-len", "512", "--precompile", "warmup")
    im = report["images"]
    text, image = im["stall"]["text"], im["stall"]["image"]
    assert text["max_itl_s"] > 0 and text["max_itl_after_features_s"] is None
    # The image request's gaps split where its features became ready.
    assert image["max_itl_while_encoding_s"] > 0 and image["max_itl_after_features_s"] > 0
    assert im["ttft"]["first_s"] > 0 and im["ttft"]["again_s"] > 0
    assert im["encoder_stages"] > 0 and im["encoder_images_per_s"] > 0
