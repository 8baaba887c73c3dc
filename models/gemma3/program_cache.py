"""Traced programs kept on disk (`jax.export`), so that a restart skips Python tracing and lowering;
the executables come from JAX's persistent compilation cache.

A program is reused only under the same key (sources, jax versions, backend, static settings, native
kernels, argument signature); anything else that changes tracing goes in `salt`. Single-process
only. Files are pickles, i.e. code: the directory must be writable by its user only."""
from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from equarx import native_cpu

log = logging.getLogger(__name__)

SUFFIX = ".jaxprog"
_FORMAT = 2  # bump when the file layout or the signature changes
_MEMO_MIN_LEAVES = 64


@functools.cache
def source_fingerprint(packages: Sequence[str] = ("models", "equarx")) -> str:
    """sha256 over the Python and C++ sources of `packages` (paths and bytes), jax/jaxlib
    versions."""
    import importlib

    import jaxlib

    h = hashlib.sha256(f"format{_FORMAT} jax{jax.__version__} jaxlib{jaxlib.__version__}".encode())
    for name in packages:
        root = Path(importlib.import_module(name).__file__).parent
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h")):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _placed(leaf, default):
    """A jax array or ShapeDtypeStruct with a sharding: host values and sharding-less
    ShapeDtypeStructs get `default` (what jit does with them under a replicated in-spec)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        if leaf.sharding is None:
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=default)
        return leaf
    if isinstance(leaf, jax.Array):
        return leaf
    return jax.device_put(np.asarray(leaf), default)


def _leaf_signature(leaf) -> str:
    """Shape, dtype and where the value lives, canonically: as the XLA sharding it lowers to
    (a program's outputs may carry an equivalent sharding spelled differently, e.g. P() for
    P(None, 'tp') on a 1-device mesh)."""
    sharding = leaf.sharding
    try:
        where = repr(sharding._to_xla_hlo_sharding(len(leaf.shape)))
    except (AttributeError, TypeError, ValueError):
        where = repr(sharding)
    if isinstance(sharding, jax.sharding.NamedSharding):
        where = f"{sharding.mesh.devices.size}:{where}"
    return f"{tuple(leaf.shape)}:{np.dtype(leaf.dtype).name}:{where}"


class _Entry:
    """A stored program (`call` on flat leaves, outputs rebuilt with `out_tree`), or, where
    a program cannot be exported, the plain jitted function (`fallback`)."""

    def __init__(self, call=None, out_tree=None, fallback=None):
        self.call, self.out_tree, self.fallback = call, out_tree, fallback


class _Lowered:
    """A `jax.stages.Lowered` of the flat program that answers `out_info` in the original
    output structure and compiles to a `_Compiled` called with the original arguments."""

    def __init__(self, lowered, out_tree, default_sharding):
        self._lowered, self._out_tree, self._default = lowered, out_tree, default_sharding

    @property
    def out_info(self):
        return jax.tree.unflatten(self._out_tree, self._lowered.out_info)

    def compile(self, *args, **kwargs) -> "_Compiled":
        return _Compiled(self._lowered.compile(*args, **kwargs), self._out_tree, self._default)

    def __getattr__(self, name):
        return getattr(self._lowered, name)


class _Compiled:
    """The compiled flat program, called like the original function (pytrees in and out)."""

    def __init__(self, compiled, out_tree, default_sharding):
        self._compiled, self._out_tree, self._default = compiled, out_tree, default_sharding

    def __call__(self, *args):
        leaves = [_placed(x, self._default) for x in jax.tree.leaves(args)]
        return jax.tree.unflatten(self._out_tree, self._compiled(*leaves))

    def __getattr__(self, name):
        return getattr(self._compiled, name)


class CachedProgram:
    """A jitted function whose traced form is kept in a `ProgramCache` (see the module doc).
    Called like the function; `.lower(*args)` accepts arrays or ShapeDtypeStructs.
    Arguments are pytrees of jax arrays, host arrays or ShapeDtypeStructs."""

    def __init__(self, cache: "ProgramCache", name: str, fn, donate_argnums: Sequence[int],
                 static: str, default_sharding):
        self._cache, self._name, self._fn, self._static = cache, name, fn, static
        self._default = default_sharding
        self._memo: tuple | None = None  # (argument, its signature) for the last large argument
        self._donate = tuple(donate_argnums)
        self._entries: dict[str, _Entry] = {}

    def __call__(self, *args):
        leaves, entry = self._resolve(args)
        if entry.fallback is not None:
            return entry.fallback(*args)
        return jax.tree.unflatten(entry.out_tree, entry.call(*leaves))

    def _arg_signature(self, arg) -> str:
        # The weights (hundreds of leaves) are the same object call after call: their part of
        # the signature is kept, so a decode step does not pay to describe them again.
        memo = self._memo
        if memo is not None and memo[0] is arg:
            return memo[1]
        leaves, tree = jax.tree.flatten(arg)
        sig = f"{tree}" + "".join(";" + _leaf_signature(_placed(x, self._default)) for x in leaves)
        if len(leaves) >= _MEMO_MIN_LEAVES:
            self._memo = (arg, sig)
        return sig

    def lower(self, *args):
        leaves, entry = self._resolve(args)
        if entry.fallback is not None:
            return entry.fallback.lower(*args)
        return _Lowered(entry.call.lower(*leaves), entry.out_tree, self._default)

    def _resolve(self, args) -> tuple[list, _Entry]:
        leaves = [_placed(x, self._default) for x in jax.tree.leaves(args)]
        signature = "|".join([self._name, self._static] + [self._arg_signature(a) for a in args])
        entry = self._entries.get(signature)
        if entry is None:
            counts = [len(jax.tree.leaves(a)) for a in args]
            starts = [sum(counts[:i]) for i in range(len(args))]
            donated = tuple(j for i in self._donate for j in range(starts[i], starts[i] + counts[i]))
            entry = self._entries[signature] = self._cache._entry(
                self._name, signature, self._fn, leaves, jax.tree.structure(args), donated)
        return leaves, entry


class ProgramCache:
    """A directory of exported programs. `wrap(name, jitted_fn, donate_argnums)` gives a
    drop-in replacement for the jitted function. `stats` counts what happened: "exported"
    (traced and written), "loaded" (read back, no tracing), "unreadable" (a bad file,
    traced again), "not_exportable" (jax.export refused it: the plain jitted function runs)."""

    def __init__(self, directory: str | os.PathLike, salt: str = "", native_kernels: bool = True):
        """`native_kernels`: whether the programs may call equarx's native CPU kernels (an
        AllReduce with the group codec may: `AllReduceConfig.group_codec`; so may int8 weights
        with grouped scales); whether those are in use is then part of every key."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._given_salt, self._native_kernels = salt, native_kernels
        self.stats: collections.Counter = collections.Counter()

    @functools.cached_property
    def _salt(self) -> str:
        # Asked at the first program's look-up, not at construction: on a first start that
        # waits for the kernels' build (seconds), which may meanwhile overlap the weights' load.
        # Asking registers the kernels' FFI targets before any stored program that calls them
        # runs.
        native = self._native_kernels and native_cpu.in_use()
        return f"{self._given_salt}\nnative_cpu={native}"

    def wrap(self, name: str, fn: Callable, donate_argnums: Sequence[int] = (),
             static: str = "", default_sharding=None) -> CachedProgram:
        """`static`: whatever else the traced program depends on (a repr of its settings).
        `default_sharding`: where host values among the arguments are placed (replicated)."""
        return CachedProgram(self, name, fn, donate_argnums, static, default_sharding)

    def path_for(self, signature: str) -> Path:
        digest = hashlib.sha256(f"{self._salt}\n{signature}".encode()).hexdigest()[:32]
        return self.directory / f"{signature.split('|', 1)[0]}-{digest}{SUFFIX}"

    def _entry(self, name: str, signature: str, fn, leaves: list, in_tree,
               donated: tuple[int, ...]) -> _Entry:
        path = self.path_for(signature)
        exported, out_tree = None, None
        if path.exists():
            try:
                fmt, out_tree, blob = pickle.loads(path.read_bytes())
                if fmt != _FORMAT:
                    raise ValueError(f"format {fmt}")
                exported = jax.export.deserialize(bytearray(blob))
                self.stats["loaded"] += 1
            except Exception as e:  # a truncated or foreign file: trace again and overwrite it
                log.warning("program cache: cannot read %s (%s); tracing %s again", path, e, name)
                self.stats["unreadable"] += 1
                exported = None
        if exported is None:
            try:
                exported, out_tree = self._export(fn, leaves, in_tree)
                blob = bytes(exported.serialize())
            except Exception as e:  # e.g. a custom call jax.export refuses: run it uncached
                log.warning("program cache: cannot export %s (%s); it is traced on every start",
                            name, e)
                self.stats["not_exportable"] += 1
                return _Entry(fallback=fn)
            self._write(path, pickle.dumps((_FORMAT, out_tree, blob)))
            self.stats["exported"] += 1
        return _Entry(jax.jit(exported.call, donate_argnums=donated), out_tree)

    @staticmethod
    def _export(fn, leaves: list, in_tree) -> tuple[Any, Any]:
        out_tree = []

        def flat(*xs):
            out = fn(*jax.tree.unflatten(in_tree, xs))
            flat_out, tree = jax.tree.flatten(out)
            out_tree.append(tree)
            return flat_out

        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
        # The native CPU kernels are our own FFI targets, with no compatibility guarantee
        # across releases: the key's source fingerprint covers their code.
        exported = jax.export.export(jax.jit(flat), disabled_checks=[
            *map(jax.export.DisabledSafetyCheck.custom_call, native_cpu.TARGETS)])(*abstract)
        return exported, out_tree[0]

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        # A private name, then an atomic rename: concurrent writers never expose half a file.
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:  # a read-only or full disk only costs the next start its speed
            log.warning("program cache: cannot write %s: %s", path, e)
            tmp.unlink(missing_ok=True)
