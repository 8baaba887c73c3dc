"""Native CPU kernels of the group codec as XLA FFI handlers, built on first use: the all-gather's
un-rotation (csrc/unrotate_cpu.cc), the encode fused with the sum before it (csrc/encode_cpu.cc),
and the product with int8 weights in groups of the contracted dim (csrc/grouped_matmul_cpu.cc).

The codec kernels give the pure-JAX forms' bits and change speed only. Built with `$CXX` and
`-march=native` into a cache keyed by sources, jaxlib and processor; without a compiler, or with
`EQUARX_NATIVE_CPU=0`, the JAX forms run. See docs/deployment.md, "CPU-only machines"."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from equarx import codec_spec

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "unrotate_cpu.cc", CSRC / "encode_cpu.cc", CSRC / "grouped_matmul_cpu.cc")
HEADERS = (CSRC / "group_codec.h",)
TARGET = "equarx_unrotate_cpu"
ENCODE_TARGET = "equarx_encode_sum_cpu"
GATHER_TARGET = "equarx_gather_unrotate_cpu"
MATMUL_TARGET = "equarx_grouped_matmul_cpu"
TARGETS = (TARGET, ENCODE_TARGET, GATHER_TARGET, MATMUL_TARGET)
CODE_IDS = codec_spec.CODE_IDS  # the kernel's `code` attribute
_LOCK = threading.Lock()


def _cache_dir() -> Path:
    if os.environ.get("EQUARX_CACHE_DIR"):
        return Path(os.environ["EQUARX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "equarx"


def _cpu_flags() -> str:
    """The processor's feature flags (the build uses -march=native, so a cache shared across
    machines must not hand one processor's build to another)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(compiler: str, arch: str = "native", directory: Path | None = None) -> Path:
    """The kernels' shared library for `-march=arch`, built unless the cache has it."""
    import jaxlib

    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    # -ffp-contract=off: a product and a sum are never fused into one rounding (the kernels
    # give the pure-JAX form's bits).
    flags = ["-O3", f"-march={arch}", "-std=c++17", "-ffp-contract=off", "-fPIC", "-w",
             *codec_spec.cpp_defines()]  # the codec's constants: codec_spec
    key = hashlib.sha256(b"\0".join([source, jaxlib.__version__.encode(), _cpu_flags().encode(),
                                     " ".join(flags).encode(), platform.machine().encode()]))
    directory = directory or _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    lib = directory / f"group_codec_cpu-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    # Built beside its final name and moved there in one step: processes that build at once
    # (one per device in a multi-process group) never load a half-written file.
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
    os.close(fd)
    objects = [f"{tmp}.{i}.o" for i in range(len(SOURCES))]
    try:
        # One compiler a source, side by side, then the link: a server's first start waits for
        # this (-O3 takes ~8 s a source on a slow core), and the sources are independent.
        _run_together([[compiler, *flags, "-c", "-I", jax.ffi.include_dir(), str(src), "-o", obj]
                       for src, obj in zip(SOURCES, objects)])
        _run_together([[compiler, *flags, "-shared", *objects, "-o", tmp]])
        os.replace(tmp, lib)
    finally:
        for path in (tmp, *objects):
            if os.path.exists(path):
                os.unlink(path)
    return lib


def _run_together(commands: list[list[str]], timeout: float = 300) -> None:
    """Runs the commands at once; raises CalledProcessError (with its stderr) for the first
    that fails, after all have ended."""
    procs = []
    try:
        for command in commands:
            procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for command, p, (out, err) in zip(commands, procs, outs):
        if p.returncode:
            raise subprocess.CalledProcessError(p.returncode, command, out, err)


def register(lib: Path, suffix: str = "") -> tuple[str, ...]:
    """Registers the library's kernels as the CPU FFI targets TARGETS, each + suffix; returns
    those names."""
    loaded = ctypes.cdll.LoadLibrary(str(lib))
    names = tuple(t + suffix for t in TARGETS)
    handlers = (loaded.EquarxUnrotate, loaded.EquarxEncodeSum, loaded.EquarxGatherUnrotate,
                loaded.EquarxGroupedMatmul)
    for name, handler in zip(names, handlers):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
    return names


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@functools.cache
def _load() -> bool:
    if os.environ.get("EQUARX_NATIVE_CPU", "1") == "0":
        return False
    cxx = compiler()
    if cxx is None:
        log.warning("equarx: no C++ compiler found; the CPU codec kernels run as pure "
                    "JAX (same results, slower)")
        return False
    try:
        register(build(cxx))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("equarx: building the native CPU codec kernels failed; they run as "
                    "pure JAX (same results, slower): %s", detail[-2000:])
        return False
    return True


def available() -> bool:
    """Whether the native kernels are built and registered (building them on first call)."""
    with _LOCK:
        return _load()


