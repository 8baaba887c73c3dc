"""The paged engine's model runner: one ragged model step over a paged KV cache, plus on-device
sampling.

Every step runs one program (`models.gemma3.ragged`) over a flat batch of tokens mixing decode
tokens and prompt pieces of any number of sequences, each token with its sequence, position and
cache slots; attention reads each sequence's pages through its block tables. So a step's cost
follows the tokens and pages it touches, not `--max-seq-len` x slots, and a lone request runs a
small program (docs/engine.md, "The paged engine").

The scheduler (`paged_scheduler.py`) plans a step as pieces (sequence, positions); `step_inputs`
turns a plan and the page tables (`kv_pages.py`) into plain numpy arrays padded to buckets
(`Buckets`), which bound the number of compiled programs; `PagedRunner.run_step` runs them and
returns the sampled tokens of the rows that sample. It knows nothing about requests or HTTP.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, NamedTuple

import numpy as np

from serving import dispatch_window, wire
from serving.runner import RunnerInfo, PendingStep, StepOutputs, feed_tokens
from serving.kv_pages import SCRATCH, KVPages
from serving.paged_scheduler import StepPlan
from serving.scheduler import SeqImage
from serving.shapes import pow2
from serving.sampling import IDLE, SlotSampling

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class Buckets:
    """The padded shapes of one step: T tokens, S sequence rows, Q query tokens per row in the
    attention view, Pg global and Pl local pages per row, and whether it returns logits.

    Few values each, so that a server compiles few programs (each is one compile, kept by the
    persistent compilation cache): S is 1 (a lone sequence), else a power of two from 8 up to
    max_num_seqs; Q is 1 (every row decodes), else the longest piece's power of two, at least
    the chunk size (pieces beside other work are at most a chunk; a lone prompt's take the
    budget); T is max(8, S) when every row decodes, else a power of two from 8 up to the
    budget's; Pg a power of two from 8 pages up to max_seq_len's pages; Pl follows Q. With
    max_num_seqs 8, max_seq_len 2048, pages of 16, chunks of 16 and the default budget of 256
    that is 2 x 5 decode programs (S x Pg), 6 x 5 x 2 with pieces beside other work (T x Pg x
    logits) and 5 x 5 x 2 for a lone prompt's pieces (Q = T from 16 to 256), 120 in all, of
    which a server meets the ones its load needs. A lone request runs S = 1 programs: it never
    pays for the batch.

    A prompt piece never ends inside an image's soft tokens (they attend to each other both
    ways, so the step that computes them must write them all): such a piece runs on to the
    image's end, past the chunk size, and Q (then T, and in deterministic mode the one shape)
    grows to the power of two that holds it; a step with images also has its own programs,
    one per power-of-two count of feature rows F (`models.gemma3.ragged.ImageRows`)."""

    tokens: int
    seqs: int
    queries: int
    global_pages: int
    local_pages: int
    logits: bool = True
    every_token: bool = False  # also every token's logprobs (a sequence wants its prompt's)

    WIRE = dict(tokens=wire.Int(), seqs=wire.Int(), queries=wire.Int(), global_pages=wire.Int(),
                local_pages=wire.Int(), logits=wire.Bool(), every_token=wire.Bool())


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
# every step has the budget's shape, so it stays max_num_seqs + chunk_size there.
STEP_BUDGET = 256
# XLA:CPU lowers a one-token store into the pool to a select over a dynamic slice of the whole
# pool, which it then copies (every layer, every step: 4x a lone decode's time for the 270M);
# from 8 tokens on the store is an in-place scatter.
MIN_TOKENS = 8
# The warm-up runs a lone prompt in every token bucket up to this many tokens, and its decode:
# a first chat request (its template adds ~10 tokens) or a short completion then waits for no
# compile (each took ~3 s for the 270M on a CPU, more on a TPU host); longer prompts are rarer
# first requests and their pieces compile on first use.
SHORT_PROMPT_TOKENS = 64


def max_page_bucket(info: RunnerInfo) -> int:
    """The largest Pg: max_seq_len's pages, as a power of two, at least MIN_PAGES."""
    return max(MIN_PAGES, pow2(-(-info.max_seq_len // info.page_size)))


def buckets_for(info: RunnerInfo, tokens: int, seqs: int, longest_piece: int, pages: int,
                logits: bool) -> Buckets:
    max_pages = max_page_bucket(info)
    if info.deterministic:
        # XLA:CPU's fused softmax rounds differently with the shape (even along rows it keeps
        # apart), so no bucket that follows the neighbours is neutral: batch invariance needs
        # one shape for every step, the whole budget and context, as the slot engine does.
        q = max(info.chunk_size, pow2(longest_piece))
        return Buckets(tokens=max(MIN_TOKENS, pow2(info.max_num_batched_tokens), pow2(tokens)),
                       seqs=info.num_slots, queries=q, global_pages=max_pages,
                       local_pages=local_pages_for(q, info.sliding_window, info.page_size))
    s = 1 if seqs == 1 else min(info.num_slots, max(MIN_SEQS, pow2(seqs)))
    q = 1 if longest_piece == 1 else max(info.chunk_size, pow2(longest_piece))
    t = max(MIN_TOKENS, s if q == 1 else pow2(tokens))
    return Buckets(tokens=t, seqs=s, queries=q,
                   global_pages=min(max(MIN_PAGES, pow2(pages)), max_pages),
                   local_pages=local_pages_for(q, info.sliding_window, info.page_size),
                   logits=logits)


def decode_buckets(info: RunnerInfo) -> list[Buckets]:
    """The decode steps of a lone sequence and of a full batch at every page bucket: a stream
    meets the next bucket when its context grows past one (128 tokens of pages of 16, then
    256, 512, ...), and a compile there stalls every running stream (2.5 s for the 270M on a
    CPU, against 33 ms a token). Compiled before the server is ready (`compile_warmup`)."""
    pages = [MIN_PAGES << i for i in range((max_page_bucket(info) // MIN_PAGES).bit_length())]
    out = []
    for seqs in sorted({1, info.num_slots}):
        for pg in pages:
            b = buckets_for(info, seqs, seqs, 1, pg, True)
            if b not in out:
                out.append(b)
    return out


def largest_buckets(info: RunnerInfo) -> tuple[Buckets, Buckets]:
    """Buckets no step of text exceeds (`buckets_for`'s bounds): of a step of several
    sequences (a piece is at most a chunk, a step at most the budget) and of a lone sequence's
    (one piece of the whole budget). A piece of image tokens may run past them."""
    q = max(info.chunk_size, pow2(info.chunk_size))
    t = max(MIN_TOKENS, info.num_slots, pow2(info.max_num_batched_tokens))
    pages = max_page_bucket(info)
    lone_q = max(q, pow2(info.max_num_batched_tokens))
    return (Buckets(tokens=t, seqs=info.num_slots, queries=q, global_pages=pages,
                    local_pages=local_pages_for(q, info.sliding_window, info.page_size)),
            Buckets(tokens=t, seqs=1, queries=lone_q, global_pages=pages,
                    local_pages=local_pages_for(lone_q, info.sliding_window, info.page_size)))


def _ragged_fields() -> tuple[str, ...]:
    from models.gemma3.ragged import RaggedBatch

    return tuple(f.name for f in dataclasses.fields(RaggedBatch))


class StepInputs(NamedTuple):
    """One ragged step as plain numpy arrays (see `models.gemma3.ragged.RaggedBatch`)."""

    batch: dict  # RaggedBatch's fields -> int32 arrays
    sampling: SlotSampling  # [S]
    sample_positions: np.ndarray  # int32 [S]: the position of the token each row samples
    buckets: Buckets
    rows: int  # real sequence rows (the first `rows` of S)
    # The distinct images (scheduler.SeqImage) whose soft tokens the step computes, and per
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
    WIRE = dict(batch=wire.ArrayDict(np.int32, _ragged_fields), sampling=wire.Record(SlotSampling),
                sample_positions=wire.Array(np.int32), buckets=wire.Record(Buckets),
                rows=wire.Int(), images=wire.Tuple(wire.Record(SeqImage)),
                image_index=wire.Optional(wire.Array(np.int32)),
                targets=wire.Optional(wire.Array(np.int32)),
                feed=wire.Optional(wire.Array(np.int32)))

    @staticmethod
    def wire_examples(info: RunnerInfo) -> list["StepInputs"]:
        """The largest steps of text an engine with `info` runs (sizing the group's
        broadcast), every optional array present."""
        return [StepInputs(_empty_batch(b, info.page_size), SlotSampling.greedy(b.seqs),
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
    rows = [p.seq if p.sample else None for p in pieces] + [None] * (b.seqs - len(pieces))
    sampling = SlotSampling.of_rows(rows)
    if extras is not None:
        sampling = sampling._replace(extras=extras(rows))
    return StepInputs(batch, sampling, sample_positions, b, len(pieces), images, image_index,
                      targets, feed)


def _empty_batch(b: Buckets, page_size: int) -> dict:
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


class PagedRunner:
    """The paged engine's runner over a `models.gemma3` model (see the module docstring).

    max_num_seqs: sequences running at once; kv_cache_tokens: the global layers' pool in tokens
    (the sum of the contexts the running sequences may hold; default max_num_seqs x
    max_seq_len); the local (sliding-window) pool holds every running sequence's window plus a
    quarter more, which keeps the windows of recent prompts for prefix-cache hits. chunk_size:
    the most prompt tokens one sequence computes in a step while others run (a multiple of
    page_size); max_num_batched_tokens: the step's token budget, which a lone sequence's prompt
    takes whole (default `STEP_BUDGET`; in deterministic mode, where every step has the
    budget's shape, max_num_seqs + chunk_size: every decode plus one prompt piece)."""

    def __init__(self, model, *, max_num_seqs: int, max_seq_len: int, page_size: int = 16,
                 kv_cache_tokens: int | None = None, chunk_size: int = 16,
                 max_num_batched_tokens: int | None = None, prefix_caching: bool = True,
                 deterministic: bool = False, model_name: str = "gemma3-270m"):
        import jax

        from serving import sampling

        self.model = model
        self.tokenizer = model.tokenizer
        self.info = paged_runner_info(model, max_num_seqs, max_seq_len, page_size, kv_cache_tokens,
                                      chunk_size, max_num_batched_tokens, prefix_caching,
                                      deterministic, model_name)
        self._jax = jax
        self.pages = model.init_pages(self.info.num_global_pages, self.info.num_local_pages,
                                      page_size)
        self._sample_device = next(d for d in model.mesh.devices.flat
                                   if d.process_index == jax.process_index())
        self._sample = sampling.make_sampler()
        self._token_logprobs = jax.jit(sampling.token_logprobs)
        self._feed = jax.jit(feed_tokens)
        # In a multi-process group the logits are split over the processes: each one gathers
        # them (one collective program, the same on all of them) and samples on its own device.
        self._replicated = jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec())
        self._replicate = jax.jit(lambda x: x, out_shardings=self._replicated)
        local = [d for d in model.mesh.devices.flat if d.process_index == jax.process_index()]
        self.window = dispatch_window.DispatchWindow(
            lambda: self.pages,
            dispatch_window.DEFAULT_LIMIT if dispatch_window.needed(local) else 0)
        self.programs_run: set[Buckets] = set()
        self._encoder = None  # serving.image_encoder.ImageEncoder, made on first use
        self.encoder_budget_flops = None  # encoder work a step; None: one prompt piece's FLOPs
        self._spans = None  # serving.image_spans.SpanWriter, made on first use
        # key -> features, where they come from elsewhere: a group's other processes take
        # process 0's (serving/group_images.py). None: this process's own encoder.
        self.features_from: Callable[[str], object] | None = None

    @property
    def encoder(self):
        """The features cache and staged encoder (serving/image_encoder.py), for a model with a
        tower."""
        if self._encoder is None:
            from serving.image_encoder import ImageEncoder
            self._encoder = ImageEncoder(self.model, self.info.chunk_size, self.info.deterministic,
                                         self.encoder_budget_flops)
        return self._encoder

    @property
    def images_encoded(self) -> int:
        return self._encoder.images_encoded if self._encoder is not None else 0

    def image_ready(self, key: str) -> bool:
        """Whether the features of the image with content hash `key` are ready (the scheduler
        keeps a prompt's piece short of an image until they are)."""
        return self.encoder.ready(key)

    def advance_images(self, wanted, bounded: bool = True, spent: float = 0.0) -> float:
        """Runs a bounded piece of the encoder for the images the scheduler waits for
        (StepPlan.encode), a larger one where nothing else runs (bounded=False,
        `ImageEncoder.whole_call_flops`); returns its FLOPs. spent: FLOPs the step's span work
        already took of the same budget."""
        return self.encoder.advance(wanted, bounded, spent)

    @property
    def spans(self):
        """The image spans written a layer at a time between steps (serving/image_spans.py)."""
        if self._spans is None:
            from serving.image_spans import SpanWriter
            self._spans = SpanWriter(self, self.encoder_budget_flops)
        return self._spans

    def span_written(self, job) -> bool:
        """Whether the keys of a paged_scheduler.SpanJob are all stored (its sequence may go on)."""
        return self.spans.written(job)

    def advance_spans(self, jobs, kv: KVPages, bounded: bool = True) -> float:
        """Runs a bounded piece of the image spans being written (StepPlan.spans), or all of
        it where nothing else runs (bounded=False); returns its FLOPs."""
        return self.spans.advance(jobs, kv, bounded)

    def image_features(self, image):
        """Features [n * tokens_per_image, D] (on the device) of a scheduler.SeqImage, from the
        cache, or the whole encoder at once for a caller that did not wait for them."""
        if self.features_from is not None:
            return self.features_from(image.key)
        return self.encoder.features(image)

    def _image_rows(self, inputs: StepInputs):
        from models.gemma3.ragged import ImageRows

        if not inputs.images:
            return None
        jnp = self._jax.numpy
        rows = [self.image_features(im) for im in inputs.images]
        n = sum(r.shape[0] for r in rows)
        pad = pow2(n) - n  # a few feature counts, so a few programs
        if pad:
            rows.append(jnp.zeros((pad, rows[0].shape[1]), rows[0].dtype))
        feats = rows[0] if len(rows) == 1 else jnp.concatenate(rows)
        return ImageRows(features=self.on_every_process(feats), index=inputs.image_index)

    def run_step(self, inputs: StepInputs) -> StepOutputs | None:
        """Runs one ragged step; returns the sampled tokens of its S rows (rows that do not
        sample hold junk), or None for a step that samples nothing (no device-to-host wait)."""
        return self.dispatch_step(inputs).result()

    def dispatch_step(self, inputs: StepInputs, prev: PendingStep | None = None
                      ) -> PendingStep:
        """Dispatches one ragged step and returns at once (JAX's asynchronous dispatch); its
        outputs stay on the device until `result()`. prev: the step in flight whose sampled
        tokens feed this one's (`StepInputs.feed`)."""
        from models.gemma3.ragged import RaggedBatch

        self.programs_run.add(inputs.buckets)
        fields = dict(inputs.batch)
        if inputs.feed is not None:
            if prev is None or prev.tokens is None:
                raise ValueError("a step fed from the step in flight needs that step")
            fields["tokens"] = self._feed(prev.tokens, fields["tokens"], inputs.feed)
            self.window.dispatched(fields["tokens"])
            fields["tokens"] = self.on_every_process(fields["tokens"])
        batch = RaggedBatch(**fields)
        images = self._image_rows(inputs)  # ready features (the encoder ran in earlier steps)
        every = None
        if inputs.buckets.every_token:
            if images is not None:
                raise ValueError("prompt logprobs of a prompt with images are not served")
            logits, every, self.pages = self.model.ragged_step(self.pages, batch,
                                                               every_token=True)
        else:
            logits, self.pages = self.model.ragged_step(
                self.pages, batch, logits=inputs.buckets.logits, images=images)
        self.window.dispatched(logits)
        if not inputs.buckets.logits:
            return PendingStep(self._jax, None)
        if not getattr(logits, "is_fully_addressable", True):
            logits = self._replicate(logits).addressable_data(0)
            self.window.dispatched(logits)
            if every is not None:
                every = self._replicate(every).addressable_data(0)
        logits = self._jax.device_put(logits, self._sample_device)
        self.window.dispatched(logits)
        out = tuple(self._sample(logits, inputs.sampling.resolve(), inputs.sample_positions))
        if every is not None:  # [T] logprobs of each token's next token, [T, K] top ones
            every = self._jax.device_put(every, self._sample_device)
            out += tuple(self._token_logprobs(every, inputs.targets))
        ticket = self.window.dispatched(out)
        return PendingStep(self._jax, out, on_result=lambda: self.window.retired(ticket))

    def on_every_process(self, x):
        """x, on this process's device, as the mesh's replicated array in a multi-process
        group (else x as it is), without a transfer between processes (which `device_put`
        cannot make of a one-device array in a group): each process places its own copy on its
        own devices. Right only where every process holds the same values, as it does for the
        fed tokens (`distributed.Follower` says why) and for image features and spans
        (serving/group_images.py)."""
        jax = self._jax
        if self._replicated.is_fully_addressable:
            return x
        shards = [jax.device_put(x, d)
                  for d in sorted(self._replicated.addressable_devices, key=lambda d: d.id)]
        return jax.make_array_from_single_device_arrays(x.shape, self._replicated, shards)

    def reset(self) -> None:
        """Fresh pages (after a failed step, whose donated pages may be gone)."""
        self.window.reset()
        self.pages = self.model.init_pages(self.info.num_global_pages, self.info.num_local_pages,
                                           self.info.page_size)

    def warmup(self, progress: Callable[[str], None] = log.info) -> float:
        """Runs the steps every server meets first, so that they do not wait for a compile: a
        lone short prompt in each token bucket up to SHORT_PROMPT_TOKENS (a first chat or
        completion request) and its decode at the smallest page bucket, a lone prompt of the
        whole budget, a full batch's prompts and decode. `compile_warmup` compiles these and
        the decodes at every page bucket beforehand; other programs (pieces beside other work,
        longer prompts' pieces, other batch sizes) compile on first use. Returns seconds."""
        t0 = time.perf_counter()
        self._warmup_steps(self.run_step, progress)
        self.reset()
        return time.perf_counter() - t0

    def compile_warmup(self, progress: Callable[[str], None] = log.info) -> None:
        """Compiles, without running, the ragged programs `warmup` runs and the decode steps
        of a lone sequence and of a full batch at every page bucket (`decode_buckets`), two at
        a time. The server calls it before the warm-up; a multi-process group also meets at a
        barrier after it (serving/runtime.py), so that the warm-up's first collective starts
        in every process at once however long each compiled."""
        seen: list[Buckets] = []

        def plan_only(inputs: StepInputs):
            if inputs.buckets not in seen:
                seen.append(inputs.buckets)
            return StepOutputs(*(np.full(inputs.buckets.seqs, self.tokenizer.bos_id, np.int32),) * 4)

        self._warmup_steps(plan_only, lambda msg: None)
        seen += [b for b in decode_buckets(self.info) if b not in seen]
        self.model.compile_ragged([self.model.ragged_key(b.tokens, b.seqs, b.queries, b.global_pages,
                                                         b.local_pages, self.pages, b.logits)
                                   for b in seen], progress=progress)

    def _warmup_steps(self, run: Callable[[StepInputs], StepOutputs | None],
                      progress: Callable[[str], None]) -> None:
        """The warm-up's steps, each given to `run`: a lone prompt, then a full batch, each until
        every sequence decoded twice."""
        from serving.paged_scheduler import PagedScheduler
        from serving.scheduler import Sequence

        info = self.info
        # (rows, prompt length) of each warm-up round: short lone prompts of MIN_TOKENS,
        # 2 MIN_TOKENS, ... tokens (one per token bucket; a lone decode at the smallest page
        # bucket after them), a lone prompt of the whole budget, a full batch of chunks.
        short = [] if info.deterministic else [
            n for n in (MIN_TOKENS << i for i in range(8))
            if n <= min(SHORT_PROMPT_TOKENS, info.max_num_batched_tokens, info.max_seq_len - 3)]
        rounds = [(1, n) for n in short] + [(1, info.max_num_batched_tokens + 1)]
        rounds += [(info.num_slots, info.chunk_size + 1)] if info.num_slots > 1 else []
        for n_seqs, length in rounds:
            sched = PagedScheduler(dataclasses.replace(info, prefix_blocks=0))
            prompt = [self.tokenizer.bos_id] * min(length, info.max_seq_len - 1)
            sched.add([Sequence(id=i, prompt=list(prompt), params=IDLE, seed=0)
                       for i in range(n_seqs)])
            for _ in range(64):
                plan = sched.schedule()
                if not plan.pieces:
                    break
                out = run(step_inputs(plan, sched.kv, info))
                progress(f"warm-up step {plan.num_tokens} token(s), {len(plan.pieces)} row(s)")
                for row, p in enumerate(plan.pieces):
                    if p.sample:
                        p.seq.generated.append(int(out.tokens[row]))
                if all(len(s.generated) >= 2 for s in sched.running) and not sched.num_waiting:
                    break


def paged_runner_info(model, max_num_seqs: int, max_seq_len: int, page_size: int,
                      kv_cache_tokens: int | None, chunk_size: int,
                      max_num_batched_tokens: int | None, prefix_caching: bool,
                      deterministic: bool, model_name: str) -> RunnerInfo:
    """The facts a PagedRunner over `model` serves with (no device work)."""
    c = model.config
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if not 2 <= max_seq_len <= c.max_seq_len:
        raise ValueError(f"max_seq_len must lie in 2..{c.max_seq_len}, got {max_seq_len}")
    if page_size < 1 or chunk_size < page_size or chunk_size % page_size:
        raise ValueError(f"chunk_size ({chunk_size}) must be a positive multiple of page_size "
                         f"({page_size})")
    budget = max_num_batched_tokens or (max_num_seqs + chunk_size if deterministic
                                        else max(STEP_BUDGET, max_num_seqs + chunk_size))
    if budget < chunk_size:
        raise ValueError(f"max_num_batched_tokens ({budget}) must be >= the chunk size "
                         f"({chunk_size}): a prompt piece must fit one step")
    tokens = kv_cache_tokens or max_num_seqs * max_seq_len
    if tokens < max_seq_len:
        raise ValueError(f"kv_cache_tokens ({tokens}) must hold at least one sequence of "
                         f"max_seq_len ({max_seq_len}) tokens")
    has_local = any(not c.is_global(i) for i in range(c.num_layers))
    has_global = any(c.is_global(i) for i in range(c.num_layers))
    window = c.sliding_window if has_local else None
    per_seq_local = local_pages_for(pow2(chunk_size), window, page_size)
    # ... and room for a lone prompt's whole-budget piece, whose window reaches further back.
    local_pages = max(max_num_seqs * per_seq_local * 5 // 4,
                      local_pages_for(pow2(budget), window, page_size))
    tokenizer = model.tokenizer
    return RunnerInfo(
        model_name=model_name,
        num_slots=max_num_seqs,
        max_seq_len=max_seq_len,
        prefill_buckets=(chunk_size,),
        prefill_batch_sizes=(1,),
        vocab_size=c.vocab_size,
        eos_ids=tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id, tokenizer.end_of_turn_id))),
        tp=int(model.tp),
        dtype=str(np.dtype(model.dtype).name) if not isinstance(model.dtype, str) else model.dtype,
        allreduce=model.allreduce.to_dict(),
        allreduce_label=model.allreduce.label,
        chunk_size=chunk_size,
        chunk_buckets=(chunk_size,),
        deterministic=bool(deterministic),
        prefix_blocks=1 if prefix_caching else 0,
        page_size=page_size,
        num_global_pages=math.ceil(tokens / page_size) + 1 if has_global else 2,
        num_local_pages=local_pages + 1 if has_local else 2,
        max_num_batched_tokens=budget,
        sliding_window=window,
        has_global_layers=has_global,
    )
