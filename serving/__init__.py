"""Serving: an OpenAI-compatible HTTP server over a continuous-batching engine.

Layers, from the model up: `engine` (the model's prefill/decode programs, cache slots, on-device
`sampling`), `scheduler` (the batching policy: plain data in, a plan per step out), `engine_core`
(the engine thread: executes each plan; submit and cancel), `output_processor` (`detokenize`, stop
conditions, events, per-request `metrics`), `endpoints` / `api` (FastAPI app, validation, OpenAI
formats), and `cli` (`gemma3-serve`, `gemma3-generate`) configured by `config`. `fake_engine` is
a deterministic stand-in for the model used to test the layers above the engine.
"""
