"""Setting up a process to run JAX: virtual CPU devices, XLA flags, the persistent compilation
cache, glibc malloc, and joining a multi-process group; the one copy of it, for the command-line
tools, eval/ and the tests.

A top-level package below every other, importing nothing from the project and no jax at module
level, so any package may use it. Nothing happens at import; `request_cpu_devices` and
`join_process_group` must run before JAX starts its backend. See docs/deployment.md, "Process
set-up"."""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import logging
import os
import re
import sys
from typing import Mapping

log = logging.getLogger(__name__)

# ---- XLA flags and virtual CPU devices ----

DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"
COLLECTIVE_TIMEOUT_FLAG = "xla_cpu_collective_call_terminate_timeout_seconds"
_DEVICE_COUNT = re.compile(rf"--{DEVICE_COUNT_FLAG}=(\d+)")


def with_collective_timeout(flags: str, seconds: int = 600) -> str:
    """`flags` plus a longer wait for a collective's device threads, unless they set one.

    Virtual devices share the host's cores, and XLA:CPU aborts the process when a collective's
    device threads have not all met after 40 s (its default), which an oversubscribed machine
    can exceed."""
    if COLLECTIVE_TIMEOUT_FLAG in flags:
        return flags
    return f"{flags} --{COLLECTIVE_TIMEOUT_FLAG}={seconds}".strip()


def cpu_device_count(flags: str) -> int | None:
    """The CPU device count `flags` asks for, or None."""
    m = _DEVICE_COUNT.search(flags)
    return int(m.group(1)) if m else None


def with_cpu_devices(flags: str, n: int, exact: bool = False) -> str:
    """`flags` asking XLA:CPU for at least `n` devices (a larger count already there stays unless
    `exact`), with the longer collective timeout when there are several (GPU/TPU backends ignore
    both)."""
    have = cpu_device_count(flags)
    if n > 1:
        flags = with_collective_timeout(flags)
    if have == n or (not exact and (n <= 1 or (have is not None and have >= n))):
        return flags
    return f"{without_cpu_devices(flags)} --{DEVICE_COUNT_FLAG}={n}".strip()


def without_cpu_devices(flags: str) -> str:
    """`flags` with no device count (for a child process that decides its own)."""
    return " ".join(f for f in flags.split() if DEVICE_COUNT_FLAG not in f)


def request_cpu_devices(n: int, exact: bool = False) -> None:
    """Ask XLA:CPU for at least `n` devices (exactly `n` if `exact`) in this process: sets
    XLA_FLAGS, no jax import. Call before JAX's backend starts; afterwards it is too late and a
    warning says so."""
    flags = os.environ.get("XLA_FLAGS", "")
    new = with_cpu_devices(flags, n, exact)
    if new != flags:
        os.environ["XLA_FLAGS"] = new
        if _backend_started():
            log.warning("JAX's backend started before XLA_FLAGS asked for %d CPU devices; "
                        "they may not be there", n)


def ensure_cpu_devices(n: int, exact: bool = False) -> int:
    """`request_cpu_devices(n, exact)`, then check that JAX sees at least `n` devices (imports
    jax). Returns the device count; RuntimeError with what to do when there are fewer."""
    request_cpu_devices(n, exact)
    import jax

    have = jax.device_count()
    if have < n:
        raise RuntimeError(f"need {n} devices, this process has {have}; set XLA_FLAGS="
                           f"--{DEVICE_COUNT_FLAG}={n} before starting Python")
    return have


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


# ---- the persistent compilation cache ----

