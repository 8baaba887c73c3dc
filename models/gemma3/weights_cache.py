"""Decoded GGUF weights kept on disk, so that a restart memory-maps them instead of dequantizing
again (docs/deployment.md). An entry, `<cache_dir>/<key>/{weights.bin,index.json}`, holds raw
arrays at 4096-byte boundaries and a JSON index, keyed (`entry_key`) by the GGUF file's identity
and content, the dtype, the decoder's versions and a `variant` (e.g. quantized weights). Written
beside its place and renamed in whole; any failure only costs the speed-up."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterable

import numpy as np

from models.gemma3.gguf import GGUFFile, file_stamp, nest_params, open_gguf

log = logging.getLogger(__name__)

_FORMAT = 1
_ALIGN = 4096
# Blocks of the tensor data hashed into the key, spread evenly over it.
_SAMPLES, _SAMPLE_BYTES = 64, 4096
DEFAULT_MAX_BYTES = 4 << 30
# A temporary entry untouched this long belongs to a writer that died (a store takes seconds).
_DEAD_WRITER_SECONDS = 3600
WEIGHTS_FILE, INDEX_FILE = "weights.bin", "index.json"


def _decoder_fingerprint() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("gguf.py", "weights_cache.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()


def _variant_fingerprint() -> str:
    """The source of what makes the other forms (quantization, the rotation folded in)."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for path in (here / "quantization.py", here.parent.parent / "equarx" / "codec_spec.py",
                 here.parent.parent / "equarx" / "groups.py"):
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _library_versions() -> str:
    """The gguf package's block decoders give the values, numpy and ml_dtypes round them: a
    fixed dequantizer must not keep serving the old values."""
    return " ".join(f"{name}={importlib.metadata.version(name)}"
                    for name in ("gguf", "numpy", "ml_dtypes"))


def _hash_content(h, f: GGUFFile) -> None:
    """The header (metadata and tensor table) whole, then `_SAMPLES` blocks spread over the
    tensor data: any re-quantization or fine-tune changes every block. With the file's stamp
    this catches a file replaced at the same size and mtime even where ctime does not tell; it
    reads a small fraction of what decoding reads."""
    data = f.buffer
    start = min((t.offset for t in f.tensors.values()), default=data.size)
    h.update(data[:start])
    span = data.size - start
    if span <= _SAMPLES * _SAMPLE_BYTES:
        h.update(data[start:])
        return
    for i in range(_SAMPLES):
        at = start + (span - _SAMPLE_BYTES) * i // (_SAMPLES - 1)
        h.update(data[at:at + _SAMPLE_BYTES])


def entry_key(gguf_path: str | os.PathLike, dtype, variant: str = "") -> tuple[str, str]:
    """(key, source tag): the entry's directory name, and what identifies its GGUF file,
    dtype and variant (one entry is kept per source tag). `variant` names another form of the
    weights than the decoded tree, e.g. "int8 rotation=32" for the quantized weights
    `load_model` places (in our layout), kept beside the decoded tree.

    Size and mtime alone would serve a file replaced by another of the same size with its mtime
    kept (cp -p, rsync -t, images that pin mtimes) the old weights: the key also takes its
    inode and ctime (`gguf.file_stamp`) and its content (`_hash_content`)."""
    path = os.path.realpath(os.fspath(gguf_path))
    stamp = " ".join(map(str, file_stamp(path)))
    tag = f"{path} {np.dtype(dtype).name}" + (f" {variant}" if variant else "")
    source = hashlib.sha256(tag.encode()).hexdigest()[:16]
    h = hashlib.sha256(f"format{_FORMAT} {tag} {stamp} "
                       f"{_decoder_fingerprint()} {_library_versions()}".encode())
    if variant:
        h.update(_variant_fingerprint().encode())
    _hash_content(h, open_gguf(path))
    return f"{source}-{h.hexdigest()[:32]}", source


def _dtype(name: str) -> np.dtype:
    import ml_dtypes

    if hasattr(ml_dtypes, name):  # bfloat16, float8_e4m3fn
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def load(cache_dir: str | os.PathLike, gguf_path: str | os.PathLike, dtype,
         variant: str = "") -> dict | None:
    """The cached parameter tree (nested dicts of read-only memory-mapped arrays), or None."""
    key, _ = entry_key(gguf_path, dtype, variant)
    entry = Path(cache_dir) / key
    try:
        index = json.loads((entry / INDEX_FILE).read_text())
        data = np.memmap(entry / WEIGHTS_FILE, np.uint8, mode="r")
        if data.size != index["bytes"]:
            raise ValueError(f"{WEIGHTS_FILE} has {data.size} bytes, the index says {index['bytes']}")
        items = []
        for item in index["arrays"]:
            dt = _dtype(item["dtype"])
            count = int(np.prod(item["shape"], dtype=np.int64))
            start = item["offset"]
            items.append((item["path"],
                          data[start:start + count * dt.itemsize].view(dt).reshape(item["shape"])))
        return nest_params(items)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        # Removed, so that the caller's store() writes a good one in its place.
        log.warning("weights cache: unreadable entry %s (%s); decoding the GGUF file again", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def store(cache_dir: str | os.PathLike, gguf_path: str | os.PathLike, dtype,
          items: Iterable[tuple[tuple[str, ...], np.ndarray]],
          max_bytes: int = DEFAULT_MAX_BYTES, variant: str = "") -> bool:
    """Write (path, array) items as this GGUF file's entry (of `variant`); True if written."""
    items = list(items)
    total = sum(-(-a.nbytes // _ALIGN) * _ALIGN for _, a in items)
    if total > max_bytes:
        log.info("weights cache: %.1f GB decoded is over the %.1f GB limit; not cached "
                 "(gemma3-convert makes a checkpoint that restores fast)", total / 1e9, max_bytes / 1e9)
        return False
    key, source = entry_key(gguf_path, dtype, variant)
    root = Path(cache_dir)
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        arrays, offset = [], 0
        with open(tmp / WEIGHTS_FILE, "wb") as f:
            for path, a in items:
                a = np.ascontiguousarray(a)
                f.write(b"\0" * (-offset % _ALIGN))
                offset += -offset % _ALIGN
                arrays.append({"path": list(path), "dtype": a.dtype.name, "shape": list(a.shape),
                               "offset": offset})
                f.write(memoryview(a.reshape(-1).view(np.uint8)))
                offset += a.nbytes
        (tmp / INDEX_FILE).write_text(json.dumps({"format": _FORMAT, "bytes": offset,
                                                  "arrays": arrays}))
        target = root / key
        if target.exists():  # another process wrote the same entry meanwhile
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, target)
        tmp = None
        for old in root.glob(f"{source}-*"):  # earlier versions of the same file
            if old.name != key:
                shutil.rmtree(old, ignore_errors=True)
        for dead in root.glob(f".{source}-*"):  # what writers killed mid-store left
            with contextlib.suppress(OSError):
                if time.time() - dead.stat().st_mtime > _DEAD_WRITER_SECONDS:
                    shutil.rmtree(dead, ignore_errors=True)
        return True
    except OSError as e:
        log.warning("weights cache: cannot write %s: %s", root, e)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def tree_items(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], np.ndarray]]:
    """(path, array) for every leaf of a nested dict, in insertion order."""
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += tree_items(v, prefix + (k,))
        else:
            out.append((prefix + (k,), v))
    return out
