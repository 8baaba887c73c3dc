"""Serving: an OpenAI-compatible HTTP server over a continuous-batching engine.

The layers (HTTP -> engine core -> scheduler -> model runner -> step API) are laid out in
docs/engine.md, "Layers, by name". The names below are the public API, for programs that run the
engine without HTTP: build it from a `ServerConfig`, run requests through an `EngineCore` or `LLM`,
or plan steps without a model (`PagedScheduler`, `step_inputs`). They load on first use, so
importing `serving` imports no jax."""
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
