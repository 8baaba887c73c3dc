"""Serving: an OpenAI-compatible HTTP server over a continuous-batching engine.

Layers, from the model up: `engine` (the model's prefill/decode programs, cache slots, on-device
`sampling`), `scheduler` (waiting queue, continuous batching, the engine thread, `detokenize`,
stop conditions), `endpoints` / `api` (FastAPI app, validation, OpenAI formats), `metrics`, and
`cli` (`gemma3-serve`, `gemma3-generate`) configured by `config`. `fake_engine` is a deterministic
stand-in for the model used to test the layers above the engine.
"""
