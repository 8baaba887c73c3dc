"""Building OpenAI response bodies and stream chunks from the output processor's events."""
from __future__ import annotations

import re

from serving.output_processor import Event, TokenInfo

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_str(tok, token_id: int) -> str:
    """A token as text. A byte-fallback token (part of a multi-byte character) or a control token
    has no text of its own and is shown as its piece, e.g. '<0xE2>' or '<start_of_turn>';
    `token_bytes` gives a token's real bytes."""
    text = tok.decode([token_id])
    if "\ufffd" in text or not text:  # byte pieces, and control tokens (which decode to nothing)
        return tok.id_to_piece(token_id)
    return text


def token_bytes(tok, token_id: int) -> list[int]:
    m = _BYTE_PIECE.match(tok.id_to_piece(token_id))
    if m:
        return [int(m.group(1), 16)]
    return list(tok.decode([token_id]).encode("utf-8"))


def token_text_len(tok, token_id: int) -> int:
    """Characters a token adds to the text: a byte-fallback token adds one for the first byte of a
    character (ASCII or a UTF-8 lead byte) and none for continuation bytes, so offsets stay exact."""
    m = _BYTE_PIECE.match(tok.id_to_piece(token_id))
    if m:
        return 0 if 0x80 <= int(m.group(1), 16) < 0xC0 else 1
    return len(tok.decode([token_id]))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Choice:
    """Accumulates one sequence's events; `add` returns what is new in the formats we send."""

    def __init__(self, tok, index: int, n_top: int | None):
        self.tok, self.index, self.n_top = tok, index, n_top
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_generated = 0
        self.echo_text = ""
        self._echo: tuple[list[int], bool] | None = None
        self._entries: list[tuple[TokenInfo, int | None]] = []  # (token, text offset)
        self._offset = 0
        self._started = False

    def echo(self, text: str, prompt_ids: list[int], skip_first: bool) -> None:
        """Completions `echo`: the prompt text (and, with logprobs, its tokens) come first.
        skip_first: the first id is the BOS we added, not part of the user's prompt."""
        self.echo_text = text
        self._echo = (prompt_ids, skip_first)

    def add(self, event: Event) -> dict:
        new: list[tuple[TokenInfo, int | None]] = []
        text = event.text
        if not self._started:
            self._started = True
            if self._echo is not None:
                text = self.echo_text + text
                if self.n_top is not None:
                    new += self._echo_entries(event.prompt_logprobs or ())
                else:
                    self._offset += len(self.echo_text)
        self.text += text
        self.token_ids += [t.id for t in event.tokens]
        self.num_generated = max(self.num_generated, event.num_generated)
        for t in event.tokens if self.n_top is not None else ():
            new.append((t, self._offset))
            self._offset += token_text_len(self.tok, t.id)
        self._entries += new
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            if event.finish_reason == "error":
                self.error = event.error or "generation failed"
        return {"text": text, "finish_reason": self._public_reason(event.finish_reason),
                "logprobs": self._completion_logprobs(new) if new else None,
                "chat_logprobs": self._chat_logprobs(new) if new else None,
                "error": self.error if event.finish_reason == "error" else None}

    def _echo_entries(self, scored: tuple[TokenInfo, ...]) -> list:
        ids, skip_first = self._echo
        infos = list(scored) if skip_first else [TokenInfo(ids[0])] + list(scored)
        out = []
        for t in infos:
            out.append((t, self._offset))
            self._offset += token_text_len(self.tok, t.id)
        return out

    @staticmethod
    def _public_reason(reason: str | None) -> str | None:
        # OpenAI clients know stop and length; a cancelled or failed sequence ends as "stop".
        return None if reason is None else reason if reason in ("stop", "length") else "stop"

    # ---- formats ----

    def _completion_logprobs(self, entries) -> dict:
        return {
            "tokens": [token_str(self.tok, t.id) for t, _ in entries],
            "token_logprobs": [t.logprob for t, _ in entries],
            "top_logprobs": [None if t.logprob is None else
                             {token_str(self.tok, i): lp for i, lp in t.top} for t, _ in entries],
            "text_offset": [off for _, off in entries],
        }

    def _chat_logprobs(self, entries) -> dict:
        def item(i, lp):
            return {"token": token_str(self.tok, i), "logprob": lp, "bytes": token_bytes(self.tok, i)}
        return {"content": [{**item(t.id, t.logprob), "top_logprobs": [item(i, lp) for i, lp in t.top]}
                            for t, _ in entries]}

    def completion_choice(self) -> dict:
        return {"index": self.index, "text": self.text,
                "logprobs": self._completion_logprobs(self._entries) if self.n_top is not None else None,
                "finish_reason": self._public_reason(self.finish_reason)}

    def chat_choice(self) -> dict:
        return {"index": self.index, "message": {"role": "assistant", "content": self.text},
                "logprobs": self._chat_logprobs(self._entries) if self.n_top is not None else None,
                "finish_reason": self._public_reason(self.finish_reason)}

    def native_logprobs(self) -> list[dict]:
        return [{"id": t.id, "token": token_str(self.tok, t.id), "logprob": t.logprob,
                 "top": [{"id": i, "token": token_str(self.tok, i), "logprob": lp} for i, lp in t.top]}
                for t, _ in self._entries]


def _chunk(kind: str, rid, created, model, choice: dict, include_usage: bool) -> dict:
    chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
    if include_usage:  # OpenAI: null on every chunk but the last, usage-only one
        chunk["usage"] = None
    return chunk


def completion_chunk(rid, created, model, index, text, logprobs, finish_reason, include_usage) -> dict:
    return _chunk("text_completion", rid, created, model, {
        "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}, include_usage)


def chat_chunk(rid, created, model, index, delta, logprobs, finish_reason, include_usage) -> dict:
    return _chunk("chat.completion.chunk", rid, created, model, {
        "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}, include_usage)
