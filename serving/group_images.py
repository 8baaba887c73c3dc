"""Images in a multi-process group (serving/distributed.py): which process computes what, and what
travels between them.

Process 0 alone encodes; each image's features (not pixels) go to the others once, in broadcasts of
their own, and later steps name images by key. Image spans run over the whole mesh, so every process
replays each `advance_spans` as a SPANS step. See docs/vision.md, "Images in a multi-process group"."""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from serving import wire
from serving.image_spans import SpanLayout
from serving.sequence import SeqImage

# Images whose features the other processes keep (as many as process 0's encoder caches).
SHARED = 64


class EncodeWork(NamedTuple):
    """An ENCODE step: process 0 runs encoder work between steps; the others wait through it."""

    count: int  # images
    bounded: bool

    WIRE = dict(count=wire.Int(), bounded=wire.Bool())

    def watch(self) -> dict:  # what decides its programs, as the engine core's step key says
        return dict(images=self.count, bounded=self.bounded)


class Features(NamedTuple):
    """A FEATURES step: the features of image `key` follow in `pieces`."""

    key: str
    dtype: str
    shape: tuple[int, ...]

    WIRE = dict(key=wire.Text(), dtype=wire.Text(), shape=wire.Ints())

    def watch(self) -> dict:
        return {}

    @property
    def words(self) -> int:
        return -(-math.prod(self.shape) * _dtype(self.dtype).itemsize // 4)


class SpanTask(NamedTuple):
    """One listed image span of a SPANS step: its number (the same while it stays listed), what
    `SpanWriter` reads of a `paged_scheduler.SpanJob`, and its layout on its first listing."""

    id: int
    image: SeqImage
    crop: int
    start: int
    end: int
    layout: SpanLayout | None

    WIRE = dict(id=wire.Int(), image=wire.Record(SeqImage), crop=wire.Int(), start=wire.Int(),
                end=wire.Int(), layout=wire.Optional(wire.Record(SpanLayout)))


class SpanWork(NamedTuple):
    """A SPANS step: one `advance_spans` call."""

    tasks: tuple[SpanTask, ...]
    bounded: bool

    WIRE = dict(tasks=wire.Tuple(wire.Record(SpanTask)), bounded=wire.Bool())

    def watch(self) -> dict:
        return dict(spans=len(self.tasks), bounded=self.bounded)


@dataclasses.dataclass(eq=False)
class _Span:
    """A span as the other processes' SpanWriter sees it (one object while listed: the writer
    keeps its work by identity, as it does for process 0's SpanJobs)."""

    image: SeqImage
    crop: int
    start: int
    end: int
    layout: SpanLayout


def _dtype(name) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16 if str(name) == "bfloat16" else name)


