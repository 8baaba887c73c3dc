"""An image's soft tokens written into the paged cache a layer at a time, between engine steps.

The 256 soft tokens attend to each other both ways, so they cannot be cut into query pieces; in one
step they hold up every running stream. So the span moves through the text layers together, stages
worth at most `budget_flops` after each step, with the ragged step's own functions. See
docs/vision.md, "The soft tokens between steps"."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from serving import wire
from serving.image_encoder import chunk_flops
from serving.kv_pages import SCRATCH, KVPages
from serving.paged_steps import MIN_PAGES, local_pages_for
from models.shapes import pow2


MIN_ROWS = 8  # rows of a stage: fewer make matmuls too thin to pay for a program


def layer_flops(config, rows: int, keys: int) -> tuple[float, float]:
    """(kv, rows) matmul FLOPs of `rows` span tokens through one text layer, attending to
    about `keys` keys."""
    c = config
    kv = 2.0 * rows * 2 * c.num_kv_heads * c.head_dim * c.d_model
    per_row = 2 * c.num_heads * c.head_dim * c.d_model + 3 * c.d_model * c.ffn_hidden
    attention = 2 * c.num_heads * c.head_dim * keys
    return kv, 2.0 * rows * (per_row + attention)


class SpanLayout(NamedTuple):
    """Where a span's rows go in the pages (module docstring): N is its rows padded to a power
    of two, at least MIN_ROWS."""

    write: np.ndarray  # int32 [2, N]: each row's slot in the global and the local pool (padding: scratch)
    global_table: np.ndarray  # int32 [1, Pg]: its sequence's global pages
    local_table: np.ndarray  # int32 [1, Pl]: its local pages from local_first on
    local_first: np.ndarray  # int32 [1]

    WIRE = dict(write=wire.Array(np.int32), global_table=wire.Array(np.int32),
                local_table=wire.Array(np.int32), local_first=wire.Array(np.int32))


def span_layout(job, kv: KVPages, info) -> SpanLayout:
    """A paged_scheduler.SpanJob's layout, from the page tables (its pages are allocated)."""
    n = job.end - job.start
    rows = pow2(max(n, MIN_ROWS))
    write = np.full((2, rows), SCRATCH * kv.page_size, np.int32)
    for i, pos in enumerate(range(job.start, job.end)):
        write[:, i] = kv.slot(job.seq.id, pos)
    sp = kv.seqs[job.seq.id]
    pg = max(MIN_PAGES, pow2(len(sp.global_pages)))
    global_table = np.full((1, pg), SCRATCH, np.int32)
    global_table[0, :len(sp.global_pages)] = sp.global_pages
    pl = local_pages_for(pow2(n), info.sliding_window, info.page_size)
    local_table = np.full((1, pl), SCRATCH, np.int32)
    local_first = np.zeros(1, np.int32)
    if kv.local_pool is not None:
        first = kv.local_span(job.start, job.end)[0]
        held = sp.local_pages[first - sp.local_first:][:pl]
        local_first[0] = first
        local_table[0, :len(held)] = held
    return SpanLayout(write, global_table, local_table, local_first)


@dataclasses.dataclass
class _Progress:
    job: object  # paged_scheduler.SpanJob
    blocks: int  # rows stages a layer
    layout: SpanLayout
    x: object = None  # the span's residual stream [N, D]
    layer: int = 0
    part: int = 0  # 0: the layer's kv stage next; r > 0: rows block r - 1 next


