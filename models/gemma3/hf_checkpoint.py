"""Hugging Face checkpoints: config.json and safetensors weights, read into the sharded layout and
written back (`Gemma3ForCausalLM`, and the text part of `Gemma3ForConditionalGeneration`; the
tokenizer side is `hf_tokenizer`'s).

Safetensors files are read by a reader of our own over a `numpy.memmap` (bfloat16 included, which
`safetensors`' numpy backend cannot return), so each device's shard is read straight from the
mapped file and a checkpoint larger than host memory still loads at tp > 1. Projections are
stored as PyTorch's (out_features, in_features), heads major; the output projection is tied.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import struct
from pathlib import Path
from typing import Callable

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from models.gemma3.config import CONFIGS, GLOBAL_EVERY, Gemma3Config, global_period
from models.gemma3.sharding import named, weight_specs
from models.gemma3.weights import Weights, map_weights

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 << 30
# PyTorch pickles, which transformers writes with safe_serialization=False: not read here.
PICKLE_FILE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_PICKLE_SHARD = re.compile(r"pytorch_model-\d+-of-\d+\.bin")

# Safetensors dtype names <-> numpy dtypes (only float types: a Gemma checkpoint holds nothing else).
_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
           "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64)}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}

# Our per-layer fields <- the Hugging Face names below `layers.{i}.` (each name + ".weight").
_HF_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
             "pre_attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "pre_ffw_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
_HF_LAYER = {"q": ("self_attn.q_proj",), "kv": ("self_attn.k_proj", "self_attn.v_proj"),
             "o": ("self_attn.o_proj",), "gating": ("mlp.gate_proj", "mlp.up_proj"),
             "linear": ("mlp.down_proj",), **{k: (v,) for k, v in _HF_NORMS.items()}}
# The text model's prefix in the layout transformers 4.50-5.x all load (the published
# Gemma3ForConditionalGeneration checkpoints'); Gemma3ForCausalLM's is "model.".
MULTIMODAL_TEXT_PREFIX = "language_model.model."

log = logging.getLogger(__name__)

# Gemma3TextConfig's defaults: the published multimodal configs' text_config leaves most fields out.
_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": GLOBAL_EVERY,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
}


class HFCheckpointError(ValueError):
    """A directory that is not a Gemma 3 text checkpoint this model can run."""


# ---------------------------------------------------------------------------------------------
# Safetensors


class SafetensorsFile:
    """One .safetensors file, memory-mapped: `tensor(name)` is a read-only view, no copy.

    The header is checked as the `safetensors` library checks it, before any tensor is read: a
    truncated download or a corrupt header is an HFCheckpointError naming the file and what is
    wrong, not a struct or JSON error without a file name, a MemoryError, or a shape error that
    blames config.json."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise self._error(f"{size} bytes: shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise self._error(f"header of {n} bytes runs past the end of the file ({size} "
                                  "bytes): truncated, or not a safetensors file")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise self._error(f"invalid JSON header ({e})") from None
        if not isinstance(header, dict):
            raise self._error("invalid header: not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict] = header
        self._base = 8 + n
        spans = sorted(self._span(name, e, size - self._base) for name, e in header.items())
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise self._error(f"the data of {a} and {b} overlap")
        self._map = np.memmap(self.path, np.uint8, mode="r") if header else None

    def _error(self, what: str) -> HFCheckpointError:
        return HFCheckpointError(f"{self.path}: {what}")

    def _span(self, name: str, e, data_bytes: int) -> tuple[int, int, str]:
        """(begin, end, name) of one header entry, checked against its shape, dtype and the
        bytes the file holds after its header."""
        try:
            dtype, shape, (begin, end) = e["dtype"], e["shape"], e["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise self._error(f"{name}: malformed header entry {e!r}") from None
        if dtype not in _DTYPES:
            raise self._error(f"{name} has dtype {dtype}, expected one of {sorted(_DTYPES)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and type(begin) is int and type(end) is int and 0 <= begin <= end):
            raise self._error(f"{name}: malformed shape {shape!r} or data_offsets {[begin, end]}")
        if end > data_bytes:
            raise self._error(f"truncated: {name} ends at byte {self._base + end}, the file has "
                              f"{self._base + data_bytes}")
        need = math.prod(shape) * _DTYPES[dtype].itemsize
        if end - begin != need:
            raise self._error(f"{name} holds {end - begin} bytes where its shape {shape} in "
                              f"{dtype} needs {need}")
        return begin, end, name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def tensor(self, name: str) -> np.ndarray:
        e = self.entries[name]
        begin, end = e["data_offsets"]
        raw = self._map[self._base + begin:self._base + end]
        return raw.view(_DTYPES[e["dtype"]]).reshape(e["shape"])


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray] | None = None, *,
                      shapes: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None,
                      produce: Callable[[str], np.ndarray] | None = None,
                      metadata: dict[str, str] | None = None) -> None:
    """Write a .safetensors file, either from `tensors`, or from `shapes` (name -> (shape,
    dtype)) and `produce(name)`, called one tensor at a time so that only one is in memory."""
    if tensors is not None:
        shapes = {k: (v.shape, v.dtype) for k, v in tensors.items()}
        produce = tensors.__getitem__
    header, offset = {}, 0
    for name, (shape, dtype) in shapes.items():
        dtype = np.dtype(dtype)
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: cannot store dtype {dtype} in safetensors here")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the data to 8 bytes
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, (shape, dtype) in shapes.items():
            x = np.ascontiguousarray(produce(name), dtype=dtype)
            if x.shape != tuple(shape):
                raise ValueError(f"{name}: produced shape {x.shape}, declared {tuple(shape)}")
            f.write(memoryview(x.reshape(-1).view(np.uint8)))
    os.replace(tmp, path)


class SafetensorsDir:
    """The safetensors files of a directory: through model.safetensors.index.json when there is
    one, else every *.safetensors file in it. Tensor names map to their file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise HFCheckpointError(f"{index}: not a safetensors index with a weight_map "
                                        f"of tensor names to files ({type(e).__name__}: {e})") \
                    from None
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise HFCheckpointError(f"{self.path}: no .safetensors files")
        self.files = {f: SafetensorsFile(self.path / f) for f in files}
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files.values():
            for name in f.entries:
                self.where[name] = f
        if weight_map is not None:
            missing = sorted(k for k in weight_map if k not in self.where)
            if missing:
                raise HFCheckpointError(f"{index}: tensors listed but not stored: {missing[:3]}")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(name)

    def tensor(self, name: str) -> np.ndarray:
        return self.where[name].tensor(name)


# ---------------------------------------------------------------------------------------------
# config.json


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    """config.json beside weights: safetensors, or PyTorch pickles (which `hf_layout` refuses
    with the command that converts them)."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and (
        (p / INDEX_FILE).is_file() or any(p.glob("*.safetensors")) or bool(pickle_files(p)))


