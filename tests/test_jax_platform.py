"""jax_platform: the one process set-up (XLA flags and virtual CPU devices, the
compilation cache, glibc malloc settings that stop large host buffers from being page-faulted
afresh on every use), and that importing the modules that use it changes nothing."""
import json
import os
import subprocess
import sys

import pytest

import jax_platform
from jax_platform import TUNABLES, with_malloc_tunables

DEVICES = "--xla_force_host_platform_device_count"
TIMEOUT = "--xla_cpu_collective_call_terminate_timeout_seconds=600"

# Allocate, touch and free 1, 2, ..., 16 MiB (numpy's own huge-page advice off, so that pages
# are 4 KiB); print the minor page faults that took. glibc's default mmaps each block (they
# grow past its dynamic threshold every time) and the kernel faults all 136 MiB in; with the
# thresholds raised the heap grows to 16 MiB once and is reused.
_FAULTS = """
import resource, sys, numpy as np
np._core.multiarray._set_madvise_hugepage(False)
if sys.argv[1] == "mallopt":
    from jax_platform import keep_freed_memory
    assert keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mib in range(1, 17):
    block = np.ones(mib << 20, np.uint8)
    del block
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, env=None) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], env=env, check=True,
                         capture_output=True, text=True)
    return int(out.stdout)


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    plain = _faults("plain", {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
    assert plain > 25_000  # 136 MiB of 4 KiB pages = 34,816
    assert _faults("mallopt") < plain / 4  # in a running process
    assert _faults("plain", with_malloc_tunables(dict(os.environ))) < plain / 4  # at start


def test_tunables_merge_with_the_callers_own():
    env = with_malloc_tunables({"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert sorted(env["GLIBC_TUNABLES"].split(":")) == sorted(f"{k}={v}" for k, v in TUNABLES.items())
    mine = with_malloc_tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.pthread.rseq=0"})
    parts = mine["GLIBC_TUNABLES"].split(":")
    assert parts[:2] == ["glibc.malloc.hugetlb=0", "glibc.pthread.rseq=0"]  # the caller's win
    assert "glibc.malloc.hugetlb=1" not in parts and len(parts) == 4


def test_cpu_device_flags():
    w = jax_platform.with_cpu_devices
    assert w("--xla_cpu_foo=1", 4) == f"--xla_cpu_foo=1 {TIMEOUT} {DEVICES}=4"
    assert w(f"{DEVICES}=2 --xla_cpu_foo=1", 4) == f"--xla_cpu_foo=1 {TIMEOUT} {DEVICES}=4"
    assert w(f"{DEVICES}=8", 4) == f"{DEVICES}=8 {TIMEOUT}"  # more than asked for: kept
    assert w(f"{DEVICES}=8", 4, exact=True) == f"{TIMEOUT} {DEVICES}=4"
    assert w("", 1) == "" and w(f"{DEVICES}=3", 1) == f"{DEVICES}=3"
    assert w("", 1, exact=True) == f"{DEVICES}=1"
    assert w("--xla_cpu_collective_call_terminate_timeout_seconds=9", 2).count("timeout") == 1
    assert jax_platform.without_cpu_devices(f"--a=1 {DEVICES}=4 --b=2") == "--a=1 --b=2"
    assert jax_platform.cpu_device_count(f"--a=1 {DEVICES}=4") == 4
    assert jax_platform.cpu_device_count("--a=1") is None


def test_request_cpu_devices_sets_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_foo=1 {DEVICES}=2")
    jax_platform.request_cpu_devices(4)
    assert os.environ["XLA_FLAGS"] == f"--xla_cpu_foo=1 {TIMEOUT} {DEVICES}=4"
    monkeypatch.delenv("XLA_FLAGS")
    jax_platform.request_cpu_devices(1)
    assert "XLA_FLAGS" not in os.environ


def test_ensure_cpu_devices_checks_what_jax_has():
    assert jax_platform.ensure_cpu_devices(2) == 8  # the session's 8 (tests/conftest.py)
    with pytest.raises(RuntimeError, match="need 64 devices"):
        jax_platform.ensure_cpu_devices(64)


def test_child_environment():
    env = {"XLA_FLAGS": f"--a=1 {DEVICES}=8", "PATH": "/bin"}
    child = jax_platform.child_environment(env)
    assert child["XLA_FLAGS"] == "--a=1" and child["PATH"] == "/bin"
    assert child["GLIBC_TUNABLES"] == with_malloc_tunables({})["GLIBC_TUNABLES"]
    child = jax_platform.child_environment(env, malloc_tunables=False, cpu_devices=2)
    assert child["XLA_FLAGS"] == f"--a=1 {TIMEOUT} {DEVICES}=2" and "GLIBC_TUNABLES" not in child
    assert "XLA_FLAGS" not in jax_platform.child_environment({"XLA_FLAGS": f"{DEVICES}=8"})


def test_default_compilation_cache_dir_is_read_when_asked():
    d = jax_platform.default_compilation_cache_dir
    assert d({"HOME": "/h"}) == "/h/.cache/gemma3-equarx/jax-compile-cache"
    assert d({"HOME": "/h", "XDG_CACHE_HOME": "/x"}) == "/x/gemma3-equarx/jax-compile-cache"


# In a fresh interpreter: importing the CLI, the config and eval's modules that set processes up
# changes neither the environment nor jax's state (no jax import at all); the cache directory
# follows HOME as it is when a config is made, not when the module was imported; and
# enable_compilation_cache sets the one set of cache options.
_IMPORTS = """
import json, os, sys
before = dict(os.environ)
import serving.cli, serving.config, jax_platform, serving.distributed
import eval.bench_engine, eval.bench_serving, eval.multiproc
imported_jax = "jax" in sys.modules
os.environ.pop("XDG_CACHE_HOME", None)
os.environ["HOME"] = sys.argv[1]
cache_dir = serving.config.ServerConfig().compile_cache_dir
os.environ.clear(); os.environ.update(before)
unchanged = dict(os.environ) == before
import jax
on = jax_platform.enable_compilation_cache(sys.argv[2])
off = jax_platform.enable_compilation_cache("")
print(json.dumps({"jax": imported_jax, "env_unchanged": unchanged, "cache_dir": cache_dir,
                  "on": on, "off": off, "dir": jax.config.jax_compilation_cache_dir,
                  "min_time": jax.config.jax_persistent_cache_min_compile_time_secs,
                  "min_size": jax.config.jax_persistent_cache_min_entry_size_bytes}))
"""


def test_imports_change_nothing_and_the_cache_settings_are_one(tmp_path):
    out = subprocess.run([sys.executable, "-c", _IMPORTS, str(tmp_path / "home"), str(tmp_path / "cc")],
                         check=True, capture_output=True, text=True, timeout=300)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["jax"] is False and r["env_unchanged"] is True
    assert r["cache_dir"] == str(tmp_path / "home" / ".cache" / "gemma3-equarx" / "jax-compile-cache")
    assert (r["on"], r["off"], r["dir"]) == (True, False, str(tmp_path / "cc"))
    assert (r["min_time"], r["min_size"]) == (0, -1)