def piece_words(model) -> int:
    """Int32 words of one crop's features in the model's dtype: the feature broadcast's size."""
    itemsize = _dtype(model.dtype).itemsize
    return -(-model.vision.config.tokens_per_image * model.config.d_model * itemsize // 4)


def to_words(rows: np.ndarray) -> np.ndarray:
    """An array's bytes as int32 words (zero-padded to a whole word)."""
    data = np.ascontiguousarray(rows).view(np.uint8).reshape(-1)
    return np.concatenate([data, np.zeros(-data.size % 4, np.uint8)]).view(np.int32)


def from_words(words: np.ndarray, header: Features) -> np.ndarray:
    dtype = _dtype(header.dtype)
    n = math.prod(header.shape)
    return np.asarray(words, np.int32).view(np.uint8)[:n * dtype.itemsize].view(dtype).reshape(
        header.shape)


class SharedFeatures:
    """The images whose features the other processes hold, oldest named first (module
    docstring); theirs map each key to its rows, process 0's to None."""

    def __init__(self, capacity: int = SHARED):
        self.capacity = capacity
        self.items: OrderedDict[str, object] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self.items

    def add(self, key: str, rows=None) -> None:
        self.items[key] = rows
        self.items.move_to_end(key)

    def name(self, keys) -> None:
        """A step names `keys`: they move to the back; the oldest others go beyond capacity."""
        keys = list(dict.fromkeys(keys))  # (in order: a set's order differs between processes)
        for key in keys:
            self.get(key)
            self.items.move_to_end(key)
        while len(self.items) > max(self.capacity, len(keys)):
            self.items.popitem(last=False)

    def get(self, key: str):
        if key not in self.items:
            raise KeyError(f"process 0 never sent the features of image {key[:12]}")
        return self.items[key]


class LeaderImages:
    """Process 0's side: the features to send, and each listed span's number."""

    def __init__(self, runner):
        self.runner = runner
        self.shared = SharedFeatures()
        self._stored: list[tuple[str, object]] = []  # stored by the encoder, not sent yet
        runner.encoder.on_store = lambda key, rows: self._stored.append((key, rows))
        self._ids: dict[object, int] = {}  # listed SpanJob -> its number
        self._numbers = itertools.count()

    def missing(self, images) -> list:
        """Images (each once) whose features process 0 itself no longer holds: its cache
        dropped them since they were ready, so they are encoded again, as one process does."""
        encoder = self.runner.encoder
        return list({im.key: im for im in images if not encoder.ready(im.key)}.values())

    def to_send(self, images) -> list[tuple[Features, np.ndarray]]:
        """What the others must be sent before a step naming `images`: every image stored since
        the last call, and those they do not hold; each as (header, words)."""
        out, seen = [], set()
        wanted = list(self._stored) + [(im.key, None) for im in images if im.key not in self.shared]
        self._stored = []
        for key, rows in wanted:
            if key in seen:
                continue
            seen.add(key)
            rows = np.asarray(rows if rows is not None else self.runner.encoder.peek(key))
            header = Features(key, rows.dtype.name, tuple(int(d) for d in rows.shape))
            out.append((header, to_words(rows)))
            self.shared.add(key)
        return out

    def span_work(self, jobs, kv, bounded: bool) -> SpanWork:
        """The SPANS step of `advance_spans(jobs, kv, bounded)`: a span keeps its number while
        listed (the others' writer keeps its work by it); its layout goes with its first
        listing, read from the page tables, which do not change while it is written."""
        from serving.image_spans import span_layout

        listed = set(jobs)
        self._ids = {job: n for job, n in self._ids.items() if job in listed}
        tasks = []
        for job in jobs:
            layout = None
            if job not in self._ids:
                self._ids[job] = next(self._numbers)
                layout = span_layout(job, kv, self.runner.info)
            tasks.append(SpanTask(self._ids[job], job.image, job.crop, job.start, job.end, layout))
        return SpanWork(tuple(tasks), bounded)


class FollowerImages:
    """Another process's side: the features it was sent, and the spans being written."""

    def __init__(self, runner):
        import jax

        self.runner = runner
        self.shared = SharedFeatures()
        runner.features_from = self.shared.get
        model = runner.model
        # Where process 0's encoder leaves them: this process's first device of the mesh.
        self._device = next(d for d in model.mesh.devices.flat
                            if d.process_index == jax.process_index())
        self._spans: dict[int, _Span] = {}

    def store(self, header: Features, words: np.ndarray) -> None:
        import jax

        self.shared.add(header.key, jax.device_put(from_words(words, header), self._device))

    def spans(self, work: SpanWork) -> list[_Span]:
        listed = {t.id for t in work.tasks}
        self._spans = {n: span for n, span in self._spans.items() if n in listed}
        out = []
        for t in work.tasks:
            if t.layout is not None:
                self._spans[t.id] = _Span(t.image, t.crop, t.start, t.end, t.layout)
            if t.id not in self._spans:
                raise ValueError(f"malformed step: span {t.id} listed without its layout")
            out.append(self._spans[t.id])
        return out