def pickle_files(path: str | os.PathLike) -> list[str]:
    """The PyTorch pickle weight files (and their index) of a directory, sorted."""
    with os.scandir(path) as it:
        return sorted(e.name for e in it if e.name in (PICKLE_FILE, PICKLE_INDEX)
                      or _PICKLE_SHARD.fullmatch(e.name))


def text_config(raw: dict) -> dict:
    """The text model's fields (Gemma3TextConfig's defaults filled in) of a config.json."""
    if "text_config" in raw:  # Gemma3ForConditionalGeneration
        text = dict(raw["text_config"] or {})
        if "tie_word_embeddings" in raw:
            text.setdefault("tie_word_embeddings", raw["tie_word_embeddings"])
    else:
        text = dict(raw)
    model_type = text.get("model_type", "gemma3_text")
    if model_type not in ("gemma3_text", "gemma3"):
        raise HFCheckpointError(f"model_type is {model_type!r}, expected a Gemma 3 text model")
    return {**_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None
                                 or k in ("final_logit_softcapping", "attn_logit_softcapping")}}


def _rope(text: dict) -> tuple[float, float, float]:
    """(local base, global base, global linear scale) from either spelling: transformers 4.x
    (rope_theta, rope_local_base_freq, rope_scaling for global layers) or 5.x (rope_parameters
    per layer type)."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, sliding = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", _TEXT_DEFAULTS["rope_theta"])
        sliding.setdefault("rope_theta", _TEXT_DEFAULTS["rope_local_base_freq"])
    else:
        full = {**(text.get("rope_scaling") or {}), "rope_theta": text["rope_theta"]}
        sliding = {"rope_theta": text["rope_local_base_freq"]}
    scale = 1.0
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        scale = float(full["factor"])
    elif kind != "default":
        raise HFCheckpointError(f"global RoPE scaling {kind!r} is not supported (only linear)")
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        raise HFCheckpointError("sliding-window layers must use plain RoPE")
    return float(sliding["rope_theta"]), float(full["rope_theta"]), scale


def config_from_hf(raw: dict) -> Gemma3Config:
    """Our config from a config.json's contents; raises for what our model does not implement."""
    t = text_config(raw)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if t.get(key) is not None:
            raise HFCheckpointError(f"{key}={t[key]} is not supported (Gemma 3 has none)")
    if t.get("hidden_activation", t.get("hidden_act")) not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise HFCheckpointError(f"hidden activation {t.get('hidden_activation')!r}: Gemma 3 "
                                "uses gelu_pytorch_tanh")
    if t.get("use_bidirectional_attention") or t.get("attention_bias"):
        raise HFCheckpointError("bidirectional attention and attention biases are not supported")
    if not t["tie_word_embeddings"]:
        raise HFCheckpointError("untied output embeddings are not supported (Gemma 3 ties them)")
    layers = int(t["num_hidden_layers"])
    every = _global_every(t, layers)
    local_base, global_base, global_scale = _rope(t)
    sizes = dict(vocab_size=int(t["vocab_size"]), num_layers=layers, d_model=int(t["hidden_size"]),
                 ffn_hidden=int(t["intermediate_size"]), num_heads=int(t["num_attention_heads"]),
                 num_kv_heads=int(t["num_key_value_heads"]), head_dim=int(t["head_dim"]))
    # By the layer sizes: the multimodal checkpoints' embeddings have 64 rows more (262,208)
    # than the text-only vocabulary, for image tokens.
    known = next((c.name for c in CONFIGS.values()
                  if all(getattr(c, k) == v for k, v in sizes.items() if k != "vocab_size")), None)
    return Gemma3Config(
        name=known or "gemma3", **sizes, sliding_window=int(t["sliding_window"]),
        max_seq_len=int(t["max_position_embeddings"]),
        query_scale=float(t["query_pre_attn_scalar"]) ** -0.5, rope_local_base=local_base,
        rope_global_base=global_base, rope_global_scale=global_scale,
        norm_eps=float(t["rms_norm_eps"]), global_every=every)


