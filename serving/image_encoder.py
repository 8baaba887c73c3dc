"""The paged engine's image encoder: features cached by content hash, computed a bounded piece per
engine step, so that one image's encode does not hold up every running stream.

After each step the engine core calls `advance`, which runs encoder stages worth at most
`budget_flops`, oldest image first. In deterministic mode each image runs alone. See docs/vision.md,
"The encoder between steps"."""
from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Callable

from models.shapes import pow2

log = logging.getLogger(__name__)


BATCH_FRAMES = 4
MAX_IN_PROGRESS = 16
# Encoder FLOPs of one call when nothing else runs: not the whole tower, whose encode on a CPU
# can outlast the step watchdog's limit; this much stays far below it (docs/vision.md).
WHOLE_CALL_FLOPS = 4e11


def chunk_flops(config, tokens: int) -> float:
    """Matmul FLOPs of `tokens` prompt tokens through a text model's projections and MLP (the
    attention over the context, small for a short piece, left out)."""
    c = config
    per_layer = (2 * c.num_heads + 2 * c.num_kv_heads) * c.d_model * c.head_dim + 3 * c.d_model * c.ffn_hidden
    return 2.0 * per_layer * c.num_layers * tokens


@dataclasses.dataclass
class _Progress:
    image: object  # sequence.SeqImage
    stage: int = 0
    state: object = None  # vision_stages.State between stages


class ImageEncoder:
    """Features of sequence.SeqImages by content hash (module docstring). `model` is a
    Gemma3StepAPI with a tower (`takes_images`)."""

    def __init__(self, model, long_prefill_token_threshold: int, deterministic: bool = False,
                 budget_flops: float | None = None, max_cached: int = 64):
        from models.gemma3.vision_stages import StagedEncoder, blocks_for, stages

        c = model.vision.config
        self.budget_flops = float(budget_flops
                                  or chunk_flops(model.config, long_prefill_token_threshold))
        # Stages small enough that BATCH_FRAMES frames of one fit the budget together: images
        # that wait at the same stage then share a program.
        blocks = blocks_for(c, self.budget_flops / BATCH_FRAMES)
        self.stages = stages(c, blocks, model.config.d_model)
        self._staged = StagedEncoder(model.vision, c, blocks, model.dtype)
        self._model = model
        self.deterministic = deterministic
        self.whole_call_flops = WHOLE_CALL_FLOPS
        self.max_cached = max_cached
        self._features: OrderedDict[str, object] = OrderedDict()  # most recently used last
        self._progress: dict[str, _Progress] = {}
        self.images_encoded = 0
        self.last_work: list[tuple[int, int, float]] = []  # (stage, frames, FLOPs) of the last advance
        # Told (key, rows) of every image whose features are stored: a group's process 0 sends
        # them to the others (serving/group_images.py).
        self.on_store: Callable[[str, object], None] | None = None
        # For the tests and metrics: advances that ran work, the most FLOPs one ran, the most
        # frames one program took.
        self.advances = 0
        self.max_advance_flops = 0.0
        self.max_program_frames = 0

    def ready(self, key: str) -> bool:
        return key in self._features

    def peek(self, key: str):
        """The cached features of `key` (None if not cached), leaving the cache's order alone."""
        return self._features.get(key)

    def features(self, image):
        """Features [frames * tokens_per_image, D] of a SeqImage: from the cache, or encoded
        at once (only for a caller that did not wait for `ready`, e.g. a bare engine)."""
        rows = self._features.get(image.key)
        if rows is None:
            feats = self._model.image_features(image.pixels)
            rows = feats.reshape(-1, feats.shape[-1])
            self._store(image.key, rows)
        self._features.move_to_end(image.key)
        return rows

    def _store(self, key: str, rows) -> None:
        self._features[key] = rows
        self.images_encoded += 1
        if self.on_store is not None:
            self.on_store(key, rows)
        while len(self._features) > self.max_cached:
            self._features.popitem(last=False)

    def advance(self, wanted, bounded: bool = True, spent: float = 0.0) -> float:
        """Runs encoder stages for `wanted` (SeqImages, oldest request first) worth at most
        `budget_flops` (at least one stage, unless other work already `spent` the budget);
        returns the FLOPs run. bounded=False (the step ran nothing else: no stream to stall)
        runs up to `whole_call_flops` of them instead; never in deterministic mode, where an
        image's bits must not depend on the load."""
        if not bounded and not self.deterministic:
            return self._advance(wanted, max(self.budget_flops, self.whole_call_flops))
        if spent >= self.budget_flops:
            self.last_work = []
            return 0.0
        spent = self._advance(wanted, self.budget_flops - spent)
        if self.last_work:
            self.advances += 1
            self.max_advance_flops = max(self.max_advance_flops, spent)
        return spent

    def _advance(self, wanted, budget: float) -> float:
        pending, seen = [], set()
        for im in wanted:
            if im.key not in seen and not self.ready(im.key):
                seen.add(im.key)
                pending.append(im)
                self._progress.setdefault(im.key, _Progress(im))
        # Work on images not wanted now is kept a while (a waiting request's image is wanted
        # only in steps that try to admit it), the oldest dropped beyond MAX_IN_PROGRESS
        # (requests that ended).
        idle = [k for k in self._progress if k not in seen]
        for key in idle[:max(0, len(self._progress) - MAX_IN_PROGRESS)]:
            del self._progress[key]
        self.last_work = []
        spent = 0.0
        while pending:
            batch, cost = self._batch(pending, budget - spent, first=not self.last_work)
            if not batch:
                break
            self._run(batch)
            spent += cost
            pending = [im for im in pending if not self.ready(im.key)]
        return spent

    def _batch(self, pending, left: float, first: bool):
        """The oldest pending image and those at its stage after it, as many as `left` FLOPs
        pay for (the oldest alone when nothing has run yet in this step, whatever it costs)."""
        stage = self._progress[pending[0].key].stage
        flops = self.stages[stage].flops
        batch, cost = [], 0.0
        for im in pending:
            if self._progress[im.key].stage != stage:
                continue
            more = flops * len(im.spans)
            if cost + more > left and (batch or not first):
                break
            batch.append(im)
            cost += more
            if self.deterministic:
                break
        return batch, cost

    def _run(self, batch) -> None:
        progress = [self._progress[im.key] for im in batch]
        s = progress[0].stage
        stage = self.stages[s]
        frames = sum(len(im.spans) for im in batch)
        states = [p.state if s else p.image.pixels for p in progress]
        out = self._staged.run(stage, states, pow2(frames))
        self.last_work.append((s, frames, stage.flops * frames))
        self.max_program_frames = max(self.max_program_frames, frames)
        for p, state in zip(progress, out):
            p.stage, p.state = s + 1, state
            if p.stage == len(self.stages):
                del self._progress[p.image.key]
                self._store(p.image.key, state)
