"""A sequence as the scheduler and the engine core see it (`Sequence`, its images `SeqImage`),
and the scheduler's waiting side: the bounded waiting queue with its context check
(`WaitingQueue`, `check_context`, `QueueFull`), which `paged_scheduler.PagedScheduler` builds its
policy on.

Not thread-safe: the engine core serialises every call (a lock around the waiting queue).
"""
from __future__ import annotations

import collections
import dataclasses

from serving import wire
from serving.runner import RunnerInfo
from serving.sampling import InvalidParameter, SamplingParams


class QueueFull(RuntimeError):
    """Too many waiting sequences; the caller should retry later."""


def check_context(limit: int, prompt_len: int, max_tokens: int) -> None:
    """Raises InvalidParameter when a prompt (plus its max_tokens) does not fit a context of
    `limit` tokens."""
    if prompt_len < 1:
        raise InvalidParameter("prompt", "the prompt is empty")
    if prompt_len >= limit:
        raise InvalidParameter(
            "prompt", f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{prompt_len} tokens (at most {limit - 1} leave room for one generated token).")
    if prompt_len + max_tokens > limit:
        raise InvalidParameter(
            "max_tokens", f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
            f"in the completion). Please reduce the prompt or max_tokens.")


@dataclasses.dataclass(frozen=True, eq=False)
class SeqImage:
    """One image of a prompt, as the paged engine needs it: the soft-token spans [start, end)
    its features fill (the original image, then its pan-and-scan crops), the preprocessed
    pixels [len(spans), H, W, 3] float32, and its content hash (the features cache's key and
    part of the prefix-cache hash of every page it touches)."""

    spans: tuple[tuple[int, int], ...]
    pixels: object
    key: str

    # In a multi-process group an image travels as its key and spans: process 0 alone encodes
    # (serving/group_images.py), the others take its features by key.
    WIRE = dict(spans=wire.Tuple(wire.Ints()), pixels=wire.Stays(None), key=wire.Text())


@dataclasses.dataclass(eq=False)
class Sequence:
    """One prompt being generated: what the policy and the engine core need, nothing more."""

    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int  # 32-bit seed of its random stream (see serving.sampling)
    want_prompt_logprobs: bool = False
    generated: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # its tokens whose keys and values are in (or being written to) its pages
    hashes: list[bytes] | None = None  # its prompt's prefix-page hashes (computed once)
    images: tuple[SeqImage, ...] = ()  # its prompt's images, in prompt order

    @property
    def image_spans(self) -> list[tuple[int, int]]:
        return [span for im in self.images for span in im.spans]

    @property
    def length(self) -> int:
        """Its tokens: the prompt and those generated so far."""
        return len(self.prompt) + len(self.generated)


class WaitingQueue:
    """The scheduler's waiting side: the bounded waiting queue, the context check, and
    removing sequences (waiting or running). The scheduler defines `running`, `finish` and
    `schedule`; `admissible` may refuse what it cannot serve."""

    def __init__(self, info: RunnerInfo, max_waiting: int = 256):
        self.info = info
        self.max_waiting = max_waiting
        self.waiting: collections.deque[Sequence] = collections.deque()

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raises InvalidParameter when a prompt (plus its max_tokens) does not fit the context."""
        check_context(self.info.max_seq_len, prompt_len, max_tokens)

    def admissible(self, seq: Sequence) -> None:
        """Raises InvalidParameter for a sequence the scheduler cannot serve."""

    def add(self, seqs: list[Sequence]) -> None:
        """Queues sequences, all or none. Raises InvalidParameter (also for more sequences than
        the queue holds: waiting would never help) or QueueFull (retry later)."""
        for s in seqs:
            self.check(len(s.prompt), s.params.max_tokens)
            self.admissible(s)
        if len(seqs) > self.max_waiting:
            raise InvalidParameter("n", f"the request makes {len(seqs)} sequences (prompts x n); this "
                                   f"server queues at most {self.max_waiting} (--max-waiting)")
        if len(self.waiting) + len(seqs) > self.max_waiting:
            raise QueueFull(f"too many waiting requests ({len(self.waiting)} waiting, limit "
                            f"{self.max_waiting}); retry later")
        self.waiting.extend(seqs)

    @property
    def running(self) -> list[Sequence]:
        raise NotImplementedError

    def finish(self, seq: Sequence) -> bool:
        raise NotImplementedError

    def abort(self, ids) -> list[Sequence]:
        """Removes the sequences with these ids, waiting or running; returns them."""
        ids = set(ids)
        dropped = [s for s in self.waiting if s.id in ids]
        self.waiting = collections.deque(s for s in self.waiting if s.id not in ids)
        dropped += [s for s in self.running if s.id in ids]
        for s in dropped:
            self.finish(s)
        return dropped

    def abort_running(self) -> list[Sequence]:
        """Removes every running sequence (their cache is lost); returns them."""
        return self.abort([s.id for s in self.running])

    def abort_all(self) -> list[Sequence]:
        """Removes every sequence, waiting ones first; returns them."""
        return self.abort([s.id for s in self.waiting] + [s.id for s in self.running])

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