def _global_every(t: dict, layers: int) -> int:
    """The period of global layers: `sliding_window_pattern` (6 when absent), or the one
    `layer_types` shows where they disagree (transformers >= 4.53 writes both; the list is what
    it runs). Any list not arranged as Gemma 3's (a global layer every k-th, k - 1
    sliding-window layers before each) is refused."""
    kinds = t.get("layer_types")
    stated = int(t["sliding_window_pattern"])  # text_config fills in the default
    if stated < 1:
        raise HFCheckpointError(f"sliding_window_pattern {stated} must be >= 1")
    if kinds is None:
        return stated
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise HFCheckpointError(f"layer_types {kinds}: {layers} entries of 'full_attention' or "
                                "'sliding_attention' expected")
    every = global_period([k == "full_attention" for k in kinds], stated)
    if every is None:
        raise HFCheckpointError(f"layer_types {kinds}: not Gemma 3's arrangement (a global layer "
                                "every k-th layer, k - 1 sliding-window layers before each)")
    return every


def config_to_hf(c: Gemma3Config, dtype) -> dict:
    """A Gemma3ForCausalLM config.json (transformers 4.x spelling, which 5.x also reads)."""
    scalar = c.query_scale ** -2
    scalar = round(scalar) if math.isclose(scalar, round(scalar), rel_tol=1e-9) else scalar
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.ffn_hidden,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps, "query_pre_attn_scalar": scalar,
        "sliding_window": c.sliding_window, "sliding_window_pattern": c.global_every,
        "layer_types": ["full_attention" if c.is_global(i) else "sliding_attention"
                        for i in range(c.num_layers)],
        "rope_theta": c.rope_global_base, "rope_local_base_freq": c.rope_local_base,
        "rope_scaling": (None if c.rope_global_scale == 1.0
                         else {"rope_type": "linear", "factor": c.rope_global_scale}),
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        "torch_dtype": np.dtype(dtype).name,
    }


def read_config(path: str | os.PathLike) -> Gemma3Config:
    return config_from_hf(json.loads((Path(path) / CONFIG_FILE).read_text()))


