"""Offline generation on the server's own engine (vLLM's `LLM` over `EngineCore`): the same
scheduler, ragged step and sampler as `gemma3-serve`, so `generate` with a request's settings
and seed gives the server's tokens for it.

    from models.gemma3 import load_model
    from serving import LLM, SamplingParams
    with LLM(load_model("gemma3-270m")) as llm:
        ids = llm.generate([prompt_ids], SamplingParams(max_tokens=32, temperature=0))
"""
from __future__ import annotations

import threading
from typing import Sequence

from serving.sampling import SamplingParams


class LLM:
    """A model's paged runner and engine core, kept across `generate` calls (its step programs
    compile on first use). max_seq_len: the longest sequence (default: the server's 2,048, or
    the model's context if shorter); the other settings are `PagedRunner`'s."""

    def __init__(self, model, *, max_num_seqs: int = 8, max_seq_len: int | None = None,
                 **runner_settings):
        from serving.engine_core import EngineCore
        from serving.paged_runner import PagedRunner

        length = max_seq_len or min(2048, model.config.max_seq_len)
        self.runner = PagedRunner(model, max_num_seqs=max_num_seqs, max_seq_len=length,
                                  **runner_settings)
        self.core = EngineCore(self.runner).start()

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams()
                 ) -> list[list[int]]:
        """The new token ids of each prompt (token ids), all submitted at once. params: one for
        every prompt or one each; a sequence ends as a request would (max_tokens, EOS unless
        ignore_eos, stop_token_ids, stop strings). RuntimeError if one ends with an error."""
        prompts = [list(map(int, p)) for p in prompts]
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(each) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(each)} sampling parameters")
        sinks = [_Collect() for _ in prompts]
        self.core.submit([(p, sp, sink) for p, sp, sink in zip(prompts, each, sinks)])
        for sink in sinks:
            sink.done.wait()
            if sink.error is not None:
                raise RuntimeError(f"generation failed: {sink.error}")
        return [sink.ids for sink in sinks]

    def close(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Collect:
    """One sequence's token ids, until its last event."""

    def __init__(self):
        self.ids: list[int] = []
        self.error: str | None = None
        self.done = threading.Event()

    def __call__(self, event) -> None:
        self.ids += [t.id for t in event.tokens]
        if event.finish_reason is not None:
            self.error = event.error if event.finish_reason == "error" else None
            self.done.set()
