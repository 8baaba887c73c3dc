"""Incremental detokenization and stop strings, on the host.

`IncrementalDetokenizer` releases text only once it no longer ends in U+FFFD (a character split over
byte tokens), decoding a short window of tokens each step. `TextStream` holds back a tail that may
start a stop string and cuts the output before a match (OpenAI semantics). See docs/usage.md, "Chat
templates and streamed text"."""
from __future__ import annotations

import os

from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character."""

    def __init__(self, tokenizer: Decoder):
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the decoding window (a few tokens of context)
        self._read = 0  # tokens up to here have been released as text

    def add(self, token_id: int) -> str:
        """Appends a token; returns the newly complete text (possibly empty)."""
        self.ids.append(int(token_id))
        return self._release(final=False)

    def flush(self) -> str:
        """Releases whatever is left, incomplete characters included (end of the sequence)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        done = self._tok.decode(self.ids[self._prefix:self._read])
        text = self._tok.decode(self.ids[self._prefix:])
        if not final and (text.endswith(_REPLACEMENT) or len(text) <= len(done)):
            return ""
        # Decoding a window, not the whole sequence, can change how its first token renders; the
        # text before `_read` was decoded with the same window start, so the difference is exact.
        delta = text[len(done):] if text.startswith(done) else text[len(os.path.commonprefix([text, done])):]
        self._prefix, self._read = self._read, len(self.ids)
        return delta




class TextStream:
    """Detokenizer plus stop strings. `add` returns (text delta to emit, stopped). No stop string
    ends the text until more than `min_tokens` tokens were added (vLLM's min_tokens)."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (), min_tokens: int = 0):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._min_tokens = min_tokens
        self._tokens = 0
        self._checked = 0  # the text up to here has been looked at for stop strings
        self.text = ""  # all text produced so far (up to a stop string, excluded)
        self._emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> tuple[str, bool]:
        if self.stopped:
            raise RuntimeError("token added after a stop string matched")
        self._tokens += 1
        self.text += self._detok.add(token_id)
        return self._emit(final=False)

    def finish(self) -> str:
        """Ends the sequence (a token or length limit): releases the held-back text."""
        if self.stopped:
            return ""
        self.text += self._detok.flush()
        return self._emit(final=True)[0]

    def _emit(self, final: bool) -> tuple[str, bool]:
        if self._stop and self._tokens > self._min_tokens:
            # Only a match that ends in new text: an older one was found before, or it ended
            # within min_tokens, where it does not count. (The hold-back below keeps a match
            # that straddles the boundary unemitted, during min_tokens too.)
            hits = [i for i in (self.text.find(s, max(0, self._checked - len(s) + 1)) for s in self._stop)
                    if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
                final = True
        self._checked = len(self.text)
        end = len(self.text) if final else len(self.text) - self._partial_match()
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta, self.stopped

    def _partial_match(self) -> int:
        """Length of the longest unreleased tail of the text that begins some stop string."""
        for n in range(min(self._hold, len(self.text) - self._emitted), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
