"""The scheduling policy: which sequences run, in which cache slots, in which kind of step.

Plain data in, a `Plan` out: `Scheduler.schedule()` decides the next step and updates its own
bookkeeping (waiting queue, slot table) but runs nothing. The engine core (`engine_core.py`)
executes the plan on the engine; the output processor (`output_processor.py`) turns its outputs
into text and events and says which sequences have ended, which the engine core hands back here
through `finish`. (vLLM v1's split: scheduler, engine core, output processor.)

Policy: prefill before decode. While waiting sequences fit free slots, a step prefills them,
oldest first, in groups that share a prefill bucket (a group is one prefill call). Only when
nothing more can be admitted does a step decode, advancing every running sequence by a token;
before it, sequences in high slots move into free low ones when that lets decode run a smaller
compiled program. Prefill first keeps the time to first token low at the cost of one longer gap
for the running streams (vLLM's default policy without chunked prefill).

Chunked prefill (when the engine has a chunk size C): a prompt longer than C (every prompt in
deterministic mode) takes a slot and is then prefilled one chunk per step, oldest prompt first,
each chunk followed in the same step by the decode step of the running sequences, so that a long
prompt delays each of their tokens by one chunk instead of stalling them for its whole prefill.
Chunk boundaries lie at 0, C, 2C, ... of the prompt, whatever else runs.

Prefix cache (`PrefixCache`): before a chunked prompt's first chunk, the longest run of its full
C-token blocks already kept (hashed by the parent block's hash and the block's tokens) is copied
into its slot instead of being computed; each full chunk computed is kept as a block, the least
recently used block giving way when the cache is full. At least the prompt's last token is
always computed (it yields the first generated token).

Not thread-safe: the engine core serialises every call (a lock around the waiting queue).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

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
    slot: int = -1  # its cache row while running
    generated: list[int] = dataclasses.field(default_factory=list)
    chunked: bool = False  # prefilled in chunks (decided on admission)
    computed: int = 0  # prompt tokens in (or being written to) its cache row, when chunked
    hashes: list[bytes] | None = None  # its prompt's prefix-block hashes (computed once)
    images: tuple[SeqImage, ...] = ()  # its prompt's images, in prompt order (paged engine)

    @property
    def image_spans(self) -> list[tuple[int, int]]:
        return [span for im in self.images for span in im.spans]

    @property
    def prefilling(self) -> bool:
        """Holds a slot but has no token yet (a chunked prompt between its chunks)."""
        return self.chunked and not self.generated

    @property
    def length(self) -> int:
        """Tokens of this sequence held in (or about to enter) its cache row."""
        return len(self.prompt) + len(self.generated)


@dataclasses.dataclass(frozen=True)
class PrefillGroup:
    """One prefill call: `seqs` (their slots already assigned) padded to `bucket` tokens and to
    `batch` rows, one of the engine's compiled batch sizes."""

    seqs: tuple[Sequence, ...]
    bucket: int
    batch: int

    @property
    def prompt_logprobs(self) -> bool:
        return self.seqs[0].want_prompt_logprobs  # such a sequence is always alone in its group


@dataclasses.dataclass(frozen=True)
class ChunkStep:
    """One prefill chunk: prompt tokens start..start+length-1 of `seq` into cache row `slot`,
    padded to `bucket` tokens; before it, prefix-cache blocks `restore` are copied into the slot
    (positions 0, C, ...), and after it the chunk is kept as block `save_block` (-1: not)."""

    seq: Sequence
    slot: int
    start: int
    length: int
    bucket: int
    final: bool  # the prompt's last chunk: it yields the first generated token
    restore: tuple[int, ...] = ()
    save_block: int = -1
    lookup: tuple[int, int] | None = None  # (prompt tokens looked up, tokens found) on a first chunk


@dataclasses.dataclass(frozen=True)
class Plan:
    """One step: either prefills, or a prefill chunk and/or slot moves followed by one decode
    step (or nothing)."""

    prefills: tuple[PrefillGroup, ...] = ()
    chunk: ChunkStep | None = None  # runs first
    # (src, dst): copy slot src's cache rows into the free slot dst, before the decode step.
    moves: tuple[tuple[int, int], ...] = ()
    # The first R slots after the moves (R = last busy slot + 1): the decode step's rows, None
    # for an idle slot among them.
    decode: tuple[Sequence | None, ...] = ()
    decode_rows: int = 0  # the compiled row count that runs them (>= len(decode))
    # For each idle row of `decode`, the position its (discarded) token is written at: 0 for a
    # free slot; for a chunked prompt between chunks, the start of its next chunk (that chunk
    # overwrites the global entry, and the ring entry there holds a position already out of
    # its window), so the write harms nothing.
    idle_positions: tuple[int, ...] = ()