# ---------------------------------------------------------------------------------------------
# Which stored tensors are which part of the model


def text_tensor_names(c: Gemma3Config) -> list[str]:
    """The text model's tensor names below its prefix, as transformers names them."""
    names = ["embed_tokens.weight", "norm.weight"]
    for i in range(c.num_layers):
        names += [f"layers.{i}.{n}.weight" for group in _HF_LAYER.values() for n in group]
    return names


@dataclasses.dataclass(frozen=True)
class HFLayout:
    """Where a checkpoint directory stores each part of the model its config.json declares: the
    prefix of the text model's tensor names, and of the vision tower's and the projector's
    (None where config.json declares no tower)."""

    files: SafetensorsDir
    raw: dict  # config.json
    config: Gemma3Config
    text: str
    tower: str | None = None
    projector: str | None = None


def hf_layout(path: str | os.PathLike) -> HFLayout:
    """The layout of a checkpoint directory, found from its tensor names, not from a list of
    known prefixes: each part's prefix is the one under which its names (transformers' names
    below that module) are stored. So every layout transformers 4.50-5.x writes or holds in
    memory loads: `model.` (Gemma3ForCausalLM); `language_model.model.`,
    `vision_tower.vision_model.`, `multi_modal_projector.` (the published checkpoints, 4.5x
    saves); `model.language_model.`, `model.vision_tower.[vision_model.]`,
    `model.multi_modal_projector.` (their state dicts); `vision_tower.` (5.x saves).

    Refused, with what is wrong named, before any tensor is read: PyTorch pickles only (with the
    command that converts them); a declared part with tensors missing (a vision_config whose
    tower is not stored, or only in part, included: such a checkpoint never loads text-only);
    stored tensors that no declared part uses (another architecture, extra layers, adapters:
    the model would run without them). A tied `lm_head.weight` is ignored, as transformers
    ties it; a tower and projector stored under a text-only config.json are ignored, with a
    warning (the model loads as its config.json declares it)."""
    from models.gemma3.vision_checkpoint import (PROJECTOR_TENSOR_NAMES, tower_tensor_names,
                                                 vision_config_from_hf)

    path = Path(path)
    raw = json.loads((path / CONFIG_FILE).read_text())
    pickles = pickle_files(path)
    if pickles and not (path / INDEX_FILE).is_file() and not any(path.glob("*.safetensors")):
        arch = (raw.get("architectures") or ["Gemma3ForCausalLM"])[0]
        raise HFCheckpointError(
            f"{path}: the weights are PyTorch pickles ({', '.join(pickles)}), which are not read "
            "here (loading a pickle can run code); convert them to safetensors once, in place, "
            f"with transformers:\n  python -c \"import transformers as t; t.{arch}.from_pretrained("
            f"{str(path)!r}, torch_dtype='auto').save_pretrained({str(path)!r})\"")
    c = config_from_hf(raw)
    vc = vision_config_from_hf(raw)
    files = SafetensorsDir(path)
    stored = set(files.where)
    known = {"text model": text_tensor_names(c),
             # without a vision_config: enough layers to recognise any tower stored anyway
             "vision tower": tower_tensor_names(vc.num_layers if vc else _layer_bound(stored)),
             "multimodal projector": list(PROJECTOR_TENSOR_NAMES)}
    prefixes = {part: _stored_prefix(path, stored, names, [n for other, ns in known.items()
                                                           if other != part for n in ns], part)
                for part, names in known.items()}
    declared = ("text model", "vision tower", "multimodal projector") if vc else ("text model",)
    for part in set(known) - set(declared):
        if prefixes[part] is not None:
            stored -= {prefixes[part] + n for n in known[part]}
            log.warning("%s: config.json declares no vision tower (vision_config): the %s "
                        "stored under %r is not loaded", path, part, prefixes[part])
    default = {"text model": MULTIMODAL_TEXT_PREFIX if vc else "model.",
               "vision tower": "vision_tower.vision_model.",
               "multimodal projector": "multi_modal_projector."}
    where = {part: prefixes[part] if prefixes[part] is not None else default[part]
             for part in declared}
    wanted, problems = set(), []
    for part in declared:
        full = [where[part] + n for n in known[part]]
        wanted.update(full)
        missing = [n for n in full if n not in stored]
        if missing:
            why = (f"config.json's {c.num_layers} layers" if part == "text model"
                   else "config.json declares a vision tower (vision_config)")
            problems.append(f"{len(missing)} of the {part}'s {len(full)} tensors are missing "
                            f"({why}): {_few(missing)}")
    head = {n for n in stored if n.endswith("lm_head.weight")
            and where["text model"].startswith(n.removesuffix("lm_head.weight"))}  # tied
    unexpected = sorted(stored - wanted - head)
    if unexpected:
        problems.append(f"{len(unexpected)} stored tensors belong to no part config.json "
                        f"declares: {_few(unexpected)}")
    if problems:
        raise HFCheckpointError(f"{path}: " + "; ".join(problems))
    return HFLayout(files, raw, c, where["text model"], where.get("vision tower"),
                    where.get("multimodal projector"))


