"""Output processing: the engine's step outputs (token ids, logprobs) become what a consumer sees.

For every sequence it detokenizes (UTF-8 safe, `detokenize.TextStream`), decides when the
sequence ends (EOS or a stop token, a stop string, max_tokens, the context), builds its `Event`s,
records the per-token and per-request metrics and delivers the events to the sequence's sink.
It knows nothing of pages or queues: the engine core frees the pages of the sequences it reports
ended (vLLM v1's output processor; here it runs on the engine thread).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, NamedTuple

from serving.detokenize import TextStream
from serving.runner import RunnerInfo, StepOutputs
from serving.metrics import NullMetrics
from serving.sequence import Sequence
from serving.structured_output import StructuredOutputs

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenInfo:
    id: int
    logprob: float | None = None  # None unless logprobs were requested
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Event:
    """New output of one sequence. The last event of a sequence has `finish_reason` set:
    "stop" (EOS, a stop token or string), "length" (max_tokens or the context), "abort"
    (cancelled, or the server is stopping) or "error" (`error` says why)."""

    text: str
    tokens: tuple[TokenInfo, ...]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_generated: int = 0
    # First event only, when prompt logprobs were requested: one entry per prompt token after the
    # first (the first token has no context to be scored in).
    prompt_logprobs: tuple[TokenInfo, ...] | None = None
    error: str | None = None


Sink = Callable[[Event], None]


class Emitted(NamedTuple):
    """An event for a sequence's sink (not yet delivered)."""

    seq: Sequence
    event: Event
    sink: Sink


@dataclasses.dataclass(eq=False)
class _Output:
    """What the output side keeps per live sequence."""

    sink: Sink
    stream: TextStream
    arrival: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    # The paged engine's prompt logprobs, gathered piece by piece: position t -> TokenInfo of
    # prompt token t + 1 (a recomputed piece overwrites its own).
    prompt_lps: dict | None = None


