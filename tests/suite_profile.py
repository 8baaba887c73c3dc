"""Where the test suite's time goes: a pytest plugin that records every test's cost, and the
per-file report of what it recorded.

    python -m pytest -p tests.suite_profile     # one JSON line per test, per worker process
    python -m tests.suite_profile               # the per-file table, costliest first

Per test: wall seconds, CPU seconds of the test process, CPU seconds of the child processes it
started and waited for (servers, process groups, interpret-mode children; the kernel counts a
child once it is reaped), and XLA backend-compile seconds and program count in the test process
(`eval.compile_events`, counted from the first test that runs after jax is imported), and how
many programs it read back from the persistent compilation cache instead. Records go to $SUITE_PROFILE_DIR (default .suite-profile/), one file per process,
so xdist workers do not interleave; the directory is emptied by the controller at the start.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import pytest

from eval.compile_events import record_compiles
from eval.reports import format_columns

DIR_ENV = "SUITE_PROFILE_DIR"
DEFAULT_DIR = ".suite-profile"

_compiles: list[float] = []
_hits: list[float] = []
_listening = False


def _directory() -> Path:
    return Path(os.environ.get(DIR_ENV, DEFAULT_DIR))


def _listen_once_jax_is_here() -> None:
    # Importing jax here would start it in processes (and tests) that never use it.
    global _listening
    if not _listening and "jax" in sys.modules:
        record_compiles(_compiles, _hits)
        _listening = True


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        shutil.rmtree(_directory(), ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _listen_once_jax_is_here()
    _compiles.clear()
    _hits.clear()
    t0, own0 = time.perf_counter(), _cpu(resource.RUSAGE_SELF)
    kids0 = _cpu(resource.RUSAGE_CHILDREN)
    yield
    record = dict(test=item.nodeid, pid=os.getpid(), wall_s=time.perf_counter() - t0,
                  cpu_s=_cpu(resource.RUSAGE_SELF) - own0,
                  child_cpu_s=_cpu(resource.RUSAGE_CHILDREN) - kids0,
                  compile_s=sum(_compiles), programs=len(_compiles), cache_hits=len(_hits))
    directory = _directory()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


# ---- the report ----

FIELDS = ("wall_s", "cpu_s", "child_cpu_s", "compile_s", "programs", "cache_hits")


def read_records(directory: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for path in sorted(Path(directory).glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def rank_s(row: dict) -> float:
    """A file's cost for tests/conftest.py's LONG_FILES_FIRST: its CPU seconds with its children,
    or 0.7 x its wall time where it mostly waits (on sleeps, or on other processes' work)."""
    return max(row["cpu_s"] + row["child_cpu_s"], 0.7 * row["wall_s"])


def per_file(records: list[dict]) -> list[dict]:
    """One row per test file: the sums of its tests' fields, costliest (`rank_s`) first."""
    sums: dict[str, dict] = collections.defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    for r in records:
        row = sums[r["test"].split("::", 1)[0]]
        for key in FIELDS:
            row[key] += r.get(key, 0)  # records written before a field existed lack it
    rows = [dict(file=f, **row) for f, row in sums.items()]
    return sorted(rows, key=lambda r: -rank_s(r))


def format_report(records: list[dict], top: int | None = None) -> str:
    rows = per_file(records)
    total = {key: sum(r[key] for r in rows) for key in FIELDS}
    workers = len({r["pid"] for r in records})
    title = (f"{len(records)} tests in {len(rows)} files; CPU {total['cpu_s']:.0f} s in the test "
             f"processes + {total['child_cpu_s']:.0f} s in their children; XLA compile "
             f"{total['compile_s']:.0f} s ({total['programs']} programs; "
             f"{total['cache_hits']} more read from the cache)"
             + (f"; {workers} processes" if workers > 1 else ""))
    table = format_columns(rows[:top], [
        ("wall s", ">8", lambda r: f"{r['wall_s']:.1f}"),
        ("cpu s", ">8", lambda r: f"{r['cpu_s']:.1f}"),
        ("child s", ">8", lambda r: f"{r['child_cpu_s']:.1f}"),
        ("compile s", ">9", lambda r: f"{r['compile_s']:.1f}"),
        ("programs", ">8", lambda r: str(r["programs"])),
        ("rank s", ">7", lambda r: f"{rank_s(r):.0f}"),
        ("file", "", lambda r: r["file"])])
    return title + "\n" + table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", nargs="?", default=os.environ.get(DIR_ENV, DEFAULT_DIR))
    p.add_argument("--top", type=int, default=None, help="only the N costliest files")
    args = p.parse_args(argv)
    records = read_records(args.directory)
    if not records:
        p.error(f"no records in {args.directory}: run python -m pytest -p tests.suite_profile")
    print(format_report(records, args.top))


if __name__ == "__main__":
    main()
