"""The token-budget policy of the paged engine: which sequences compute which tokens in the next
ragged step. Plain data in, a `StepPlan` out; it runs nothing (vLLM v1's scheduler).

Running sequences first (decodes, then prompt pieces), then waiting ones while budget, rows and
pages last; out of pages, the newest running sequence is preempted and recomputes later. Not
thread-safe: the engine core serialises calls. See docs/engine.md, "The paged engine"."""
from __future__ import annotations

import dataclasses
from typing import Callable

from serving.runner import RunnerInfo
from serving.kv_pages import KVPages, block_hashes
from serving.sampling import InvalidParameter
from serving.sequence import Sequence, WaitingQueue


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


@dataclasses.dataclass(frozen=True, eq=False)
class SpanJob:
    """Soft tokens start..end-1 of `seq` (one span of `image`: crop `crop`), whose keys the
    engine writes layer by layer between steps (serving/image_spans.py). Compared by identity:
    a sequence preempted and readmitted writes its span again as a new job."""

    seq: Sequence
    image: object  # sequence.SeqImage
    crop: int
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class StepPlan:
    pieces: tuple[Piece, ...] = ()
    preempted: tuple[Sequence, ...] = ()  # sent back to the waiting queue by this step
    lookups: tuple[tuple[int, int], ...] = ()  # (prompt tokens looked up, tokens found) per admission
    # Images (sequence.SeqImage) whose features a piece waits for, oldest sequence first: the
    # engine advances their encoding after the step (serving/image_encoder.py).
    encode: tuple = ()
    # Image spans being written between steps (SpanJob), each listed every step until written:
    # the engine drops the work of a span no longer listed (its sequence ended or was preempted).
    spans: tuple = ()

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
        self.prefix_caching = info.prefix_caching
        self.num_preemptions = 0
        self._piece_planned = False  # this step holds a prompt piece (deterministic mode)
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
        # Image spans written between steps (module docstring): off unless the engine core
        # turns it on; `span_written` is then the engine's.
        self.stage_spans = False
        self.span_written: Callable[[SpanJob], bool] = lambda job: True
        self._spans: dict[int, SpanJob] = {}  # sequence id -> its span being written

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
        self._spans.pop(seq.id, None)
        if seq in self._running:
            self._running.remove(seq)
            self.kv.free(seq.id)
            return True
        if seq in self.waiting:  # preempted while the step in flight sampled its last token:
            self.waiting.remove(seq)  # it ended there, and must not run on unwatched
        return False

    def abort_running(self) -> list[Sequence]:
        """Removes every running sequence after a failed step, whose tokens are lost: a sequence
        preempted while that step sampled its next token recomputes it instead of waiting."""
        failed = super().abort_running()
        self._sampled_to.clear()
        return failed

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
        self._piece_planned = False
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
            if not self._span_done(s):
                continue
            n = self._piece_len(s, budget, alone=alone)
            # No piece: perhaps an image's span is next, to be written between steps.
            job = self._span_at(s, s.computed) if n == 0 and self._stages_span(s, alone) else None
            end = job.end if job else s.computed + n
            if end == s.computed:
                continue
            while not self.kv.can_allocate(s.id, s.computed, end):
                # The newest running sequence not yet planned in this step gives way.
                victim = next((v for v in reversed(self._running) if v.id not in planned), None)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim is s:
                    break
            if s not in self._running or not self.kv.can_allocate(s.id, s.computed, end):
                continue
            self.kv.allocate(s.id, s.computed, end)
            planned.add(s.id)
            if job:
                self._spans[s.id] = job
                continue
            pieces.append(self._piece(s, s.computed, end))
            self._piece_planned |= n > 1
            budget -= n
        lookups = []
        while self.waiting and budget > 0 and len(self._running) < self.info.max_num_seqs:
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
            # A first piece that would be an image's span: the span is written between steps.
            job = self._span_at(s, start) if n == 0 and self._stages_span(s, alone) else None
            end = job.end if job else start + n
            if start == end or not self.kv.can_allocate(s.id, start, end):
                break
            self.waiting.popleft()
            if hit:
                self.kv.attach_prefix(s.id, s.hashes, hit)
            s.computed = start
            self.kv.allocate(s.id, start, end)
            self._running.append(s)
            if lookup:
                lookups.append((s.length, start))
                self.kv.queries += s.length
                self.kv.hits += start
            if job:
                self._spans[s.id] = job
            else:
                pieces.append(self._piece(s, start, end, admitted=True))
                self._piece_planned |= n > 1
            budget -= n
        for p in pieces:
            p.seq.computed = p.end
            if p.sample:
                self._sampled_to[p.seq.id] = p.end + 1
            if self.prefix_caching:
                self.kv.name_full_pages(p.seq.id, p.seq.hashes, p.end)
        self._next_images()
        spans = tuple(j for j in self._spans.values() if j.seq in self._running)
        encode, seen = [], set()
        for im in self._wanted:  # each image once, oldest sequence first
            if im.key not in seen:
                seen.add(im.key)
                encode.append(im)
        return StepPlan(tuple(pieces), tuple(preempted), tuple(lookups), tuple(encode), spans)

    def _span_done(self, s: Sequence) -> bool:
        """Whether s may run a piece: no span of it is being written, or the engine wrote it
        (then s's text up to the span's end is computed, and its full pages are named)."""
        job = self._spans.get(s.id)
        if job is None:
            return True
        if not self.span_written(job):
            return False
        del self._spans[s.id]
        s.computed = job.end
        if self.prefix_caching:
            self.kv.name_full_pages(s.id, s.hashes, job.end)
        return True

    def _stages_span(self, s: Sequence, alone: bool) -> bool:
        """Whether s's image spans are written between steps: while other sequences run or
        wait (alone, one step is fastest and stalls no one), and always in deterministic mode:
        there a request's computation must not depend on its neighbours, and the stages round
        a little differently from the one-step piece, so they run alone too."""
        return self.stage_spans and (self.info.deterministic or not alone)

    def _span_at(self, s: Sequence, start: int) -> SpanJob | None:
        """The span of an image with ready features that position `start` lies in (a span
        that ends the text is left to a piece: its last token samples)."""
        for im in s.images:
            for crop, (a, b) in enumerate(im.spans):
                if a <= start < b < self._length(s) and self.image_ready(im.key):
                    return SpanJob(s, im, crop, start, b)
        return None

    def _piece(self, s: Sequence, start: int, end: int, admitted: bool = False) -> Piece:
        length = self._length(s)
        return Piece(s, start, end, admitted, sample=end == length, fed=end > s.length)

    def _aligned_hit(self, pages: int) -> int:
        """In deterministic mode a prefix hit must end on a piece boundary (pieces start at
        multiples of long_prefill_token_threshold)."""
        if not self.info.deterministic:
            return pages
        per_piece = self.info.long_prefill_token_threshold // self.info.page_size
        return pages - pages % per_piece

    def _piece_len(self, s: Sequence, budget: int, start: int | None = None,
                   alone: bool = False) -> int:
        """Tokens the sequence computes this step within `budget` (0: none); a piece that
        would end inside an image's soft tokens runs on to the image's end (`_past_images`).

        A piece is at most `long_prefill_token_threshold` tokens while other sequences run or
        wait (a stream's inter-token latency is one step, and prompts share the steps). A lone
        sequence (`alone`: the only one running or waiting), outside deterministic mode, takes
        the whole budget instead: a lone prompt is not fed `long_prefill_token_threshold` tokens
        a step with the budget idle; but only as far as pages allow (a longer piece holds more
        of the window's local pages). A request that arrives meanwhile waits for one such step
        at most."""
        start = s.computed if start is None else start
        n = self._plain_piece_len(s, budget, start)
        if alone and n and not self.info.deterministic:
            longer = self._plain_piece_len(s, budget, start, self.info.max_num_batched_tokens)
            if longer > n and self.kv.can_allocate(s.id, start, start + longer):
                n = longer
        n = self._before_unready_image(s, start, n)
        if n and self._stages_span(s, alone):
            n = self._before_span(s, start, n)  # 0: the span itself is next (`_span_at`)
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

    def _before_span(self, s: Sequence, start: int, n: int) -> int:
        """n, or fewer where the piece would reach into a span `_span_at` would write."""
        for a, b in s.image_spans:
            if start < b and a < start + n and self._span_at(s, max(a, start)) is not None:
                return max(0, a - start)
        return n

    @staticmethod
    def _past_images(s: Sequence, start: int, n: int) -> int:
        """n, or more where start + n falls inside an image's soft-token span: the soft
        tokens see each other both ways, so all of a span's keys must be written in the step
        whose queries attend to them. Such a piece exceeds the threshold (and the budget)
        by at most one image."""
        end = start + n
        for a, b in s.image_spans:
            if a < end < b:
                end = b
        return end - start

    def _plain_piece_len(self, s: Sequence, budget: int, start: int, limit: int = 0) -> int:
        """The piece within `budget` and `limit` tokens (0: long_prefill_token_threshold)."""
        left = self._length(s) - start
        if left <= 0:
            return 0
        if left == 1:
            return 1 if budget >= 1 else 0
        if self.info.deterministic and self._piece_planned:
            return 0  # one prompt piece a step: its program has one row (paged_steps)
        c = limit or self.info.long_prefill_token_threshold
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
        self._spans.pop(s.id, None)
        s.computed = 0
        self.waiting.appendleft(s)
        self.num_preemptions += 1