def _layer_bound(names) -> int:
    """1 + the largest `layers.{i}` index among `names` (0 without any)."""
    found = (re.search(r"(?:^|\.)layers\.(\d+)\.", n) for n in names)
    return 1 + max((int(m.group(1)) for m in found if m), default=-1)


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _stored_prefix(path: Path, stored: set[str], names: list[str], others: list[str],
                   part: str) -> str | None:
    """The prefix under which most of `names` are stored (each name at a "." boundary), None if
    none is. Only names that are not the tail of another part's names count (the text
    model's `layers.0.self_attn.q_proj.weight` ends the tower's `encoder.layers.0...`)."""
    tails = {o[i + 1:] for o in others for i, ch in enumerate(o) if ch == "."}
    anchors = set(names) - tails - set(others)
    counts: dict[str, int] = {}
    for full in stored:
        at = 0
        while True:
            if full[at:] in anchors:
                counts[full[:at]] = counts.get(full[:at], 0) + 1
            at = full.find(".", at) + 1
            if at == 0:
                break
    if not counts:
        return None
    best = max(counts.values())
    top = sorted(p for p, k in counts.items() if k == best)
    if len(top) > 1:
        raise HFCheckpointError(f"{path}: the {part}'s tensors are stored under each of "
                                f"{', '.join(map(repr, top))}: which one is the model's?")
    return top[0]


# ---------------------------------------------------------------------------------------------
# Our tensors as views of the Hugging Face ones


class _View:
    """One of our tensors as lazily transformed views of stored ones: `parts` (each already in
    our layout, minus the stacked axis) stacked along `axis`, or the single part."""

    def __init__(self, parts: list[np.ndarray], axis: int | None = None):
        self.parts, self.axis = parts, axis
        first = parts[0].shape
        self.shape = first if axis is None else (*first[:axis], len(parts), *first[axis:])

    def read(self, index: tuple[slice, ...], dtype) -> np.ndarray:
        if self.axis is None:
            return np.asarray(self.parts[0][index], dtype)
        rest = index[:self.axis] + index[self.axis + 1:]
        picked = self.parts[index[self.axis]]
        return np.stack([np.asarray(p[rest], dtype) for p in picked], axis=self.axis)


def _heads(x: np.ndarray, n: int, h: int) -> np.ndarray:
    """[n*h, D] -> [D, n, h] (a view)."""
    return x.reshape(n, h, -1).transpose(2, 0, 1)


class HFWeights:
    """The text model's tensors of a checkpoint directory, checked against a config."""

    def __init__(self, path: str | os.PathLike, c: Gemma3Config, layout: HFLayout | None = None):
        layout = layout or hf_layout(path)
        self.files, self.prefix, self.c = layout.files, layout.text, c

        def check(layer, name, shape):  # every tensor, before any is read
            try:
                got = self.view(layer, name).shape
            except HFCheckpointError:
                raise
            except ValueError as e:  # a stored shape that does not even reshape
                got = f"incompatible ({e})"
            if got != tuple(shape):
                raise HFCheckpointError(f"{path}: {name} of layer {layer} has shape {got}, "
                                        f"config.json implies {shape}")

        map_weights(c, check)

    def _t(self, name: str) -> np.ndarray:
        full = self.prefix + name
        if full not in self.files:
            raise HFCheckpointError(f"{self.files.path}: tensor {full} is missing")
        return self.files.tensor(full)

    def view(self, layer: int | None, name: str) -> _View:
        c = self.c
        if layer is None:
            return _View([self._t("embed_tokens.weight" if name == "embed" else "norm.weight")])
        parts = [self._t(f"layers.{layer}.{n}.weight") for n in _HF_LAYER[name]]
        if name == "q":
            return _View([_heads(parts[0], c.num_heads, c.head_dim)])
        if name == "kv":
            return _View([_heads(x, c.num_kv_heads, c.head_dim) for x in parts], axis=1)
        if name == "o":  # [D, N*H] -> [N, H, D]
            return _View([parts[0].reshape(c.d_model, c.num_heads, c.head_dim)
                          .transpose(1, 2, 0)])
        if name == "gating":
            return _View([x.T for x in parts], axis=1)
        if name == "linear":
            return _View([parts[0].T])
        return _View(parts)


