"""serving.host_memory: glibc malloc settings that stop large host buffers from being
page-faulted afresh on every use."""
import os
import subprocess
import sys

from serving.host_memory import TUNABLES, with_malloc_tunables

# Allocate, touch and free 1, 2, ..., 16 MiB (numpy's own huge-page advice off, so that pages
# are 4 KiB); print the minor page faults that took. glibc's default mmaps each block (they
# grow past its dynamic threshold every time) and the kernel faults all 136 MiB in; with the
# thresholds raised the heap grows to 16 MiB once and is reused.
_FAULTS = """
import resource, sys, numpy as np
np._core.multiarray._set_madvise_hugepage(False)
if sys.argv[1] == "mallopt":
    from serving.host_memory import keep_freed_memory
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
