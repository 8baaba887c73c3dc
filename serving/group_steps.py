"""A multi-process group's steps as words: the step kinds, and one step as int32 arrays of the
broadcast's fixed size (`encode_step`, `decode_step`), the size being the largest step of text
an engine's info allows (`step_capacity`). `serving/distributed.py` broadcasts them; each input
type's own WIRE table says how its fields travel (`serving/wire.py`), so nothing here names a
field.

No jax import (the group's processes join it before jax creates its backends).
"""
from __future__ import annotations

import numpy as np

from serving import wire

# Step kinds (header[0]). Each kind that carries inputs names their type (`_input_types`).
IDLE, RESET, SHUTDOWN, RAGGED = 0, 1, 2, 3
# The image work between steps (serving/group_images.py).
ENCODE, FEATURES, SPANS = 4, 5, 6
KIND_NAMES = {IDLE: "idle", RESET: "reset", SHUTDOWN: "shutdown", RAGGED: "ragged",
              ENCODE: "encode", FEATURES: "features", SPANS: "spans"}
_HEADER = 2  # kind, payload length


def _input_types() -> dict[int, type]:
    """The input type of each kind that carries inputs (imported on use: they import jax)."""
    from serving.group_images import EncodeWork, Features, SpanWork
    from serving.paged_steps import StepInputs

    return {RAGGED: StepInputs, ENCODE: EncodeWork, FEATURES: Features, SPANS: SpanWork}


def step_capacity(info) -> int:
    """Int32 words of one step broadcast: the largest step of text an engine with `info` can be
    asked to run (header included), the largest of the ragged step's `wire_examples` (image
    work that does not fit goes on in more broadcasts)."""
    from serving.paged_steps import StepInputs

    return _HEADER + max(len(wire.encode(x)) for x in StepInputs.wire_examples(info))


def encode_step(kind: int, inputs, capacity: int) -> np.ndarray:
    """One step as int32 [n * capacity], n >= 1 broadcasts of `capacity` words (`broadcasts`):
    a header and its inputs' words (serving/wire.py), zero-padded."""
    if kind not in KIND_NAMES:
        raise ValueError(f"unknown step kind {kind}")
    want = _input_types().get(kind)
    if (inputs is None) != (want is None) or (want is not None and type(inputs) is not want):
        raise ValueError(f"a {KIND_NAMES[kind]} step carries "
                         f"{'no inputs' if want is None else want.__name__}, got {type(inputs).__name__}")
    payload = np.zeros(0, np.int32) if inputs is None else wire.encode(inputs)
    out = np.zeros(-(-(_HEADER + payload.size) // capacity) * capacity, np.int32)
    out[:_HEADER] = kind, payload.size
    out[_HEADER:_HEADER + payload.size] = payload
    return out


def broadcasts(first: np.ndarray) -> int:
    """How many broadcasts of its size a step takes, from its first one's header."""
    size = int(first[1])
    if size < 0:
        raise ValueError(f"malformed step: {size} payload words")
    return -(-(_HEADER + size) // len(first))


def decode_step(buf: np.ndarray) -> tuple[int, object]:
    """Inverse of `encode_step`: (kind, its inputs or None)."""
    buf = np.asarray(buf, np.int32)
    kind, size = int(buf[0]), int(buf[1])
    if kind not in KIND_NAMES:
        raise ValueError(f"unknown step kind {kind}")
    if not 0 <= size <= buf.size - _HEADER:
        raise ValueError(f"malformed step: {size} payload words in a buffer of {buf.size}")
    cls = _input_types().get(kind)
    if cls is None:
        if size:
            raise ValueError(f"malformed step: a {KIND_NAMES[kind]} step with {size} payload words")
        return kind, None
    return kind, wire.decode(cls, buf[_HEADER:_HEADER + size])