def place_hf(path: str | os.PathLike, c: Gemma3Config, dtype, mesh: Mesh, tp: int,
             layout: HFLayout | None = None) -> Weights:
    """Sharded Weights from a checkpoint directory: each device's shard read from the mapped
    files (and converted to `dtype`) by its own callback."""
    from models.gemma3.loading import _sharding

    hf = HFWeights(path, c, layout)
    shardings = named(mesh, weight_specs(c, tp))
    np_dtype = np.dtype(dtype)

    def make(layer, name, shape):
        view = hf.view(layer, name)
        return jax.make_array_from_callback(shape, _sharding(shardings, layer, name),
                                            lambda index: view.read(index, np_dtype))

    return map_weights(c, make)


# ---------------------------------------------------------------------------------------------
# Writing


def hf_tensors(weights: Weights, c: Gemma3Config, prefix: str = "model."
               ) -> dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]:
    """Hugging Face name -> (shape, function gathering that tensor to the host in its layout).
    Shapes come without touching the arrays; each function gathers one tensor."""
    N, K, H, D = c.num_heads, c.num_kv_heads, c.head_dim, c.d_model
    host = lambda x: np.asarray(jax.device_get(x))  # noqa: E731
    out = {f"{prefix}embed_tokens.weight": ((c.vocab_size, D), lambda: host(weights.embed))}
    for i, lw in enumerate(weights.layers):
        p = f"{prefix}layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (
            (N * H, D), lambda lw=lw: host(lw.q).transpose(1, 2, 0).reshape(N * H, D))
        for j, x in enumerate("kv"):
            out[p + f"self_attn.{x}_proj.weight"] = (
                (K * H, D), lambda lw=lw, j=j: host(lw.kv)[:, j].transpose(1, 2, 0).reshape(K * H, D))
        out[p + "self_attn.o_proj.weight"] = (
            (D, N * H), lambda lw=lw: host(lw.o).transpose(2, 0, 1).reshape(D, N * H))
        for field, hf in _HF_NORMS.items():
            size = H if field in ("q_norm", "k_norm") else D
            out[p + hf + ".weight"] = ((size,), lambda lw=lw, f=field: host(getattr(lw, f)))
        for j, x in enumerate(("gate", "up")):
            out[p + f"mlp.{x}_proj.weight"] = (
                (c.ffn_hidden, D), lambda lw=lw, j=j: host(lw.gating)[:, j].T)
        out[p + "mlp.down_proj.weight"] = ((D, c.ffn_hidden), lambda lw=lw: host(lw.linear).T)
    out[f"{prefix}norm.weight"] = ((D,), lambda: host(weights.final_norm))
    return out


def save_hf_weights(path: str | os.PathLike, weights: Weights, c: Gemma3Config, dtype=None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write config.json and the weights as safetensors (one file, or several of at most
    `max_shard_bytes` each with model.safetensors.index.json, as `save_pretrained` does),
    gathering one tensor at a time to the host, into a directory that holds no other checkpoint
    (`Gemma3Model.save` writes into a new one: `sources.replacing_checkpoint`). Returns the
    files written."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype if dtype is not None else weights.embed.dtype)
    tensors = hf_tensors(weights, c)
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, _) in tensors.items():
        n = int(np.prod(shape)) * dtype.itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, members in zip(names, shards):
        write_safetensors(path / file, shapes={k: (tensors[k][0], dtype) for k in members},
                          produce=lambda k: tensors[k][1](), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(int(np.prod(s)) * dtype.itemsize for s, _ in tensors.values())
        weight_map = {k: file for file, members in zip(names, shards) for k in members}
        (path / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / CONFIG_FILE).write_text(json.dumps(config_to_hf(c, dtype), indent=2))
    return names