class OutputProcessor:
    """The step methods return the events they produced; `deliver` sends them (the engine core
    first frees the slots of the sequences whose event ends them)."""

    def __init__(self, tokenizer, info: RunnerInfo, metrics=None):
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics or NullMetrics()
        self._eos = set(info.eos_ids)
        self._live: dict[int, _Output] = {}
        # Grammar matchers of the live sequences that have one (structured output, tool calls).
        self.structured = StructuredOutputs(info.vocab_size, info.eos_ids, info.max_seq_len, tokenizer,
                                            never_generate=info.never_generate)

    def add(self, seq: Sequence, sink: Sink, arrival: float) -> None:
        self._live[seq.id] = _Output(sink, TextStream(self.tokenizer, seq.params.stop, seq.params.min_tokens),
                                     arrival)
        self.structured.add(seq)

    def is_live(self, seq_id: int) -> bool:
        """Whether a sequence still gets events (it has not ended)."""
        return seq_id in self._live

    def on_step(self, plan, out: StepOutputs | None, started: float, now: float) -> list[Emitted]:
        """A ragged step (`paged_scheduler.StepPlan`) that began at `started`: the next token
        of every piece that samples (row i is piece i). A sequence that ended after the step
        was dispatched (overlapped steps: a stop seen one step late, or a cancel) has a row
        too: its token is discarded."""
        events = []
        decoding = 0
        first = 0  # the flat index of the piece's first token
        for row, p in enumerate(plan.pieces):
            s = p.seq
            if p.admitted and not s.generated and s.id in self._live:
                self.metrics.on_scheduled(started - self._live[s.id].arrival)
            if p.end - p.start > 1 or not s.generated:
                self.metrics.on_prefill([p.end - p.start], now - started, plan.num_tokens, len(plan.pieces))
            else:
                decoding += 1
            try:
                event = self._on_piece(p, out, row, first, now)
            except Exception as e:  # one sequence's failure (its text, its grammar) is its own
                log.exception("sequence %d: processing its outputs failed", s.id)
                event = None if s.id not in self._live else self._end(s, Event(
                    text="", tokens=(), finish_reason="error", num_prompt_tokens=len(s.prompt),
                    num_generated=len(s.generated),
                    error=f"output processing failed: {type(e).__name__}: {str(e)[:400]}"), now)
            if event is not None:
                events.append(event)
            first += p.end - p.start
        if decoding:
            self.metrics.on_decode(len(plan.pieces), decoding)
        self.structured.prefetch()
        return events

    def _on_piece(self, p, out: StepOutputs, row: int, first: int, now: float) -> Emitted | None:
        """A piece's outputs: its prompt tokens' logprobs when asked for, its next token when it
        samples one (flat tokens first.. of the step are the piece's)."""
        s = p.seq
        lps = None
        if s.want_prompt_logprobs and s.id in self._live and not s.generated:
            lps = self._gather_prompt_logprobs(s, p, out, first)
        if p.sample and s.id in self._live:
            return self._on_token(s, out, row, now, lps)
        return None

    def finish(self, seqs: list[Sequence], reason: str, error: str | None,
               now: float) -> list[Emitted]:
        """The last event of sequences ended from outside (cancelled, failed, shut down)."""
        return [self._end(s, Event(text="", tokens=(), finish_reason=reason, num_prompt_tokens=len(s.prompt),
                                   num_generated=len(s.generated), error=error), now)
                for s in seqs if s.id in self._live]

    def _gather_prompt_logprobs(self, s: Sequence, p, out: StepOutputs, first: int):
        """Keeps the logprobs of the prompt tokens after piece p's (flat tokens first..);
        returns them all, in order, when the piece ends the prompt."""
        o = self._live[s.id]
        if o.prompt_lps is None:
            o.prompt_lps = {}
        n_top = s.params.logprobs or 0
        for t in range(p.start, min(p.end, len(s.prompt) - 1)):
            i = first + t - p.start
            o.prompt_lps[t] = _scored(s.prompt[t + 1], out.prompt_logprobs[i],
                                      out.prompt_top_ids[i], out.prompt_top_logprobs[i], n_top)
        if not p.sample:
            return None
        lps, o.prompt_lps = o.prompt_lps, None
        return tuple(lps[t] for t in range(len(s.prompt) - 1))

    @staticmethod
    def deliver(events: list[Emitted]) -> None:
        for e in events:
            try:
                e.sink(e.event)
            except Exception:  # a consumer that went away must not stop the engine
                log.exception("delivering an event for sequence %d failed", e.seq.id)

    def _on_token(self, s: Sequence, out: StepOutputs, row: int, now: float,
                  prompt_lps) -> Emitted:
        o = self._live[s.id]
        tok = int(out.tokens[row])
        s.generated.append(tok)
        if o.first_token_at is None:
            o.first_token_at = now
            self.metrics.on_first_token(now - o.arrival)
        else:
            self.metrics.on_next_token(now - o.last_token_at)
        o.last_token_at = now
        info = (_token_info(out, row, tok, s.params.logprobs),)
        p = s.params
        reason = error = None
        # Every token a grammar row samples, EOS too, goes through its matcher first: a token the
        # grammar refuses (or a grammar that failed) ends the sequence with an error, and its
        # text is never sent.
        grammar_end = p.grammar is not None and self.structured.accept(s.id, tok)
        if grammar_end == "error":
            text, info = "", ()
            reason, error = "error", self.structured.error(s.id)
        elif (tok in self._eos and not p.ignore_eos) or tok in p.stop_token_ids:
            # The stop token counts as generated but is part of neither the text nor the logprobs.
            text, info = o.stream.finish(), ()
            reason = "stop"
        else:
            text, stopped = o.stream.add(tok)
            # A grammar that can take nothing more ends the sequence (no step spent on EOS).
            if stopped:
                reason = "stop"
            elif grammar_end == "stop":
                text += o.stream.finish()
                reason = "stop"
            elif len(s.generated) >= p.max_tokens or s.length >= self.info.max_seq_len:
                text += o.stream.finish()
                reason = "length"
        event = Event(text=text, tokens=info, finish_reason=reason, num_prompt_tokens=len(s.prompt),
                      num_generated=len(s.generated), prompt_logprobs=prompt_lps, error=error)
        if reason is None:
            return Emitted(s, event, o.sink)
        return self._end(s, event, now)

    def _end(self, s: Sequence, event: Event, now: float) -> Emitted:
        o = self._live.pop(s.id)
        self.structured.remove(s.id)
        self.metrics.on_finish(event.finish_reason, now - o.arrival,
                               None if o.first_token_at is None else now - o.first_token_at)
        return Emitted(s, event, o.sink)


def _token_info(out: StepOutputs, row: int, tok: int, n_top: int | None) -> TokenInfo:
    if n_top is None:
        return TokenInfo(tok)
    return _scored(tok, out.logprobs[row], out.top_ids[row], out.top_logprobs[row], n_top)


def _scored(tok: int, logprob, top_ids, top_logprobs, n_top: int) -> TokenInfo:
    """A token with its logprob and its n_top best alternatives (id, logprob)."""
    top = tuple((int(i), float(v)) for i, v in zip(top_ids[:n_top], top_logprobs[:n_top]))
    return TokenInfo(tok, float(logprob), top)
