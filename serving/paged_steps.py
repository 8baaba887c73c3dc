"""A planned paged step as device-ready arrays: the buckets a step is padded to (`StepShape`,
`buckets_for`), the arrays themselves (`StepInputs`, built by `step_inputs` from a scheduler plan
and the page tables), and in deterministic mode the split of a step into its decode rows and its
prompt pieces (`deterministic_parts`). Plain numpy, no device: the runner (`paged_runner.py`)
runs what this module builds, and a group's other processes receive `StepInputs` whole.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from serving import wire
from serving.runner import RunnerInfo
from serving.kv_pages import SCRATCH, KVPages
from serving.paged_scheduler import StepPlan
from serving.sequence import SeqImage
from models.shapes import StepShape, pow2
from serving.sampling import SamplingMetadata



def local_pages_for(queries: int, window: int | None, page_size: int) -> int:
    """Local pages a row reads for `queries` query tokens: the window before the first query
    plus the queries, rounded out to whole pages at both ends."""
    if window is None:
        return 1
    return -(-(window - 1 + queries) // page_size) + 1


MIN_PAGES = 8
# Sequence rows of a step: 1, then powers of two from 8 up to max_num_seqs, so that 8 streams
# of a server allowing 64 do not gather pages for 64 rows.
MIN_SEQS = 8
# The default token budget of a step outside deterministic mode: prompt pieces of several
# requests share it, and a lone prompt takes it whole (paged_scheduler). In deterministic mode
# every step has the budget's shape, so it stays max_num_seqs + long_prefill_token_threshold there.
STEP_BUDGET = 256
# XLA:CPU lowers a one-token store into the pool to a select over a dynamic slice of the whole
# pool, which it then copies (every layer, every step: 4x a lone decode's time for the 270M);
# from 8 tokens on the store is an in-place scatter.
MIN_TOKENS = 8


def max_page_bucket(info: RunnerInfo) -> int:
    """The largest Pg: max_seq_len's pages, as a power of two, at least MIN_PAGES."""
    return max(MIN_PAGES, pow2(-(-info.max_seq_len // info.page_size)))


def global_pages_for(info: RunnerInfo, pages: int) -> int:
    """Pg of a step whose rows hold up to `pages` global pages. In the XLA form a step reads
    the pages its rows hold whatever the table's width (`ragged._xla_blocked_attention`): one
    width, max_seq_len's, so one program for every context, and no compile when a stream's
    context grows. The TPU kernel holds the whole table in its scalar
    memory: powers of two from MIN_PAGES there."""
    if info.attention != "pallas":
        return max_page_bucket(info)
    return min(max(MIN_PAGES, pow2(pages)), max_page_bucket(info))


def buckets_for(info: RunnerInfo, tokens: int, seqs: int, longest_piece: int, pages: int,
                logits: bool) -> StepShape:
    """The shape a step of `tokens` tokens in `seqs` rows, its longest piece of `longest_piece`
    and its rows holding up to `pages` global pages, is padded to: few values each, so that a
    server compiles few programs. S is 1 (a lone sequence), else a power of two from 8 up to
    max_num_seqs; Q is 1 (every row decodes), else the longest piece's power of two, at least
    the long-prefill threshold (pieces beside other work are at most that; a lone prompt's take
    the budget); T is max(8, S) when every row decodes, else a power of two from 8 up to the
    budget's; Pg max_seq_len's pages in the XLA forms, which read the pages the rows hold
    whatever the width, and on TPU a power of two from 8 pages up to that (`global_pages_for`);
    Pl follows Q. With max_num_seqs 8, max_seq_len 2048, pages of 16, a threshold of 16 and the
    default budget of 256: 2 decode shapes, 6 x 2 with pieces beside other work (T x logits)
    and 5 x 2 for a lone prompt's pieces (Q = T from 16 to 256), 24 text shapes (120 on TPU).
    A prompt piece never ends inside an image's soft tokens (they attend to each other both
    ways): it runs on to the image's end, and Q (then T) grows to hold it; a step with images
    also has F, a power of two of feature rows (`step_inputs`)."""
    max_pages = max_page_bucket(info)
    if info.deterministic:
        # XLA:CPU's fused softmax rounds differently with the shape (even along rows it keeps
        # apart), so no bucket that follows the neighbours is neutral: batch invariance needs
        # one shape for every step, the whole budget and context. (Its
        # one-token rows then run apart, in `deterministic_decode_buckets`: see
        # `deterministic_parts`.)
        q = max(info.long_prefill_token_threshold, pow2(longest_piece))
        return StepShape(tokens=max(MIN_TOKENS, pow2(info.max_num_batched_tokens), pow2(tokens)),
                       seqs=info.max_num_seqs, queries=q, global_pages=max_pages,
                       local_pages=local_pages_for(q, info.sliding_window, info.page_size))
    s = 1 if seqs == 1 else min(info.max_num_seqs, max(MIN_SEQS, pow2(seqs)))
    q = 1 if longest_piece == 1 else max(info.long_prefill_token_threshold, pow2(longest_piece))
    t = max(MIN_TOKENS, s if q == 1 else pow2(tokens))
    return StepShape(tokens=t, seqs=s, queries=q, global_pages=global_pages_for(info, pages),
                   local_pages=local_pages_for(q, info.sliding_window, info.page_size),
                   logits=logits)


def page_buckets(info: RunnerInfo) -> list[int]:
    """Every Pg a step may have (`global_pages_for`), smallest first."""
    powers = (MIN_PAGES << i for i in range((max_page_bucket(info) // MIN_PAGES).bit_length()))
    return sorted({global_pages_for(info, pg) for pg in powers})


def decode_buckets(info: RunnerInfo) -> list[StepShape]:
    """The decode steps of a lone sequence and of a full batch, at every page bucket
    (`page_buckets`: one in the XLA form; on TPU a stream meets the next when its context grows
    past one, 128 tokens of pages of 16, then 256, 512, ..., and a compile there would stall
    every running stream). Compiled before the server is ready (`compile_warmup`).
    Deterministic mode has one decode program, and its prompt pieces' program at every page
    bucket instead (a prompt's pieces cross them)."""
    pages = page_buckets(info)
    if info.deterministic:
        return [deterministic_decode_buckets(info)] + [
            deterministic_piece_buckets(info, info.long_prefill_token_threshold, pg)
            for pg in pages]
    out = []
    for seqs in sorted({1, info.max_num_seqs}):
        for pg in pages:
            b = buckets_for(info, seqs, seqs, 1, pg, True)
            if b not in out:
                out.append(b)
    return out


def later_buckets(info: RunnerInfo) -> list[StepShape]:
    """Every text step shape outside deterministic mode (24 for the defaults, 120 on TPU), for a
    server to compile in the background those the warm-up did not: at each page bucket from
    the smallest, decodes of every row count, pieces beside other work (S rows, a chunk of
    queries, T tokens), a lone prompt's pieces (one row of Q = T); pieces with and without
    logits. Deterministic mode's few programs are all compiled before it serves."""
    if info.deterministic:
        return []
    top = pow2(info.max_num_batched_tokens)
    rows = sorted({buckets_for(info, n, n, 1, 1, True).seqs
                   for n in range(1, info.max_num_seqs + 1)})
    shapes = [(s, s, 1) for s in rows]  # (tokens, seqs, longest piece)
    # A row bucket holds fewer real rows than its size: a piece beside a few decodes can fill
    # the smallest token bucket whatever S it pads to.
    piece = info.long_prefill_token_threshold
    shapes += [(t, s, piece) for s in rows if s > 1
               for t in (MIN_TOKENS << i for i in range(top.bit_length())) if t <= top]
    shapes += [(q, 1, q) for q in (pow2(piece) << i for i in range(top.bit_length())) if q <= top]
    out: list[StepShape] = []
    for pg in page_buckets(info):
        for logits in (True, False):
            for tokens, seqs, longest in shapes:
                if longest == 1 and not logits:
                    continue  # every decode samples
                b = buckets_for(info, tokens, seqs, longest, pg, logits)
                if b not in out:
                    out.append(b)
    return out


def largest_buckets(info: RunnerInfo) -> tuple[StepShape, StepShape]:
    """StepShape no step of text exceeds (`buckets_for`'s bounds): of a step of several
    sequences (a piece is at most a chunk, a step at most the budget) and of a lone sequence's
    (one piece of the whole budget). A piece of image tokens may run past them."""
    q = max(info.long_prefill_token_threshold, pow2(info.long_prefill_token_threshold))
    t = max(MIN_TOKENS, info.max_num_seqs, pow2(info.max_num_batched_tokens))
    pages = max_page_bucket(info)
    lone_q = max(q, pow2(info.max_num_batched_tokens))
    return (StepShape(tokens=t, seqs=info.max_num_seqs, queries=q, global_pages=pages,
                    local_pages=local_pages_for(q, info.sliding_window, info.page_size)),
            StepShape(tokens=t, seqs=1, queries=lone_q, global_pages=pages,
                    local_pages=local_pages_for(lone_q, info.sliding_window, info.page_size)))


def _ragged_fields() -> tuple[str, ...]:
    from models.gemma3.ragged import RaggedBatch

    return tuple(f.name for f in dataclasses.fields(RaggedBatch))


class StepInputs(NamedTuple):
    """One ragged step as plain numpy arrays (see `models.gemma3.ragged.RaggedBatch`)."""

    batch: dict  # RaggedBatch's fields -> int32 arrays
    sampling: SamplingMetadata  # [S]
    sample_positions: np.ndarray  # int32 [S]: the position of the token each row samples
    buckets: StepShape
    rows: int  # real sequence rows (the first `rows` of S)
    # The distinct images (sequence.SeqImage) whose soft tokens the step computes, and per
    # token [T] the row of its features among theirs concatenated in that order (-1: text).
    images: tuple = ()
    image_index: np.ndarray | None = None
    # With buckets.every_token: per token [T] the next token of its sequence's text (the one
    # its logprob is of; 0 past the text's end).
    targets: np.ndarray | None = None
    # Per token [T]: the row of the previous step whose sampled token it is, for a token not
    # on the host when the step was built (overlapped loop), else -1.
    feed: np.ndarray | None = None

    # How each field travels to a group's other processes (serving/wire.py). Images as their
    # keys and spans: the others hold process 0's features by key (serving/group_images.py).
    WIRE = dict(batch=wire.ArrayDict(np.int32, _ragged_fields),
                sampling=wire.Record(SamplingMetadata), sample_positions=wire.Array(np.int32),
                buckets=wire.Record(StepShape),
                rows=wire.Int(), images=wire.Tuple(wire.Record(SeqImage)),
                image_index=wire.Optional(wire.Array(np.int32)),
                targets=wire.Optional(wire.Array(np.int32)),
                feed=wire.Optional(wire.Array(np.int32)))

    @staticmethod
    def wire_examples(info: RunnerInfo) -> list["StepInputs"]:
        """The largest steps of text an engine with `info` runs (sizing the group's
        broadcast), every optional array present."""
        return [StepInputs(_empty_batch(b, info.page_size), SamplingMetadata.greedy(b.seqs),
                           np.zeros(b.seqs, np.int32), dataclasses.replace(b, every_token=True),
                           b.seqs, (), *(np.zeros(b.tokens, np.int32),) * 3)
                for b in largest_buckets(info)]


def step_inputs(plan: StepPlan, kv: KVPages, info: RunnerInfo, extras=None,
                prev_rows: dict[int, int] | None = None) -> StepInputs:
    """The arrays of a planned step: the pieces' tokens laid out one after another, each with
    its sequence row, position and the slots its keys/values go to; every row's block tables.
    Padding tokens write to the scratch page; padding rows read only it (always masked).

    extras(rows) -> LogitsExtras | None for the rows' logits processing (None for rows that do
    not sample). prev_rows: sequence id -> its row in the step in flight, for the pieces whose
    last token that step samples (`Piece.fed`; it is fed from the device)."""
    pieces = plan.pieces
    if not pieces:
        raise ValueError("an empty step")
    n_tok = plan.num_tokens
    pages = max(len(kv.seqs[p.seq.id].global_pages) for p in pieces) if kv.global_pool else 1
    b = buckets_for(info, n_tok, len(pieces), max(p.end - p.start for p in pieces), pages,
                    any(p.sample for p in pieces))
    want = [p.seq.want_prompt_logprobs for p in pieces]
    if any(want):
        b = dataclasses.replace(b, every_token=True, logits=True)
    t = b.tokens
    batch = _empty_batch(b, info.page_size)
    tokens, positions, seq, col = (batch[k] for k in ("tokens", "positions", "seq", "col"))
    write_global, write_local, queries = batch["write_global"], batch["write_local"], batch["queries"]
    global_table, local_table = batch["global_table"], batch["local_table"]
    local_first, last = batch["local_first"], batch["last"]
    pl = b.local_pages
    sample_positions = np.zeros(b.seqs, np.int32)
    targets = np.zeros(t, np.int32) if b.every_token else None
    feed = None
    i = 0
    for row, p in enumerate(pieces):
        n = p.end - p.start
        sp = kv.seqs[p.seq.id]
        span = slice(i, i + n)
        known = p.tokens
        tokens[i:i + len(known)] = known
        if len(known) < n:  # the last token is the step in flight's sample, on the device
            if prev_rows is None or p.seq.id not in prev_rows or len(known) != n - 1:
                raise ValueError(f"sequence {p.seq.id}'s token at {p.end - 1} is in no step")
            if feed is None:
                feed = np.full(t, -1, np.int32)
            feed[i + n - 1] = prev_rows[p.seq.id]
        positions[span] = np.arange(p.start, p.end)
        seq[span] = row
        col[span] = np.arange(n)
        for j, pos in enumerate(range(p.start, p.end)):
            write_global[i + j], write_local[i + j] = kv.slot(p.seq.id, pos)
        queries[row, :n] = np.arange(i, i + n)
        global_table[row, :len(sp.global_pages)] = sp.global_pages
        if kv.local_pool is not None:
            first = kv.local_span(p.start, p.end)[0]
            held = sp.local_pages[first - sp.local_first:]
            local_first[row] = first
            local_table[row, :len(held)] = held[:pl]
        last[row] = i + n - 1
        sample_positions[row] = p.end
        if targets is not None and want[row]:
            ahead = (p.seq.prompt + p.seq.generated)[p.start + 1:p.end + 1]
            targets[i:i + len(ahead)] = ahead
        i += n
    visible = batch["visible"]
    visible[:] = positions
    images, image_index = _image_rows(pieces, visible, b.tokens)
    if images:
        b = dataclasses.replace(b, features=image_features_bucket(images))
    rows = [p.seq if p.sample else None for p in pieces] + [None] * (b.seqs - len(pieces))
    sampling = SamplingMetadata.of_rows(rows)
    if extras is not None:
        sampling = sampling._replace(extras=extras(rows))
    return StepInputs(batch, sampling, sample_positions, b, len(pieces), images, image_index,
                      targets, feed)


def image_features_bucket(images) -> int:
    """F of a step computing the soft tokens of `images` (sequence.SeqImage): their feature
    rows, padded to a power of two."""
    return pow2(sum(b - a for im in images for a, b in im.spans))


def _empty_batch(b: StepShape, page_size: int) -> dict:
    """A step's arrays at buckets `b`, all padding: padding tokens write to the scratch page,
    padding rows read only it."""
    t, s = b.tokens, b.seqs
    scratch = np.full(t, SCRATCH * page_size, np.int32)
    return dict(tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
                visible=np.zeros(t, np.int32), seq=np.zeros(t, np.int32), col=np.zeros(t, np.int32),
                write_global=scratch, write_local=scratch.copy(),
                queries=np.zeros((s, b.queries), np.int32),
                global_table=np.full((s, b.global_pages), SCRATCH, np.int32),
                local_table=np.full((s, b.local_pages), SCRATCH, np.int32),
                local_first=np.zeros(s, np.int32), last=np.zeros(s, np.int32))


def _image_rows(pieces, visible: np.ndarray, t: int):
    """The step's images and each token's features row (see `StepInputs`); sets `visible` of
    every soft token to its image's last soft-token position (multimodal.visible_positions)."""
    images, offsets, total = [], {}, 0
    index = np.full(t, -1, np.int32)
    i = 0
    for p in pieces:
        for im in p.seq.images:
            for crop, (a, b) in enumerate(im.spans):
                lo, hi = max(a, p.start), min(b, p.end)
                if lo >= hi:
                    continue
                if im.key not in offsets:
                    offsets[im.key] = total
                    images.append(im)
                    total += sum(e - s for s, e in im.spans)
                at = i + lo - p.start
                index[at:at + hi - lo] = offsets[im.key] + crop * (b - a) + np.arange(lo - a, hi - a)
                visible[at:at + hi - lo] = b - 1
        i += p.end - p.start
    return tuple(images), (index if images else None)


# -- deterministic mode: decode rows apart from prompt pieces -------------------------------------

def deterministic_decode_buckets(info: RunnerInfo) -> StepShape:
    """Deterministic mode's decode program: a row for every sequence, one query each, the whole
    context."""
    return StepShape(tokens=max(MIN_TOKENS, pow2(info.max_num_seqs)), seqs=info.max_num_seqs,
                   queries=1, global_pages=max_page_bucket(info),
                   local_pages=local_pages_for(1, info.sliding_window, info.page_size))


def deterministic_piece_buckets(info: RunnerInfo, length: int, pages: int) -> StepShape:
    """Deterministic mode's program for one prompt piece of `length` tokens whose sequence
    holds `pages` global pages: one row of a chunk's queries (more for a piece run on to an
    image's end) over its own context (the one table read as far as that reaches, or on TPU
    its context's page bucket). Both follow the request alone, not its neighbours, so a
    prompt's prefill costs what its own context does."""
    q = max(info.long_prefill_token_threshold, pow2(length))
    return StepShape(tokens=max(MIN_TOKENS, q), seqs=1, queries=q,
                   global_pages=global_pages_for(info, pages),
                   local_pages=local_pages_for(q, info.sliding_window, info.page_size))


class Split(NamedTuple):
    """A step as the programs that run it (`deterministic_parts`; outside deterministic mode
    one part, the step itself, whose outputs need no reordering: rows and tokens None)."""

    parts: list  # StepInputs of each program, the decode rows' first
    rows: np.ndarray | None  # [S] row r's logits: row rows[r] of the parts' logits concatenated
    tokens: np.ndarray | None  # [T] each token's index in the last part (its every-token outputs)


def deterministic_parts(inputs: StepInputs, info: RunnerInfo) -> Split:
    """A deterministic-mode step as the programs that run it: its one-token rows (decodes, and
    a prompt's last token when it comes alone) in the decode program
    (`deterministic_decode_buckets`), its prompt piece (the scheduler plans at most one a
    step in this mode) in a one-row program of its own length (`deterministic_piece_buckets`).
    Which program a row runs in, and at what shape, is a function of its own request, so every
    token of a request is computed alike whatever is batched beside it (batch invariance);
    and a decode does not pay for a piece's queries over the whole context, nor a piece for
    every slot's row or for more context than its own. Rows with image tokens count as
    pieces."""
    b = inputs.batch
    first = b["queries"][:inputs.rows, 0]
    single = b["last"][:inputs.rows] == first
    if inputs.image_index is not None:
        single &= inputs.image_index[first] < 0
    every = inputs.buckets.every_token
    parts, rows = [], np.zeros(inputs.buckets.seqs, np.int32)
    tokens = np.zeros(inputs.buckets.tokens, np.int32)
    dec = np.flatnonzero(single)
    if len(dec):
        db = dataclasses.replace(deterministic_decode_buckets(info), every_token=every)
        parts.append(_rows_part(inputs, dec, db, info.page_size))
        rows[dec] = np.arange(len(dec))
        tokens[first[dec]] = np.arange(len(dec))
    others = np.flatnonzero(~single)
    if len(others) > 1:
        raise ValueError(f"deterministic mode runs one prompt piece a step, got {len(others)}")
    if len(others):
        r = others[0]
        n = int(b["last"][r] - first[r] + 1)
        pages = int((b["global_table"][r] != SCRATCH).sum())
        pb = dataclasses.replace(deterministic_piece_buckets(info, n, pages), every_token=every)
        rows[r] = sum(p.buckets.seqs for p in parts)
        parts.append(_rows_part(inputs, others, pb, info.page_size))
        tokens[:] = 0
        tokens[first[r]:first[r] + n] = np.arange(n)
    return Split(parts, rows, tokens)


def _rows_part(inputs: StepInputs, rows: np.ndarray, pb: StepShape, page_size: int) -> StepInputs:
    """The step's `rows` as a step of their own at buckets `pb`, their tokens in order."""
    b = inputs.batch
    index = np.concatenate([np.arange(b["queries"][r, 0], b["last"][r] + 1) for r in rows])
    d = _empty_batch(pb, page_size)
    n = len(index)
    for name in ("tokens", "positions", "visible", "write_global", "write_local"):
        d[name][:n] = b[name][index]
    at = 0
    for j, r in enumerate(rows):
        k = int(b["last"][r] - b["queries"][r, 0] + 1)
        d["seq"][at:at + k], d["col"][at:at + k] = j, np.arange(k)
        d["queries"][j, :k] = np.arange(at, at + k)
        d["last"][j] = at + k - 1
        at += k
    d["global_table"][:len(rows)] = b["global_table"][rows, :pb.global_pages]
    d["local_table"][:len(rows)] = b["local_table"][rows, :pb.local_pages]
    d["local_first"][:len(rows)] = b["local_first"][rows]
    image_index = _moved(inputs.image_index, index, pb.tokens, -1)
    if image_index is not None and not (image_index >= 0).any():
        image_index = None
    feed = _moved(inputs.feed, index, pb.tokens, -1)
    images = inputs.images if image_index is not None else ()
    if images:
        pb = dataclasses.replace(pb, features=inputs.buckets.features)
    return StepInputs(d, inputs.sampling, inputs.sample_positions, pb, len(rows),
                      images, image_index,
                      _moved(inputs.targets, index, pb.tokens, 0),
                      None if feed is None or (feed < 0).all() else feed)


def _moved(a: np.ndarray | None, index: np.ndarray, size: int, fill: int) -> np.ndarray | None:
    """a[index] at the front of an array of `size` filled with `fill` (None stays None)."""
    if a is None:
        return None
    out = np.full(size, fill, a.dtype)
    out[:len(index)] = a[index]
    return out
