"""Gemma 3's image tokens and how a prompt lays them out.

Each image's `<start_of_image>` becomes the text transformers' `Gemma3Processor` writes:
"\\n\\n<start_of_image>", 256 soft tokens, "<end_of_image>\\n\\n" (textual, so the newlines merge
with neighbouring ones), or with pan-and-scan the original and then its crops (`with_crops`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

START_OF_IMAGE = "<start_of_image>"
END_OF_IMAGE = "<end_of_image>"
IMAGE_SOFT_TOKEN = "<image_soft_token>"
START_OF_IMAGE_ID = 255_999
END_OF_IMAGE_ID = 256_000
# Beyond the text-only vocabulary (262,144): only the multimodal checkpoints' embeddings (262,208
# rows) have a row for it, and that row is never used (the features replace it).
IMAGE_SOFT_TOKEN_ID = 262_144
TOKENS_PER_IMAGE = 256

PAN_AND_SCAN_PREFIX = "Here is the original image "
PAN_AND_SCAN_MIDDLE = " and here are some crops to help you see better "


def image_sequence(tokens_per_image: int = TOKENS_PER_IMAGE) -> str:
    """The text one image (or one crop) becomes."""
    return f"\n\n{START_OF_IMAGE}{IMAGE_SOFT_TOKEN * tokens_per_image}{END_OF_IMAGE}\n\n"


def with_crops(image: str, crops: int) -> str:
    """One image's text with `crops` pan-and-scan crops as the reference processor lays it out
    (`image` stands for the original and for each crop), or `image` alone without crops."""
    if not crops:
        return image
    return PAN_AND_SCAN_PREFIX + image + PAN_AND_SCAN_MIDDLE + " ".join([image] * crops)


def expand_image_placeholders(text: str, crops: Sequence[int] | None = None,
                              tokens_per_image: int = TOKENS_PER_IMAGE) -> str:
    """Replace the i-th `<start_of_image>` of `text` with image i's token text; `crops[i]` is the
    number of pan-and-scan crops image i has (None or 0: none). Raises ValueError when `crops`
    does not have one entry per placeholder."""
    parts = text.split(START_OF_IMAGE)
    n = len(parts) - 1
    crops = [0] * n if crops is None else [int(k) for k in crops]
    if len(crops) != n:
        raise ValueError(f"the prompt has {n} image placeholders but {len(crops)} images")
    one = image_sequence(tokens_per_image)
    out = [parts[0]]
    for k, rest in zip(crops, parts[1:]):
        out.append(with_crops(one, k))
        out.append(rest)
    return "".join(out)


def image_spans(ids: Sequence[int] | np.ndarray) -> tuple[tuple[int, int], ...]:
    """(start, end) of each run of soft tokens in `ids`."""
    soft = np.asarray(ids) == IMAGE_SOFT_TOKEN_ID
    edges = np.flatnonzero(np.diff(np.concatenate([[False], soft, [False]]).astype(np.int8)))
    return tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]))
