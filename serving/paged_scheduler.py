"""The token-budget policy of the paged engine: which sequences compute which tokens in the next
ragged step. Plain data in, a `StepPlan` out; it runs nothing (vLLM v1's scheduler).

Every step is one flat batch of at most `max_num_batched_tokens` tokens:
1. Running sequences first: one token each for those decoding (oldest first), then the next
   piece of the prompt (at most `chunk_size` tokens) for those still prefilling.
2. Then waiting sequences, oldest first, while the budget, `max_num_seqs` and free pages last: a
   prefix-cache lookup, then their first piece.
A sequence computes tokens `computed .. computed+n-1` of `prompt + generated`; when that reaches
its last token the step samples its next one. So a decode is a piece of one token, and a
sequence that was preempted simply recomputes its whole text in pieces.

A piece stops before the soft tokens of an image whose features are not ready yet
(`image_ready`), and the plan lists the images its sequences wait for (`StepPlan.encode`): the
engine encodes them a bounded piece per step (`serving/image_encoder.py`).

Pages (`serving/kv_pages.py`) are taken as a piece needs them. A running sequence that finds none
free takes them from the newest running sequence, which is preempted: its pages go back (full
prompt pages stay cached), it returns to the head of the waiting queue and recomputes later,
losing no token it produced (vLLM's recompute preemption). Admission never preempts: a waiting
sequence waits for pages.

A prompt piece takes what is left of the budget, up to `chunk_size` tokens (a lone sequence:
the whole budget, see `_piece_len`); full pages are
named in the prefix cache as soon as they are planned (a later step's reader runs after the
writer: the device runs steps in order). In deterministic mode every piece is exactly
`chunk_size` tokens at multiples of it (the last one shorter), whatever else runs in the step, so
a request's pieces are a function of the request alone.

Not thread-safe: the engine core serialises every call.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from serving.runner import RunnerInfo
from serving.kv_pages import KVPages, block_hashes
from serving.sampling import InvalidParameter
from serving.scheduler import Sequence, WaitingQueue


@dataclasses.dataclass(frozen=True)
class Piece:
    """Tokens start..end-1 of `seq`'s text computed in one step; `sample`: the step samples the
    sequence's next token from the logits of position end-1. `fed`: token end-1 is the one the
    step before sampled, not on the host when the step was planned (the engine core's
    overlapped loop feeds it from the device)."""

    seq: Sequence
    start: int
    end: int
    admitted: bool = False  # the sequence left the waiting queue for this step
    sample: bool = False
    fed: bool = False

    @property
    def tokens(self) -> list[int]:
        """The piece's tokens on the host (a fed piece's last one once it arrived)."""
        text = self.seq.prompt + self.seq.generated
        return text[self.start:self.end]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    pieces: tuple[Piece, ...] = ()
    preempted: tuple[Sequence, ...] = ()  # sent back to the waiting queue by this step
    lookups: tuple[tuple[int, int], ...] = ()  # (prompt tokens looked up, tokens found) per admission
    # Images (scheduler.SeqImage) whose features a piece waits for, oldest sequence first: the
    # engine advances their encoding after the step (serving/image_encoder.py).
    encode: tuple = ()

    @property
    def num_tokens(self) -> int:
        return sum(p.end - p.start for p in self.pieces)


class PagedScheduler(WaitingQueue):
    def __init__(self, info: RunnerInfo, max_waiting: int = 256):
        if not info.page_size:
            raise ValueError("the paged scheduler needs an engine with a page size")
        super().__init__(info, max_waiting)
        self._running: list[Sequence] = []  # admission order (the newest is preempted first)
        self.kv = KVPages(info.page_size, info.num_global_pages, info.num_local_pages,
                          info.sliding_window, info.has_global_layers)
        self.prefix_caching = bool(info.prefix_blocks)
        self.num_preemptions = 0
        # The text length each sequence has once the token the last planned step samples for
        # it arrives: with the engine core's overlapped loop a step is planned before the
        # previous step's outputs reach the host, so the text is one token longer than the
        # host knows until then.
        self._sampled_to: dict[int, int] = {}
        # Whether an image's features (by content hash) are ready; the engine core sets it to
        # the engine's. Always, by default: then the engine encodes an image in the step that
        # needs it.
        self.image_ready: Callable[[str], bool] = lambda key: True
        self._wanted: list = []

    def admissible(self, seq: Sequence) -> None:
        if seq.want_prompt_logprobs and seq.images:
            raise InvalidParameter("logprobs", "the prompt's own logprobs (echo with logprobs) "
                                   "are not served for prompts with images")

    def _length(self, s: Sequence) -> int:
        """The sequence's text length, with the token a step in flight samples for it."""
        return max(s.length, self._sampled_to.get(s.id, 0))

    def finish(self, seq: Sequence) -> bool:
        """A sequence ended: its pages go back. Returns whether it was running."""
        self._sampled_to.pop(seq.id, None)
        if seq in self._running:
            self._running.remove(seq)
            self.kv.free(seq.id)
            return True
        return False

    def reset_prefix_cache(self) -> None:
        """After an engine failure: the device pages may be lost (running sequences were
        aborted before)."""
        self.kv.reset()

    # ---- state ----

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def kv_usage(self) -> float:
        return self.kv.usage()

    # ---- the policy ----

    def schedule(self) -> StepPlan:
        budget = self.info.max_num_batched_tokens
        self._wanted = []
        pieces: list[Piece] = []
        preempted: list[Sequence] = []
        # Decodes first (oldest first), then the running prompts' pieces: a stream never waits
        # for a prompt's prefill.
        order = sorted(self._running, key=lambda q: self._length(q) - q.computed > 1)
        planned: set[int] = set()
        alone = len(self._running) + len(self.waiting) == 1
        for s in order:
            if s not in self._running:  # preempted for an older sequence in this loop
                continue
            n = self._piece_len(s, budget, alone=alone)
            if n == 0:
                continue
            while not self.kv.can_allocate(s.id, s.computed, s.computed + n):
                # The newest running sequence not yet planned in this step gives way.
                victim = next((v for v in reversed(self._running) if v.id not in planned), None)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim is s:
                    break
            if s not in self._running or not self.kv.can_allocate(s.id, s.computed, s.computed + n):
                continue
            self.kv.allocate(s.id, s.computed, s.computed + n)
            pieces.append(self._piece(s, s.computed, s.computed + n))
            planned.add(s.id)
            budget -= n
        lookups = []
        while self.waiting and budget > 0 and len(self._running) < self.info.num_slots:
            s = self.waiting[0]
            if s.length < self._length(s):  # preempted with its last token in flight
                break
            hit = 0
            if s.hashes is None:
                s.hashes = (block_hashes(s.prompt, self.info.page_size,
                                         [(im.spans, im.key) for im in s.images])
                            if self.prefix_caching else [])
            # A sequence that wants its prompt's logprobs computes every prompt token.
            lookup = self.prefix_caching and not s.want_prompt_logprobs
            if s.computed == 0 and lookup:
                # The last token is always computed: it yields the next token.
                hit = self.kv.lookup_prefix(s.hashes, (s.length - 1) // self.info.page_size)
                hit = self._aligned_hit(hit)
            start = hit * self.info.page_size
            n = self._piece_len(s, budget, start, alone=alone)
            if n == 0 or not self.kv.can_allocate(s.id, start, start + n):
                break
            self.waiting.popleft()
            if hit:
                self.kv.attach_prefix(s.id, s.hashes, hit)
            s.computed = start
            self.kv.allocate(s.id, start, start + n)
            self._running.append(s)
            if lookup:
                lookups.append((s.length, start))
                self.kv.queries += s.length
                self.kv.hits += start
            pieces.append(self._piece(s, start, start + n, admitted=True))
            budget -= n
        for p in pieces:
            p.seq.computed = p.end
            if p.sample:
                self._sampled_to[p.seq.id] = p.end + 1
            if self.prefix_caching:
                self.kv.name_full_pages(p.seq.id, p.seq.hashes, p.end)
        self._next_images()
        encode, seen = [], set()
        for im in self._wanted:  # each image once, oldest sequence first
            if im.key not in seen:
                seen.add(im.key)
                encode.append(im)
        return StepPlan(tuple(pieces), tuple(preempted), tuple(lookups), tuple(encode))

    def _piece(self, s: Sequence, start: int, end: int, admitted: bool = False) -> Piece:
        length = self._length(s)
        return Piece(s, start, end, admitted, sample=end == length, fed=end > s.length)

    def _aligned_hit(self, pages: int) -> int:
        """In deterministic mode a prefix hit must end on a chunk boundary (pieces start there)."""
        if not self.info.deterministic:
            return pages
        per_chunk = self.info.chunk_size // self.info.page_size
        return pages - pages % per_chunk

    def _piece_len(self, s: Sequence, budget: int, start: int | None = None,
                   alone: bool = False) -> int:
        """Tokens the sequence computes this step within `budget` (0: none); a piece that
        would end inside an image's soft tokens runs on to the image's end (`_past_images`).

        A piece is at most `chunk_size` tokens while other sequences run or wait (a stream's
        inter-token latency is one step, and prompts share the steps). A lone sequence
        (`alone`: the only one running or waiting), outside deterministic mode, takes the whole
        budget instead: a lone prompt is not fed `chunk_size` tokens a step with the budget
        idle; but only as far as pages allow (a longer piece holds more of the window's local
        pages). A request that arrives meanwhile waits for one such step at most."""
        start = s.computed if start is None else start
        n = self._plain_piece_len(s, budget, start)
        if alone and n and not self.info.deterministic:
            longer = self._plain_piece_len(s, budget, start, self.info.max_num_batched_tokens)
            if longer > n and self.kv.can_allocate(s.id, start, start + longer):
                n = longer
        n = self._before_unready_image(s, start, n)
        return self._past_images(s, start, n) if n else 0

    def _next_images(self) -> None:
        """Every running sequence's next image whose features are not ready joins the step's
        `encode` list, whether or not the token budget let the sequence run a piece: the
        encoder's work has its own budget (serving/image_encoder.py), and starts early."""
        for s in self._running:
            im = next((im for im in s.images if max(b for _, b in im.spans) > s.computed), None)
            if im is not None and not self.image_ready(im.key):
                self._wanted.append(im)

    def _before_unready_image(self, s: Sequence, start: int, n: int) -> int:
        """n, or fewer where the piece would reach the soft tokens of an image whose features
        are not ready: it stops before them and the image joins the step's `encode` list. In
        deterministic mode such a piece waits whole (0): pieces stay a function of the request
        alone, whatever the encoder's progress."""
        for im in s.images:
            if any(a < start + n and start < b for a, b in im.spans) and not self.image_ready(im.key):
                self._wanted.append(im)
                a = min(a for a, b in im.spans if a < start + n and start < b)
                return 0 if self.info.deterministic else max(0, a - start)
        return n

    @staticmethod
    def _past_images(s: Sequence, start: int, n: int) -> int:
        """n, or more where start + n falls inside an image's soft-token span: the soft
        tokens see each other both ways, so all of a span's keys must be written in the step
        whose queries attend to them. Such a piece exceeds the chunk size (and the budget)
        by at most one image."""
        end = start + n
        for a, b in s.image_spans:
            if a < end < b:
                end = b
        return end - start

    def _plain_piece_len(self, s: Sequence, budget: int, start: int, limit: int = 0) -> int:
        """The piece within `budget` and `limit` tokens (0: the chunk size)."""
        left = self._length(s) - start
        if left <= 0:
            return 0
        if left == 1:
            return 1 if budget >= 1 else 0
        c = limit or self.info.chunk_size
        n = min(left, c - start % c if self.info.deterministic else c)
        if n <= budget:
            return n
        if self.info.deterministic:
            return 0  # a piece is never cut by what else runs
        return budget

    def _preempt(self, s: Sequence) -> None:
        """Frees a running sequence's pages and puts it first in line to recompute."""
        self._running.remove(s)
        self.kv.free(s.id)
        s.computed = 0
        self.waiting.appendleft(s)
        self.num_preemptions += 1
