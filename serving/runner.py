"""What every layer above the model runner shares about it: the protocol the engine core drives
(`Runner`), what the scheduler and HTTP layer know of an engine (`RunnerInfo`), a step's host
outputs (`StepOutputs`), a dispatched step (`PendingStep`).

A step takes numpy arrays and returns tokens and logprobs, never full logits; it is a pure function
of its inputs and the KV cache, so a group's processes can replay it. See docs/engine.md, "Layers,
by name"."""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Protocol

import numpy as np


class StepOutputs(NamedTuple):
    tokens: np.ndarray  # int32 [B]
    logprobs: np.ndarray  # float32 [B]
    top_ids: np.ndarray  # int32 [B, K]
    top_logprobs: np.ndarray  # float32 [B, K]
    # With prompt logprobs: for each token of the step, the logprob of the token after it given
    # the tokens up to it, and the top alternatives.
    prompt_logprobs: np.ndarray | None = None  # float32 [T]
    prompt_top_ids: np.ndarray | None = None  # int32 [T, K]
    prompt_top_logprobs: np.ndarray | None = None  # float32 [T, K]


@dataclasses.dataclass(frozen=True)
class RunnerInfo:
    """What the scheduler and the HTTP layer need to know about an engine (`paged_runner_info`
    makes it for a model)."""

    model_name: str
    max_num_seqs: int  # sequences running at once (--max-num-seqs)
    max_seq_len: int
    vocab_size: int
    eos_ids: tuple[int, ...]  # tokens that end a sequence (EOS, <end_of_turn>)
    tp: int = 1
    dtype: str = "bfloat16"
    allreduce: dict = dataclasses.field(default_factory=dict)
    allreduce_label: str = "bf16"
    # The model's weights: {"bytes" (on the devices, one copy), "dtype", "quantization",
    # "group_size"}.
    weights: dict = dataclasses.field(default_factory=dict)
    # The most prompt tokens a sequence computes in one step while others run or wait.
    long_prefill_token_threshold: int = 16
    deterministic: bool = False  # batch-invariant steps (docs/engine.md)
    prefix_caching: bool = False  # full pages named by their prefix's hash and reused
    page_size: int = 16
    num_global_pages: int = 2  # in each pool, the scratch page included
    num_local_pages: int = 2
    kv_cache_dtype: str = "auto"  # what the pools hold (--kv-cache-dtype)
    kv_cache_bytes: int = 0  # every pool's bytes on all devices, scales included
    max_num_batched_tokens: int = 256  # the token budget of one step
    sliding_window: int | None = None  # the local layers' window (None: no local layers)
    has_global_layers: bool = True
    # The paged attention's form (models.gemma3.ragged.attention_impl). The XLA form's steps
    # read the pages their rows hold whatever the table's width, so they need no page buckets;
    # the TPU kernel takes the whole table into its scalar memory, so its steps keep them.
    attention: str = "xla"
    # The ids the tokenizer has: a checkpoint's embedding may be padded past them (Gemma 3
    # 4B-27B: 262,208 rows for 262,144 pieces); None: every row is a token.
    tokenizer_vocab_size: int | None = None
    # Ids below `token_ids` the model is not meant to emit (image tokens, ids the checkpoint
    # suppresses: `models.gemma3.tokenizer.never_generate_ids`): the sampler never draws them,
    # grammars never allow them and a request may not raise their odds (400).
    never_generate: tuple[int, ...] = ()

    @property
    def kv_cache(self) -> dict:
        """What /health and /metrics report of the pools: {"dtype", "bytes"}."""
        return {"dtype": self.kv_cache_dtype, "bytes": self.kv_cache_bytes}

    @property
    def token_ids(self) -> int:
        """The ids a request may name and the sampler may draw, [0, token_ids): what both the
        logits and the tokenizer hold. A padded row's token cannot be detokenized."""
        return min(self.vocab_size, self.tokenizer_vocab_size or self.vocab_size)


class Runner(Protocol):
    """What the engine core drives: a model runner (`fake_runner` implements it in tests)."""

    info: RunnerInfo
    tokenizer: object

    def run_step(self, inputs) -> StepOutputs | None: ...

    def dispatch_step(self, inputs, prev: "PendingStep | None" = None) -> "PendingStep": ...


class PendingStep:
    """A dispatched step: its sampled tokens as a device array (`tokens`, padded rows, to feed a
    later step; None for a step that samples nothing) and, on `result()`, its outputs on the
    host (waits for the device)."""

    def __init__(self, jax, out, on_result: Callable[[], None] = lambda: None):
        self._jax, self._out = jax, out
        self.tokens = None if out is None else out[0]
        self._host: StepOutputs | None = None
        self._on_result = on_result  # told once the outputs are on the host

    def result(self) -> StepOutputs | None:
        if self._out is not None:
            self._host = StepOutputs(*self._jax.device_get(tuple(self._out)))
            self._out = None
            self._on_result()
        return self._host


def feed_tokens(prev, host_src):
    """Input tokens of a step: with host, src = host_src [2, T] (one array: one transfer),
    row i is prev[src[i]] (a token still on the device) where src[i] >= 0, else host[i]."""
    import jax.numpy as jnp

    host, src = host_src[0], host_src[1]
    return jnp.where(src >= 0, prev[jnp.clip(src, 0, prev.shape[0] - 1)], host)
