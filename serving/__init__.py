"""Serving: an OpenAI-compatible HTTP server over a continuous-batching engine.

Layers, from the model up: the model runner (`paged_runner`: device inputs from a plan, the
paged KV cache, on-device `sampling`, outputs to the host; `runner` says what every runner
shares), the scheduler (`paged_scheduler` over `kv_pages`: the batching policy, plain data in,
a plan per step out; `sequence`: what it schedules), `engine_core` (the engine thread: runs each
plan on the runner; submit and cancel), `output_processor` (`detokenize`, stop conditions,
events, per-request `metrics`), `endpoints` / `api` (FastAPI app, validation, OpenAI formats),
and `cli` (`gemma3-serve`, `gemma3-generate`) configured by `config`. `fake_runner` is a
deterministic stand-in for the model used to test the layers above the runner.

The public API is the names below, for programs that run the engine without HTTP: build it
from a `ServerConfig` (`load_runner`, or `configure_jax` + `load_configured_model` + a
`PagedRunner`), run requests through an `EngineCore` (token ids, `SamplingParams`, images as
`SeqImage`s) or `LLM` (offline generation); `StructuredOutputs` and `build_grammar` are
constrained decoding's. Planning without running a model: `paged_runner_info` (an engine's
pools and budget for some settings), `PagedScheduler` (plain data in, a plan per step out) over
`Sequence`s, `step_inputs` (a plan's step arrays; `IDLE` a row that samples nothing). They load
on first use, so importing `serving` imports no jax.
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    "ServerConfig": "serving.config",
    "configure_jax": "serving.runtime",
    "load_configured_model": "serving.runtime",
    "load_runner": "serving.runtime",
    "PagedRunner": "serving.paged_runner",
    "EngineCore": "serving.engine_core",
    "LLM": "serving.llm",
    "SamplingParams": "serving.sampling",
    "SeqImage": "serving.sequence",
    "StructuredOutputs": "serving.structured_output",
    "build_grammar": "serving.structured_output",
    "paged_runner_info": "serving.paged_runner",
    "PagedScheduler": "serving.paged_scheduler",
    "Sequence": "serving.sequence",
    "step_inputs": "serving.paged_steps",
    "IDLE": "serving.sampling",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