def build_in_background() -> None:
    """On the CPU backend, build (or find) and register the kernels on a thread: a caller that
    will trace programs calling them starts the build (seconds, the first time on a machine)
    beside its other work; `available()` and `in_use()` wait for it."""
    if jax.default_backend() == "cpu":
        threading.Thread(target=available, name="equarx-native-cpu-build", daemon=True).start()


def in_use() -> bool:
    """Whether programs traced now call the native kernels: on the CPU backend, once built."""
    return jax.default_backend() == "cpu" and available()


def unrotate(codes: jax.Array, steps: jax.Array, exponents: jax.Array, mt: np.ndarray,
             code: str, out_dtype, target: str = TARGET) -> jax.Array:
    """`groups.unrotate_codes` as the native kernel (CPU only; call `available()` first):
    codes int8[..., C] (`code` "int8", "fp8": C = W; "int4": W / 2), their runs' step bytes
    int8[..., W / g] and rows' exponent bytes int8[..., 1], mt = M^T float32[g, g] ->
    out_dtype[..., W]."""
    width = codes.shape[-1] * (2 if code == "int4" else 1)
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*codes.shape[:-1], width), out_dtype),
                           vmap_method="broadcast_all")(
        codes, steps, exponents, np.ascontiguousarray(mt, np.float32),
        code=np.int64(CODE_IDS[code]))
    return _varying_like(out, codes)


def gather_unrotate(device: jax.Array, wires, mt: np.ndarray, code: str, out_dtype,
                    out_shape: tuple[int, ...], geometries: list[dict],
                    target: str = GATHER_TARGET) -> jax.Array:
    """The all-gather's end (`codecs.GroupCodec.unrotate_gathered`) as the native kernel (CPU
    only; call `available()` first): device an int32 scalar, wires the arrived wire bytes of N
    relative shards x P pieces (shard-major), geometries each piece's `piece_geometry` in the
    output buffer of `out_shape` -> that buffer in out_dtype, every value un-rotated in place."""
    first = geometries[0]
    if any({k: g[k] for k in first if k not in ("base", "pieces")}
           != {k: first[k] for k in first if k not in ("base", "pieces")} for g in geometries):
        raise ValueError("the pieces of one all-gather share their rows, width and strides")
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, out_dtype),
                           vmap_method="sequential")(
        jnp.asarray(device, jnp.int32), np.ascontiguousarray(mt, np.float32), *wires,
        code=np.int64(CODE_IDS[code]),
        bases=np.array([g["base"] for g in geometries], np.int64),
        counts=np.array([g["pieces"] for g in geometries], np.int64),
        **{k: np.int64(first[k]) for k in ("rows", "width", "row_stride", "shard_stride",
                                            "shards")})
    return _varying_like(out, wires[0])


def encode_sum(buf: jax.Array, shard: jax.Array, arrivals, geometry: dict, group: int, code: str,
               target: str = ENCODE_TARGET) -> jax.Array:
    """`codecs.encode_sum` as the native kernel (CPU only; call `available()` first):
    buf bfloat16 or float32 (the layout's buffer), shard an int32 scalar, arrivals wire bytes
    int8[pieces, .] of the piece, geometry the piece's rows in buf
    (`TokenLayout.piece_geometry`) -> the piece's wire bytes, as `groups.encode` lays them out."""
    pieces, rows, width = geometry["pieces"], geometry["rows"], geometry["width"]
    codes = rows * width // 2 if code == "int4" else rows * width
    shape = (pieces, codes + rows * (width // group + 1))
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, np.int8),
                           vmap_method="sequential")(
        buf.reshape(-1), jnp.asarray(shard, jnp.int32), *arrivals, code=np.int64(CODE_IDS[code]),
        group=np.int64(group), **{k: np.int64(v) for k, v in geometry.items()})
    return _varying_like(out, buf)


def grouped_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array,
                   target: str = MATMUL_TARGET) -> jax.Array:
    """x float32[R, K] times int8 codes[K, N] with a scale (bfloat16 or float32) per group of
    K / scale.shape[0] rows of the codes and column -> float32[R, N] (CPU only; call
    `available()` first). Each group's products are summed in float32, then scaled."""
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], codes.shape[1]), np.float32),
                           vmap_method="sequential")(x, codes, scale)
    return _varying_like(out, x, codes, scale)


def _varying_like(out: jax.Array, *like: jax.Array) -> jax.Array:
    """Inside shard_map the result varies over the mesh axes its inputs vary over, as the
    pure-JAX form's does (an FFI call's result carries no such type of its own)."""
    varying = set()
    for x in like:
        manual = getattr(jax.typeof(x), "manual_axis_type", None)
        varying |= set(manual.varying) if manual is not None else set()
    return lax.pcast(out, tuple(sorted(varying)), to="varying") if varying else out