def block_hashes(tokens: list[int], block: int) -> list[bytes]:
    """The hash of every full `block`-token block of `tokens`, each over its parent's hash and
    its own token ids (so a hash names the whole prefix up to its block's end)."""
    out, parent = [], b""
    for i in range(len(tokens) // block):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(np.asarray(tokens[i * block:(i + 1) * block], "<i4").tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class PrefixCache:
    """Which prefix blocks are kept, under which engine block id: hash -> id, least recently used
    first. Plain bookkeeping: the engine holds the blocks' keys and values."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._ids: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._free = list(range(num_blocks))[::-1]
        self.queries = self.hits = 0  # tokens looked up and found (the metrics' counters)

    def __len__(self) -> int:
        return len(self._ids)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The ids of the longest run of leading blocks kept (marked recently used)."""
        found = []
        for h in hashes:
            i = self._ids.get(h)
            if i is None:
                break
            self._ids.move_to_end(h)
            found.append(i)
        return found

    def allocate(self, h: bytes) -> int:
        """An id to keep block `h` under (evicting the least recently used block when full), or
        -1 when it is kept already or the cache holds no blocks."""
        if h in self._ids or not self.num_blocks:
            return -1
        i = self._free.pop() if self._free else self._ids.popitem(last=False)[1]
        self._ids[h] = i
        return i

    def clear(self) -> None:
        self._ids.clear()
        self._free = list(range(self.num_blocks))[::-1]


class WaitingQueue:
    """What every scheduling policy shares: the bounded waiting queue, the context check, and
    removing sequences (waiting or running). A policy defines `running`, `finish` and
    `schedule`; `admissible` may refuse what it cannot serve."""

    def __init__(self, info: RunnerInfo, max_waiting: int = 256):
        self.info = info
        self.max_waiting = max_waiting
        self.waiting: collections.deque[Sequence] = collections.deque()

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raises InvalidParameter when a prompt (plus its max_tokens) does not fit the context."""
        check_context(self.info.max_seq_len, prompt_len, max_tokens)

    def admissible(self, seq: Sequence) -> None:
        """Raises InvalidParameter for a sequence this policy cannot serve."""

    def add(self, seqs: list[Sequence]) -> None:
        """Queues sequences, all or none. Raises InvalidParameter or QueueFull."""
        for s in seqs:
            self.check(len(s.prompt), s.params.max_tokens)
            self.admissible(s)
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


class Scheduler(WaitingQueue):
    def __init__(self, info: RunnerInfo, max_waiting: int = 256):
        super().__init__(info, max_waiting)
        self.slots: list[Sequence | None] = [None] * info.num_slots
        self.prefix_cache = PrefixCache(info.prefix_blocks if info.chunk_size else 0)

    def finish(self, seq: Sequence) -> bool:
        """Frees a running sequence's slot (it ended). Returns whether it held one."""
        if 0 <= seq.slot < len(self.slots) and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
            return True
        return False

    # ---- state ----

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self.slots)

    def kv_usage(self) -> float:
        used = sum(s.length for s in self.slots if s is not None)
        return used / (self.info.num_slots * self.info.max_seq_len)

    # ---- the policy ----

    def schedule(self) -> Plan:
        """The next step. Admitted sequences take their slots and moved ones their new slots
        here; the caller must execute the plan (or `abort_running` when it fails)."""
        groups = []
        free = [i for i, s in enumerate(self.slots) if s is None]
        while free and self.waiting:
            s = self.waiting[0]
            if self.info.chunked(len(s.prompt), s.want_prompt_logprobs):
                self.waiting.popleft()
                s.slot, s.chunked, s.computed = free.pop(0), True, 0
                self.slots[s.slot] = s
                continue
            group = self._take_group(len(free))
            for s in group:
                s.slot = free.pop(0)
                self.slots[s.slot] = s
            bucket = self.info.bucket_for(max(len(s.prompt) for s in group))
            batch = min(b for b in self.info.batch_sizes_for(bucket) if b >= len(group))
            groups.append(PrefillGroup(tuple(group), bucket, batch))
        if groups:
            return Plan(prefills=tuple(groups))
        if not self.num_running:
            return Plan()
        chunk = self._next_chunk()
        if not any(s is not None and not s.prefilling for s in self.slots):
            return Plan(chunk=chunk)
        moves = self._pack()
        # Only the slots up to the last busy one decode (free slots are taken lowest first, so
        # with few sequences this is a short prefix and the step is cheaper).
        n = 1 + max(i for i, s in enumerate(self.slots) if s is not None)
        rows = tuple(None if s is None or s.prefilling else s for s in self.slots[:n])
        idle = tuple(s.computed if s is not None and s.prefilling else 0 for s in self.slots[:n])
        return Plan(chunk=chunk, moves=moves, decode=rows, decode_rows=self.info.decode_rows_for(n),
                    idle_positions=idle)

    def _next_chunk(self) -> ChunkStep | None:
        """The next chunk of the oldest prompt still being prefilled (with its prefix-cache
        lookup when it is the first), or None."""
        pending = [s for s in self.slots if s is not None and s.prefilling and s.computed < len(s.prompt)]
        if not pending:
            return None
        s = min(pending, key=lambda q: q.id)
        c, n = self.info.chunk_size, len(s.prompt)
        cache = self.prefix_cache
        restore, lookup = (), None
        if s.hashes is None:
            s.hashes = block_hashes(s.prompt, c) if cache.num_blocks else []
        hashes = s.hashes
        if s.computed == 0 and cache.num_blocks:
            # The last prompt token is always computed: it yields the first generated token.
            restore = tuple(cache.lookup(hashes[:(n - 1) // c]))
            s.computed = len(restore) * c
            lookup = (n, s.computed)
            cache.queries += n
            cache.hits += s.computed
        start = s.computed
        length = min(c, n - start)
        save = cache.allocate(hashes[start // c]) if length == c and cache.num_blocks else -1
        s.computed += length
        return ChunkStep(s, s.slot, start, length, self.info.chunk_bucket_for(length),
                         final=s.computed == n, restore=restore, save_block=save, lookup=lookup)

    def reset_prefix_cache(self) -> None:
        """Forget every prefix block (after an engine failure: its blocks may be lost)."""
        self.prefix_cache.clear()

    def _take_group(self, free: int) -> list[Sequence]:
        """The oldest waiting sequences that can share one prefill call: short prompts (buckets
        up to `batched_prefill_max_bucket`) go together, padded to the longest one's bucket: a
        small batch costs less than its prompts one by one (on a 2-core CPU, two 32-token prompts
        take ~1.4x the time of one). Long prompts, and prompts whose own logprobs are wanted (a
        program of its own), go alone."""
        short = self.info.batched_prefill_max_bucket

        def alone(s: Sequence) -> bool:  # (a chunked prompt ends the group: it takes no part)
            return (s.want_prompt_logprobs or self.info.bucket_for(len(s.prompt)) > short
                    or self.info.chunked(len(s.prompt)))

        if alone(self.waiting[0]):
            return [self.waiting.popleft()]
        limit = min(free, max(self.info.prefill_batch_sizes))
        group = []
        while self.waiting and len(group) < limit and not alone(self.waiting[0]):
            group.append(self.waiting.popleft())
        return group

    def _pack(self) -> tuple[tuple[int, int], ...]:
        """Move sequences from high slots into free low ones when that lets decode run a smaller
        program (the engine's decode batch sizes): e.g. two sequences left in slots 0 and 7 of 8
        decode as 2 rows instead of 8. A move copies one slot's KV cache rows on the device."""
        busy = [i for i, s in enumerate(self.slots) if s is not None]
        rows = self.info.decode_rows_for(len(busy))
        if self.info.decode_rows_for(busy[-1] + 1) <= rows:
            return ()
        free = [i for i in range(rows) if self.slots[i] is None]
        moves = tuple(zip(reversed([i for i in busy if i >= rows]), free))
        for src, dst in moves:
            s = self.slots[src]
            self.slots[dst], self.slots[src], s.slot = s, None, dst
        return moves
