"""Serving: an OpenAI-compatible HTTP server over a continuous-batching engine.

Layers, from the model up: the model runner (`paged_runner`: device inputs from a plan, the
paged KV cache, on-device `sampling`, outputs to the host; `runner` says what every runner
shares), the scheduler (`paged_scheduler` over `kv_pages`: the batching policy, plain data in,
a plan per step out; `sequence`: what it schedules), `engine_core` (the engine thread: runs each
plan on the runner; submit and cancel), `output_processor` (`detokenize`, stop conditions,
events, per-request `metrics`), `endpoints` / `api` (FastAPI app, validation, OpenAI formats),
and `cli` (`gemma3-serve`, `gemma3-generate`) configured by `config`. `fake_runner` is a
deterministic stand-in for the model used to test the layers above the runner.

The public API is the names below, for programs that drive the engine without HTTP (the benchmarks
in eval/ use nothing else): build it from a `ServerConfig` (`load_runner`, or `configure_jax` +
`load_configured_model` + `PagedRunner`), run it step by step (the `PagedScheduler` plans a
`StepPlan` of `Piece`s over `KVPages`, `step_inputs` makes its arrays, `SamplingMetadata` its
sampling rows) or through an `EngineCore` (submit requests with `SamplingParams`);
`build_grammar`, `StructuredOutputs`, `Sequence` and `step_extras` are the pieces of a
constrained step. They load on first use, so importing `serving` imports no jax.
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    "ServerConfig": "serving.config",
    "configure_jax": "serving.runtime",
    "load_configured_model": "serving.runtime",
    "load_runner": "serving.runtime",
    "PagedRunner": "serving.paged_runner",
    "paged_runner_info": "serving.paged_runner",
    "local_pages_for": "serving.paged_steps",
    "step_inputs": "serving.paged_steps",
    "PagedScheduler": "serving.paged_scheduler",
    "Piece": "serving.paged_scheduler",
    "StepPlan": "serving.paged_scheduler",
    "KVPages": "serving.kv_pages",
    "IDLE": "serving.sampling",
    "SeqImage": "serving.sequence",
    "EngineCore": "serving.engine_core",
    "LLM": "serving.llm",
    "SamplingParams": "serving.sampling",
    "SamplingMetadata": "serving.sampling",
    "Sequence": "serving.sequence",
    "StructuredOutputs": "serving.structured_output",
    "build_grammar": "serving.structured_output",
    "step_extras": "serving.logits_processing",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