class SpanWriter:
    """Writes SpanJobs' keys into the engine's pages (module docstring). `engine` is the
    PagedRunner (its model, pages, features and dispatch window)."""

    def __init__(self, engine, budget_flops: float | None = None):
        self.engine = engine
        self.model = engine.model
        info = engine.info
        self.budget_flops = float(budget_flops
                                  or chunk_flops(self.model.config, info.long_prefill_token_threshold))
        self._progress: dict[object, _Progress] = {}
        self._written: set = set()
        # For the tests and metrics: stages run, the most FLOPs one advance ran.
        self.stages_run = 0
        self.max_advance_flops = 0.0

    def written(self, job) -> bool:
        """Whether every layer's keys of the span are stored (dispatched: the device runs them
        before any later step). Answers True once, then forgets the job."""
        if job in self._written:  # (SpanJobs compare by identity)
            self._written.discard(job)
            return True
        return False

    def advance(self, jobs, kv: KVPages | None, bounded: bool = True) -> float:
        """Runs stages of `jobs` (oldest first) worth at most `budget_flops`, at least one
        (bounded=False: all of them, nothing else ran in the step); returns the FLOPs run.
        Work on spans not listed is dropped (their sequence ended or lost its pages). kv: the
        page tables, or None where every job carries its `layout` (a group's other
        processes)."""
        listed = set(jobs)
        for job in [j for j in self._progress if j not in listed]:
            del self._progress[job]
        self._written &= listed
        spent, ran = 0.0, False
        for job in jobs:
            if job in self._written:
                continue
            p = self._progress.get(job) or self._begin(
                job, job.layout if kv is None else span_layout(job, kv, self.engine.info))
            while True:
                cost = self._cost(p)
                if bounded and ran and spent + cost > self.budget_flops:
                    self.max_advance_flops = max(self.max_advance_flops, spent)
                    return spent
                self._stage(p)
                spent, ran = spent + cost, True
                self.stages_run += 1
                if p.layer == self.model.config.num_layers:
                    del self._progress[job]
                    self._written.add(job)
                    break
        self.max_advance_flops = max(self.max_advance_flops, spent)
        return spent

    # -- the stages --------------------------------------------------------------------------
    def _begin(self, job, layout: SpanLayout) -> _Progress:
        import jax.numpy as jnp

        n = job.end - job.start
        rows = layout.write.shape[1]
        feats = self.engine.image_features(job.image)  # [crops * tokens, D]
        a, b = job.image.spans[job.crop]
        first = job.crop * (b - a) + job.start - a
        # The rows stages donate x: it must never be the cached features themselves (a full
        # slice of a jax array is the array), or the image's next request finds them deleted.
        x = jnp.concatenate([feats[first:first + n],
                             jnp.zeros((rows - n, feats.shape[1]), feats.dtype)])
        _, flops = layer_flops(self.model.config, rows, job.end)
        blocks = 1
        while flops / blocks > self.budget_flops and rows // (2 * blocks) >= MIN_ROWS:
            blocks *= 2
        p = _Progress(job, blocks, layout, self.engine.on_every_process(x))
        self._progress[job] = p
        return p

    def _cost(self, p: _Progress) -> float:
        rows = int(p.x.shape[0])
        kv_flops, rows_flops = layer_flops(self.model.config, rows, p.job.end)
        return kv_flops if p.part == 0 else rows_flops / p.blocks

    def _stage(self, p: _Progress) -> None:
        engine, job, layer = self.engine, p.job, p.layer
        rows = int(p.x.shape[0])
        positions = np.full(rows, job.start, np.int32)
        positions[:job.end - job.start] = np.arange(job.start, job.end)
        if p.part == 0:
            write = p.layout.write[0 if self.model.config.is_global(layer) else 1]
            engine.pages = self.model.span_layer(engine.pages, layer, p.x, positions, write)
            engine.window.dispatched(engine.pages.layers[layer].kv)
            last = layer == self.model.config.num_layers - 1
            p.layer, p.part = (layer + 1, 0) if last else (layer, 1)
            return
        r = p.part - 1
        size = rows // p.blocks
        batch = _rows_batch(job, p.layout, positions[r * size:(r + 1) * size])
        p.x = self.model.span_layer(engine.pages, layer, p.x, rows=batch, start=r * size)
        engine.window.dispatched(p.x)
        p.part = p.part + 1 if p.part < p.blocks else 0
        p.layer += p.part == 0


def _rows_batch(job, layout: SpanLayout, positions: np.ndarray):
    """A block of the span's rows as one sequence row of a RaggedBatch: its queries see every
    key up to the span's end (the span's keys are stored)."""
    from models.gemma3.ragged import RaggedBatch
    r = len(positions)
    ids = np.arange(r, dtype=np.int32)
    zeros = np.zeros(r, np.int32)
    return RaggedBatch(tokens=zeros, positions=positions.astype(np.int32),
                       visible=np.full(r, job.end - 1, np.int32), seq=zeros, col=ids,
                       write_global=zeros, write_local=zeros, queries=ids[None],
                       global_table=layout.global_table, local_table=layout.local_table,
                       local_first=layout.local_first, last=np.zeros(1, np.int32))