def default_compilation_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """$XDG_CACHE_HOME/gemma3-equarx/jax-compile-cache (~/.cache/... without it), computed when
    asked, from `environ` (default: os.environ)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gemma3-equarx", "jax-compile-cache")


def enable_compilation_cache(directory: str | os.PathLike | None) -> bool:
    """Keep every compiled executable in `directory` (JAX's persistent compilation cache) so that
    a restart reads them back instead of compiling. Every program is kept, however small or
    quick to compile: on CPU even the small ones take 0.1-0.5 s to compile and read back faster
    (min compile time 0; min entry size -1, which also stops JAX from raising it per
    filesystem). A false `directory` leaves the cache off. Returns whether it is on."""
    if not directory:
        return False
    import jax

    jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return True


# ---- glibc malloc (see the module docstring) ----

MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for the mmap threshold on 64-bit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc's dynamic adjustment pairs with it
TUNABLES = {
    "glibc.malloc.hugetlb": "1",
    "glibc.malloc.mmap_threshold": str(MMAP_THRESHOLD),
    "glibc.malloc.trim_threshold": str(TRIM_THRESHOLD),
}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def with_malloc_tunables(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` whose GLIBC_TUNABLES also holds `TUNABLES` (settings already there win)."""
    current = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    named = {t.split("=", 1)[0] for t in current}
    merged = current + [f"{k}={v}" for k, v in TUNABLES.items() if k not in named]
    return {**env, "GLIBC_TUNABLES": ":".join(merged)}


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Raise this process's mmap and trim thresholds (glibc only; once per process), so freed
    blocks up to 32 MiB are reused instead of unmapped. Returns whether they were set."""
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


def child_environment(env: Mapping[str, str] | None = None, *, malloc_tunables: bool = True,
                      cpu_devices: int | None = None) -> dict[str, str]:
    """The environment for a JAX child process (a server, a benchmark worker): `env` (default
    os.environ) without this process's CPU device count, with `cpu_devices` if given, and with
    the malloc tunables unless `malloc_tunables` is false."""
    out = dict(os.environ if env is None else env)
    flags = without_cpu_devices(out.get("XLA_FLAGS", ""))
    if cpu_devices is not None:
        flags = with_cpu_devices(flags, cpu_devices)
    if flags:
        out["XLA_FLAGS"] = flags
    else:
        out.pop("XLA_FLAGS", None)
    return with_malloc_tunables(out) if malloc_tunables else out


# ---- joining a multi-process group (JAX's distributed runtime) ----

EXIT_GROUP_NOT_FORMED = 4  # exit status when a process group cannot form in time


class GroupFormationError(RuntimeError):
    """The process group did not form within its deadline."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """How this process joins a group. `coordinator_address=None` with `auto=True` lets jax
    detect the cluster itself (Cloud TPU VM slices, SLURM, ...).

    Forming a group under uneven load: processes may start, load their weights and compile at
    very different times (a busy machine, a cold compilation cache on one host). Joining waits
    up to `join_timeout_s` for every process to connect; then every process waits at a barrier
    (the coordination service's, no collective) once its weights are loaded and again once its
    programs are compiled, for up to `load_timeout_s`, so that all of them enter their first
    collective together: gloo's own first rendezvous gives up after a fixed 30 s. A group that
    cannot form ends every process that is up with a clear error within those deadlines.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    heartbeat_timeout_s: int = 30  # jax's coordination service declares a silent process dead
    # The step watchdog's limits (serving's settings `step_timeout`, `compile_timeout`): the
    # longest run of (or wait for) one step, and of one whose shapes run for the first time.
    step_timeout_s: float = 30.0
    compile_timeout_s: float = 600.0
    heartbeat_s: float = 2.0  # serving: process 0 broadcasts an idle step this often
    join_timeout_s: int = 600  # every process must have connected to the coordinator by then
    load_timeout_s: float = 1800.0  # longest wait at the loaded/compiled barriers
    shutdown_timeout_s: int = 30  # jax's wait for the other processes at exit

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.num_processes is not None \
                and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.coordinator_address is not None and (self.num_processes is None or self.process_id is None):
            raise ValueError("--coordinator-address needs --num-processes and --process-id")
        if self.coordinator_address is None and not self.auto and (
                self.num_processes not in (None, 1) or self.process_id not in (None, 0)):
            raise ValueError("--num-processes/--process-id need --coordinator-address (or --distributed auto)")
        if self.heartbeat_timeout_s < 1 or self.step_timeout_s <= 0 or self.compile_timeout_s <= 0 \
                or self.heartbeat_s <= 0 \
                or self.join_timeout_s < 1 or self.load_timeout_s <= 0 or self.shutdown_timeout_s < 1:
            raise ValueError("timeouts must be positive")
        if self.heartbeat_s >= self.step_timeout_s:
            raise ValueError("heartbeat_s must be shorter than step_timeout_s")

    @property
    def enabled(self) -> bool:
        return self.auto or (self.coordinator_address is not None and (self.num_processes or 1) > 1)

    def local_device_count(self, tp: int) -> int:
        """Devices this process contributes to a tp-wide mesh (its virtual CPU devices)."""
        n = (self.num_processes or 1) if self.enabled else 1
        if tp % n:
            raise ValueError(f"tp={tp} must be a multiple of the number of processes ({n})")
        return tp // n


# flag dest -> (environment variables, most specific first; type; help)
GROUP_FLAGS: dict[str, tuple[tuple[str, ...], type, str]] = {
    "coordinator_address": (("GEMMA3_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS"), str,
                            "host:port of process 0's coordination service (multi-host)"),
    "num_processes": (("GEMMA3_NUM_PROCESSES", "JAX_NUM_PROCESSES"), int, "processes in the group"),
    "process_id": (("GEMMA3_PROCESS_ID", "JAX_PROCESS_ID"), int, "this process's index (0 serves HTTP)"),
    "distributed": (("GEMMA3_DISTRIBUTED",), str,
                    "'auto': let jax detect the cluster (Cloud TPU VM slice; the default when "
                    "TPU_WORKER_HOSTNAMES lists several hosts); 'off'"),
    "heartbeat_timeout": (("GEMMA3_HEARTBEAT_TIMEOUT",), int,
                          "seconds after which a silent process counts as dead (default 30)"),
    "join_timeout": (("GEMMA3_JOIN_TIMEOUT",), int,
                     "seconds every process has to start and connect to process 0's coordinator "
                     "(default 600)"),
    "load_timeout": (("GEMMA3_LOAD_TIMEOUT",), float,
                     "seconds a process waits for the others to load their weights and compile "
                     "(default 1800; raise it for large models on slow disks)"),
}


def add_group_arguments(parser, only: tuple[str, ...] | None = None) -> None:
    """The multi-host flags (`--coordinator-address` ...); unset flags stay None."""
    group = parser.add_argument_group("multi-host (JAX distributed runtime)")
    for dest, (envs, kind, help) in GROUP_FLAGS.items():
        if only is not None and dest not in only:
            continue
        choices = ("auto", "off") if dest == "distributed" else None
        group.add_argument("--" + dest.replace("_", "-"), type=kind, default=None, choices=choices,
                           help=f"{help} (env {' or '.join(envs)})")


def group_from(values: Mapping[str, object], env: Mapping[str, str] | None = None) -> ProcessGroup:
    """Flags (None = not given) over environment variables over defaults. The watchdog's
    `step_timeout` and `compile_timeout` are server settings (`serving.config`): taken from
    `values` alone."""
    env = os.environ if env is None else env
    merged: dict[str, object] = {}
    for dest, (envs, kind, _) in GROUP_FLAGS.items():
        v = values.get(dest)
        if v is None:
            v = next((env[e] for e in envs if env.get(e)), None)
        if v is not None:
            try:
                merged[dest] = kind(v)
            except ValueError:
                raise ValueError(f"{dest}: cannot use {v!r}") from None
    # GKE and some TPU VM images name every host of the slice: several hosts means multi-host.
    multi_host_tpu = len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1
    default = "auto" if multi_host_tpu and "coordinator_address" not in merged else "off"
    mode = merged.pop("distributed", default)
    if mode not in ("auto", "off"):
        raise ValueError(f"distributed must be 'auto' or 'off', got {mode!r}")
    kw = {}
    if "heartbeat_timeout" in merged:
        kw["heartbeat_timeout_s"] = merged.pop("heartbeat_timeout")
    if "join_timeout" in merged:
        kw["join_timeout_s"] = merged.pop("join_timeout")
    if "load_timeout" in merged:
        kw["load_timeout_s"] = merged.pop("load_timeout")
    if values.get("step_timeout") is not None:
        kw["step_timeout_s"] = float(values["step_timeout"])
        kw["heartbeat_s"] = min(2.0, kw["step_timeout_s"] / 4)
    if values.get("compile_timeout") is not None:
        kw["compile_timeout_s"] = float(values["compile_timeout"])
    return ProcessGroup(auto=mode == "auto", **merged, **kw)


_joined: ProcessGroup | None = None  # the group this process joined


def join_process_group(group: ProcessGroup) -> None:
    """Join the group; must run before any other jax use. CPU collectives between processes go
    through gloo (TCP); TPU/GPU backends use their own interconnect. Raises GroupFormationError
    when not every process connected within `group.join_timeout_s`."""
    global _joined
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = dict(heartbeat_timeout_seconds=group.heartbeat_timeout_s,
                    initialization_timeout=group.join_timeout_s,
                    shutdown_timeout_seconds=group.shutdown_timeout_s)
    import threading

    def not_formed(cause: str) -> GroupFormationError:
        return GroupFormationError(
            f"the process group did not form: not every one of its {group.num_processes or 'N'} "
            f"processes connected to the coordinator {group.coordinator_address or '(auto)'} within "
            f"{group.join_timeout_s}s (--join-timeout); start them all, or check the address and "
            f"port{cause}")

    log.info("joining a group of %s processes at %s: waiting up to %ds for all of them "
             "(--join-timeout)", group.num_processes or "N", group.coordinator_address or "(auto)",
             group.join_timeout_s)
    # jax's client ends the process from C++ when its registration times out, with a message
    # that names no cause; say it first.
    timer = threading.Timer(group.join_timeout_s, lambda: exit_group_not_formed(not_formed("")))
    timer.daemon = True
    timer.start()
    try:
        if group.auto and group.coordinator_address is None:
            jax.distributed.initialize(**timeouts)
        else:
            jax.distributed.initialize(group.coordinator_address, group.num_processes,
                                       group.process_id, **timeouts)
    except Exception as e:
        raise not_formed(f" ({type(e).__name__}: {str(e)[:300]})") from e
    finally:
        timer.cancel()
    _joined = group
    log.info("process %d of %d joined: %d local / %d global %s devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count(), jax.default_backend())


def group_barrier(name: str, timeout_s: float | None = None) -> None:
    """Wait until every process of the joined group reaches barrier `name` (through the
    coordination service, so no collective and no gloo deadline), for up to `timeout_s`
    (default: the group's `load_timeout_s`). No-op outside a group. Raises GroupFormationError
    naming the barrier when the others do not arrive in time."""
    if _joined is None:
        return
    import time

    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    timeout_s = _joined.load_timeout_s if timeout_s is None else timeout_s
    t0 = time.monotonic()
    log.info("waiting up to %.0fs for every process: %s", timeout_s, name)
    try:
        client.wait_at_barrier(f"gemma3:{name}", int(timeout_s * 1000))
    except Exception as e:
        raise GroupFormationError(
            f"the process group did not form: not every process was {name} within {timeout_s:.0f}s "
            f"(--load-timeout); another process is still loading, has died, or never started "
            f"({type(e).__name__}: {str(e)[:300]})") from e
    log.info("every process %s (waited %.1fs)", name, time.monotonic() - t0)


def exit_group_not_formed(error: BaseException) -> None:
    """Report a group that cannot form and end this process at once (jax's exit would wait for
    the other processes at its shutdown barrier)."""
    text = f"FATAL: {error}"
    log.critical("%s", text)
    print(text, file=sys.stderr, flush=True)
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(EXIT_GROUP_NOT_FORMED)
