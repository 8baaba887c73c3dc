"""Gemma 3 text configurations (the official sizes and tiny ones for tests)."""
from __future__ import annotations

import dataclasses
import urllib.parse
from typing import Sequence

# Layer i is a global (full-context) layer when i % every == every - 1: every published Gemma 3
# repeats 5 local sliding-window layers then 1 global layer (every = 6). Hugging Face's
# Gemma3TextConfig makes the period a setting (`sliding_window_pattern`, or `layer_types`), and
# so does `Gemma3Config.global_every`.
GLOBAL_EVERY = 6


def is_global_layer(layer: int, every: int = GLOBAL_EVERY) -> bool:
    """Whether layer `layer` is a global (full-context) one; the others are sliding-window."""
    return layer % every == every - 1


def global_period(is_global: Sequence[bool], stated: int | None = None) -> int | None:
    """The period k for which layer i is global exactly when i % k == k - 1, from a per-layer
    list (Hugging Face's `layer_types`, llama.cpp's per-layer pattern): `stated` when it fits,
    else the one the first global layer gives (with none, any period longer than the model);
    None when the list is not arranged so."""
    glob = [bool(g) for g in is_global]
    derived = glob.index(True) + 1 if any(glob) else max(GLOBAL_EVERY, len(glob) + 1)
    for every in ([stated] if stated is not None and stated >= 1 else []) + [derived]:
        if glob == [is_global_layer(i, every) for i in range(len(glob))]:
            return every
    return None


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """Architecture hyper-parameters of a Gemma 3 text model.

    query_scale multiplies the queries after RoPE (the official `query_pre_attn_scalar`).
    Global layers divide RoPE positions by `rope_global_scale` (linear scaling); local layers use
    base `rope_local_base` and no scaling. Every `global_every`-th layer is global (Hugging
    Face's `sliding_window_pattern`; 6 in every published size).
    """

    name: str
    vocab_size: int
    num_layers: int
    d_model: int
    ffn_hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    max_seq_len: int
    query_scale: float
    rope_local_base: float = 10_000.0
    rope_global_base: float = 1_000_000.0
    rope_global_scale: float = 1.0
    norm_eps: float = 1e-6
    global_every: int = GLOBAL_EVERY

    def __post_init__(self):
        for field in ("vocab_size", "num_layers", "d_model", "ffn_hidden", "num_heads",
                      "num_kv_heads", "head_dim", "sliding_window", "max_seq_len", "global_every"):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_global_scale < 1.0:
            raise ValueError(f"rope_global_scale must be >= 1, got {self.rope_global_scale}")

    def is_global(self, layer: int) -> bool:
        return is_global_layer(layer, self.global_every)

    @property
    def num_global_layers(self) -> int:
        return sum(self.is_global(i) for i in range(self.num_layers))

    @property
    def num_local_layers(self) -> int:
        return self.num_layers - self.num_global_layers

    def replace(self, **changes) -> "Gemma3Config":
        return dataclasses.replace(self, **changes)


def _official(name, layers, d, ffn, heads, kv, head_dim, window, max_len, global_scale,
              query_scale=None) -> Gemma3Config:
    return Gemma3Config(
        name=name, vocab_size=262_144, num_layers=layers, d_model=d, ffn_hidden=ffn,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim, sliding_window=window,
        max_seq_len=max_len, query_scale=query_scale or head_dim ** -0.5,
        rope_global_scale=global_scale)


CONFIGS: dict[str, Gemma3Config] = {
    "270m": _official("gemma3-270m", 18, 640, 2048, 4, 1, 256, 512, 32_768, 1.0),
    "1b": _official("gemma3-1b", 26, 1152, 6912, 4, 1, 256, 512, 32_768, 1.0),
    "4b": _official("gemma3-4b", 34, 2560, 10240, 8, 4, 256, 1024, 131_072, 8.0),
    "12b": _official("gemma3-12b", 48, 3840, 15360, 16, 8, 256, 1024, 131_072, 8.0),
    "27b": _official("gemma3-27b", 62, 5376, 21504, 32, 16, 128, 1024, 131_072, 8.0,
                     query_scale=(5376 / 32) ** -0.5),
    # Tiny configs for tests: 3 layers, local, global, local (a global layer every 2nd, so
    # both kinds and a local layer after a global one, in 3 layers' compile time: the tests
    # compile hundreds of programs), a window small enough that short prompts overflow it, 2 KV
    # heads (sharded at tp=2, replicated at tp=4) and global RoPE scaling switched on.
    "tiny": Gemma3Config(
        name="tiny", vocab_size=512, num_layers=3, d_model=64, ffn_hidden=128, num_heads=4,
        num_kv_heads=2, head_dim=16, sliding_window=8, max_seq_len=256, query_scale=16 ** -0.5,
        rope_global_scale=8.0, global_every=2),
    # Same vocabulary as the real tokenizer, so it can be driven by real text.
    "tiny-262k": Gemma3Config(
        name="tiny-262k", vocab_size=262_144, num_layers=6, d_model=64, ffn_hidden=128,
        num_heads=4, num_kv_heads=1, head_dim=16, sliding_window=16, max_seq_len=512,
        query_scale=16 ** -0.5),
}

# Short names accepted in query strings: "random:27b?layers=4".
_ALIASES = {"layers": "num_layers", "window": "sliding_window", "heads": "num_heads",
            "kv_heads": "num_kv_heads", "vocab": "vocab_size", "ffn": "ffn_hidden",
            "d": "d_model", "max_len": "max_seq_len"}


def get_config(spec: str) -> Gemma3Config:
    """Config from a size name with optional overrides, e.g. "1b", "27b?layers=4",
    "tiny?kv_heads=1&window=4" (any field name or alias is accepted)."""
    name, _, query = spec.partition("?")
    key = name.strip().lower().removeprefix("gemma3-")
    if key not in CONFIGS:
        raise ValueError(f"unknown Gemma 3 size {name!r}; known: {sorted(CONFIGS)}")
    config = CONFIGS[key]
    if not query:
        return config
    fields = {f.name: f.type for f in dataclasses.fields(Gemma3Config)}
    changes = {}
    for field, value in urllib.parse.parse_qsl(query, strict_parsing=True):
        field = _ALIASES.get(field, field)
        if field not in fields or field == "name":
            raise ValueError(f"unknown config field {field!r} in {spec!r}")
        current = getattr(config, field)
        try:
            changes[field] = int(value) if isinstance(current, int) else float(value)
        except ValueError as e:
            raise ValueError(f"bad value {value!r} for {field} in {spec!r}") from e
    return config.replace(name=f"{config.name}?{query}", **changes)
