"""A small deterministic model under the real engine, for testing the engine core and the HTTP layer
without a model: `fake_paged_runner` is the real `PagedRunner` over `FakePagedModel`.

Its greedy next token continues the context's shortest period (it repeats the prompt), so a test
knows the exact text. Its pages hold token ids and every step checks that each row reads back
exactly its context, so a scheduler or allocator bug raises."""
from __future__ import annotations

import dataclasses
import time

import numpy as np


_BYTE0 = 300  # token id of byte 0
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)


class ByteTokenizer:
    """Byte-level tokenizer with Gemma's special ids: byte b is token 300 + b."""

    pad_id, eos_id, bos_id, unk_id = 0, 1, 2, 3
    start_of_turn_id, end_of_turn_id = 105, 106
    vocab_size = _BYTE0 + 256

    def encode(self, text: str) -> list[int]:
        return [_BYTE0 + b for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) - _BYTE0 for i in ids if int(i) >= _BYTE0).decode("utf-8", errors="replace")

    def id_to_piece(self, i: int) -> str:
        i = int(i)
        if i >= _BYTE0:
            return f"<0x{i - _BYTE0:02X}>"
        return {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<start_of_turn>",
                106: "<end_of_turn>"}.get(i, f"<unused{i}>")


_NEG = -30.0  # a token the fake model never proposes (finite: penalties and biases add to it)


@dataclasses.dataclass(frozen=True)
class _FakeConfig:
    vocab_size: int
    max_seq_len: int
    sliding_window: int
    num_layers: int = 2

    def is_global(self, layer: int) -> bool:
        return layer % 2 == 1  # layer 0 slides, layer 1 sees everything: both page pools


class _FakeAllReduce:
    label = "bf16"

    @staticmethod
    def to_dict() -> dict:
        return {"method": "bf16"}


@dataclasses.dataclass
class _Pool:
    """A page pool whose "keys" are token ids and positions (+1: 0 marks a slot never written)."""

    tokens: np.ndarray
    positions: np.ndarray

    def write(self, slot: int, token: int, position: int) -> None:
        self.tokens[slot], self.positions[slot] = token, position + 1

    def read(self, slot: int, position: int, what: str) -> int:
        if self.positions[slot] != position + 1:
            raise AssertionError(f"{what}: position {position} is not where its block table says")
        return int(self.tokens[slot])


class FakePagedModel:
    """The fake engine's model for the real paged engine (`fake_paged_runner`): the real
    PagedScheduler, page allocator, step arrays and sampler run over it, so the HTTP tests meet
    chunks, pages, prefix-cache hits and preemption as the real model's server does.

    Its pages hold token ids. A step writes every token to its global and local slots, then
    reads each row's whole context back through its global block table and the last `window`
    positions through its local table, raising when a position is missing, misplaced or the two
    pools disagree: an allocator or scheduler bug raises instead of passing. The greedy next
    token continues the context's shortest period (the module docstring). Sampled tokens are
    drawn by the real sampler among the letters (logit -1) and the greedy token (logit 0)."""

    def __init__(self, max_seq_len: int = 64, window: int = 8, step_delay: float = 0.0):
        import jax

        self.tokenizer = ByteTokenizer()
        self.config = _FakeConfig(self.tokenizer.vocab_size, max_seq_len, window)
        self.tp, self.dtype, self.allreduce = 1, "float32", _FakeAllReduce()
        # Its steps read each row's context whatever the table's width, as the XLA form does.
        self.paged_attention = "xla"
        self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
        self.step_delay = step_delay
        self.page_size = 0
        self.steps: list[tuple[int, int]] = []  # (sequence rows, tokens) of every step, for tests

    def init_pages(self, num_global_pages: int, num_local_pages: int, page_size: int):
        self.page_size = page_size
        return tuple(_Pool(np.zeros(n * page_size, np.int32), np.zeros(n * page_size, np.int32))
                     for n in (num_global_pages, num_local_pages))

    def ragged_step(self, pages, batch, logits: bool = True, images=None, every_token=False):
        if images is not None:
            raise ValueError("the fake model takes no images")
        time.sleep(self.step_delay)
        glob, local = pages
        for i, (tok, pos) in enumerate(zip(batch.tokens, batch.positions)):
            glob.write(int(batch.write_global[i]), int(tok), int(pos))
            local.write(int(batch.write_local[i]), int(tok), int(pos))
        out = self._logits(len(batch.last))
        rows = [row for row, last in enumerate(batch.last) if batch.seq[last] == row]
        self.steps.append((len(rows), sum(int(batch.col[batch.last[r]]) + 1 for r in rows)))
        for row in rows:
            last = batch.last[row]
            # Every row reads its context, as the model's attention does, logits or not.
            context = self._context(batch, row, int(batch.positions[last]), glob, local)
            out[row, _continue_period(context)] = 0.0
        if not every_token:
            return (out if logits else None), pages
        every = self._logits(len(batch.tokens))  # prompt logprobs: every token's logits
        for i, (row, col) in enumerate(zip(batch.seq, batch.col)):
            if batch.queries[row, col] == i and batch.seq[batch.last[row]] == row:
                context = self._context(batch, int(row), int(batch.positions[i]), glob, local)
                every[i, _continue_period(context)] = 0.0
        return out, every, pages

    def _logits(self, rows: int) -> np.ndarray:
        out = np.full((rows, self.config.vocab_size), _NEG, np.float32)
        out[:, _BYTE0 + _LETTERS.astype(np.int32)] = -1.0
        return out

    def _context(self, batch, row: int, last: int, glob: _Pool, local: _Pool) -> list[int]:
        ps, w = self.page_size, self.config.sliding_window
        what = f"row {row}"
        context = [glob.read(int(batch.global_table[row, p // ps]) * ps + p % ps, p, what)
                   for p in range(last + 1)]
        for p in range(max(0, last - w + 1), last + 1):
            j = p // ps - int(batch.local_first[row])
            if not 0 <= j < batch.local_table.shape[1]:
                raise AssertionError(f"{what}: position {p} of the window is outside its local table")
            if local.read(int(batch.local_table[row, j]) * ps + p % ps, p, what) != context[p]:
                raise AssertionError(f"{what}: the local and global pages disagree at {p}")
        return context


def _continue_period(context: list[int]) -> int:
    """The token that continues context[1:] with its shortest period ('x' after BOS alone)."""
    s = context[1:]
    if not s:
        return _BYTE0 + ord("x")
    border = [0] * len(s)  # KMP: the longest proper border of each prefix
    for i in range(1, len(s)):
        k = border[i - 1]
        while k and s[i] != s[k]:
            k = border[k - 1]
        border[i] = k + (s[i] == s[k])
    return s[border[-1]]  # the period is len(s) - border[-1]: s[len(s) - period]


def fake_paged_runner(max_num_seqs: int = 4, max_seq_len: int = 64, step_delay: float = 0.0,
                      long_prefill_token_threshold: int = 8, page_size: int = 4, **kw):
    """The real PagedRunner over `FakePagedModel` (window 8: prompts outgrow it; pages of 4 and
    pieces of at most 8: a short prompt already spans pages and pieces)."""
    from serving.paged_runner import PagedRunner

    return PagedRunner(FakePagedModel(max_seq_len, step_delay=step_delay), max_num_seqs=max_num_seqs,
                       max_seq_len=max_seq_len, page_size=page_size,
                       long_prefill_token_threshold=long_prefill_token_threshold, model_name="fake", **kw)
