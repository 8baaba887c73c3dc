"""Host memory allocation settings for CPU runs (glibc malloc).

glibc serves every allocation above its mmap threshold (128 KiB at start, raised dynamically
only after a large block is freed) with a fresh mmap, returns it to the kernel on free, and the
kernel zero-fills it again page by page on the next first touch. XLA:CPU allocates its buffers
and temporaries per execution and numpy its temporaries per operation, so each run of a program
over tens of MiB pays thousands of 4 KiB page faults: measured on this project's 2-core machine,
30-45 ms of a 64 MiB AllReduce (both the int8 and the bf16 ring; see README, Measuring) and half
of the GGUF decode (1.2 s -> 0.65 s).

Two remedies, both plain glibc features:
- `keep_freed_memory()`: in a running process, raise the mmap threshold to glibc's maximum
  (32 MiB) and the trim threshold with it (`mallopt`), so freed blocks up to that size are
  reused instead of unmapped (what glibc's own dynamic threshold does after its first large
  free, made deterministic).
- `with_malloc_tunables(env)`: for a process about to start, the same thresholds plus
  `glibc.malloc.hugetlb=1`, which backs large mmaps with transparent huge pages (2 MiB pages:
  512x fewer faults) where the kernel's THP mode is "madvise". Tunables are read at process
  start only, hence an environment for child processes (or the container's ENV).

Neither changes results; both only change where memory comes from. Other C libraries: no-ops.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for the mmap threshold on 64-bit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc's dynamic adjustment pairs with it
TUNABLES = {
    "glibc.malloc.hugetlb": "1",
    "glibc.malloc.mmap_threshold": str(MMAP_THRESHOLD),
    "glibc.malloc.trim_threshold": str(TRIM_THRESHOLD),
}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def with_malloc_tunables(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` whose GLIBC_TUNABLES also holds `TUNABLES` (settings already there win)."""
    current = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    named = {t.split("=", 1)[0] for t in current}
    merged = current + [f"{k}={v}" for k, v in TUNABLES.items() if k not in named]
    return {**env, "GLIBC_TUNABLES": ":".join(merged)}


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Raise this process's mmap and trim thresholds (glibc only; once per process). Returns
    whether they were set."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc, not musl or macOS
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def malloc_label(plain: bool, child_processes: bool) -> str:
    """How a benchmark run's memory was set up, for its report."""
    if plain:
        return "glibc defaults"
    if child_processes:
        return "GLIBC_TUNABLES " + ":".join(f"{k}={v}" for k, v in TUNABLES.items())
    return f"mallopt mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim {TRIM_THRESHOLD >> 20} MiB"
