"""eval.suite_profile: the plugin on a real pytest run in a child process (a test that burns CPU,
one whose child process does, one that compiles with jax, one that reads a program back from
the persistent compilation cache) and its per-file report."""
import json
import os
import subprocess
import sys

from eval import suite_profile

# Each sample test writes down what it measured itself (its own process's CPU, the child's own
# CPU), so the plugin's figures are compared with the same quantity rather than with a constant.
SAMPLE = '''
import os, subprocess, sys, time
import jax, jax.numpy as jnp

def note(name, seconds):
    with open(os.path.join(os.environ["SAMPLE_NOTES"], name), "w") as f:
        f.write(repr(seconds))

def test_burns_cpu_here():
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    note("here", time.process_time() - t)

def test_burns_cpu_in_a_child():
    t = time.process_time()
    child = subprocess.run([sys.executable, "-c",
                            "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass\\n"
                            "print(time.process_time())"],
                           check=True, capture_output=True, text=True)
    note("parent", time.process_time() - t)
    note("child", float(child.stdout))

def test_compiles():
    assert float(jax.jit(lambda x: jnp.sin(x) * 2)(1.0)) != 0

def test_reads_back(tmp_path):
    import jax_platform
    jax_platform.enable_compilation_cache(tmp_path)
    f = lambda x: jnp.cos(x) * 3
    first = float(jax.jit(f)(1.0))
    jax.clear_caches()  # the second call reads the program back from tmp_path
    assert float(jax.jit(f)(1.0)) == first
'''


def test_records_each_tests_cost_and_reports_per_file(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    out = tmp_path / "profile"
    notes = tmp_path / "notes"
    notes.mkdir()
    env = dict(os.environ, SUITE_PROFILE_DIR=str(out), JAX_PLATFORMS="cpu", SAMPLE_NOTES=str(notes))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "eval.suite_profile",
                          "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp_path),
                          "-c", os.devnull, str(tmp_path / "test_sample.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    records = {r["test"].split("::")[1]: r for r in suite_profile.read_records(out)}
    assert set(records) == {"test_burns_cpu_here", "test_burns_cpu_in_a_child", "test_compiles",
                            "test_reads_back"}
    here, child, jitted = (records[k] for k in ("test_burns_cpu_here", "test_burns_cpu_in_a_child",
                                                 "test_compiles"))
    noted = {f.name: float(f.read_text()) for f in notes.iterdir()}
    us = 2e-6  # getrusage counts whole microseconds, process_time nanoseconds
    # The plugin's window holds the test's: at least the CPU the test itself saw, and no child
    # CPU where no child was reaped.
    assert here["cpu_s"] >= noted["here"] - us and here["wall_s"] >= noted["here"]
    assert here["child_cpu_s"] == 0
    # The child's CPU is counted as the child's (all of it), not as the test process's: the
    # test process's own CPU stays below what the child burned (the parent only waited).
    assert child["child_cpu_s"] >= noted["child"] - us
    assert noted["parent"] - us <= child["cpu_s"] < noted["child"]
    assert here["programs"] == child["programs"] == 0
    assert jitted["programs"] >= 1 and jitted["compile_s"] > 0 and jitted["cache_hits"] == 0
    # A persistent-cache read is a hit, not a second compile (JAX times both as a compile).
    read_back = records["test_reads_back"]
    assert (read_back["programs"], read_back["cache_hits"]) == (1, 1)
    [row] = suite_profile.per_file(list(records.values()))
    assert row["programs"] == jitted["programs"] + 1 and row["cache_hits"] == 1
    assert abs(row["cpu_s"] - sum(r["cpu_s"] for r in records.values())) < 1e-9
    report = subprocess.run([sys.executable, "-m", "eval.suite_profile", str(out)],
                            capture_output=True, text=True, check=True).stdout
    assert "4 tests in 1 files" in report and "1 more read from the cache" in report and report.splitlines()[-1].endswith("test_sample.py")
    assert json.loads((out / os.listdir(out)[0]).read_text().splitlines()[0])["pid"] > 0
