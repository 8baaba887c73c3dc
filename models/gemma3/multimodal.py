"""The prompt side of Gemma 3 image input: image token layout, soft-token spans, feature merge.

Each image in a prompt becomes, as transformers' `Gemma3Processor` writes it,

    "\\n\\n<start_of_image>" + 256 x "<image_soft_token>" + "<end_of_image>\\n\\n"

in place of the `<start_of_image>` the chat template writes for an image content part. The
expansion is textual, so the "\\n\\n" merge with neighbouring newlines into one piece
("user\\n" before an image gives "user" + "\\n\\n\\n"), which is what the reference tokenizer
produces and the model was served with there. The official `gemma` library instead inserts the
token 108 ("\\n\\n") on each side at the id level (`expand_image_ids`); the two differ only
where an image touches a newline.

With pan-and-scan an image placeholder becomes "Here is the original image {image} and here
are some crops to help you see better {crop} {crop} ...", each {..} expanded as above, and the
images are the original then its crops, in that order (`Gemma3Processor.replace_image_token`).

Attention: the soft tokens of one image (only those, not its start and end tokens) see each
other in both directions (transformers' `token_type_ids`, the official `bidirectional_mask`);
`visible_positions` expresses that as, per token, the last key position it may see.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

START_OF_IMAGE = "<start_of_image>"
END_OF_IMAGE = "<end_of_image>"
IMAGE_SOFT_TOKEN = "<image_soft_token>"
START_OF_IMAGE_ID = 255_999
END_OF_IMAGE_ID = 256_000
# Beyond the text-only vocabulary (262,144): only the multimodal checkpoints' embeddings (262,208
# rows) have a row for it, and that row is never used (the features replace it).
IMAGE_SOFT_TOKEN_ID = 262_144
DOUBLE_NEWLINE_ID = 108
TOKENS_PER_IMAGE = 256

PAN_AND_SCAN_PREFIX = "Here is the original image "
PAN_AND_SCAN_MIDDLE = " and here are some crops to help you see better "

_IMAGE_PIECES = {START_OF_IMAGE: START_OF_IMAGE_ID, END_OF_IMAGE: END_OF_IMAGE_ID,
                 IMAGE_SOFT_TOKEN: IMAGE_SOFT_TOKEN_ID}
_SPLIT = re.compile("|".join(map(re.escape, _IMAGE_PIECES)))


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


@dataclasses.dataclass(frozen=True)
class ImagePrompt:
    """A prompt's token ids with its images' soft tokens laid out.

    spans[i] = (start, end): image i's soft tokens are ids[start:end] (images, crops included,
    in prompt order, which is the order their features come in)."""

    ids: np.ndarray  # int32 [T]
    spans: tuple[tuple[int, int], ...]

    @property
    def soft_mask(self) -> np.ndarray:
        """bool [T]: which tokens' embeddings the image features replace."""
        return self.ids == IMAGE_SOFT_TOKEN_ID

    @property
    def num_images(self) -> int:
        return len(self.spans)


def image_spans(ids: Sequence[int] | np.ndarray) -> tuple[tuple[int, int], ...]:
    """(start, end) of each run of soft tokens in `ids`."""
    soft = np.asarray(ids) == IMAGE_SOFT_TOKEN_ID
    edges = np.flatnonzero(np.diff(np.concatenate([[False], soft, [False]]).astype(np.int8)))
    return tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]))


def encode_with_images(text: str, encode: Callable[[str], list[int]]) -> ImagePrompt:
    """Token ids of an expanded prompt text (`expand_image_placeholders`): the three image
    tokens become their ids wherever they appear, as the reference tokenizer's added tokens
    split the text; `encode` (the model's tokenizer, without BOS) takes the text between."""
    ids: list[int] = []
    at = 0
    for m in _SPLIT.finditer(text):
        if m.start() > at:
            ids += encode(text[at:m.start()])
        ids.append(_IMAGE_PIECES[m.group()])
        at = m.end()
    if at < len(text):
        ids += encode(text[at:])
    arr = np.asarray(ids, np.int32)
    return ImagePrompt(ids=arr, spans=image_spans(arr))


def expand_image_ids(ids: Sequence[int], tokens_per_image: int = TOKENS_PER_IMAGE) -> ImagePrompt:
    """The official library's id-level layout: each START_OF_IMAGE_ID becomes
    108, START_OF_IMAGE_ID, soft x tokens_per_image, END_OF_IMAGE_ID, 108."""
    out: list[int] = []
    for t in ids:
        if int(t) == START_OF_IMAGE_ID:
            out += [DOUBLE_NEWLINE_ID, START_OF_IMAGE_ID, *[IMAGE_SOFT_TOKEN_ID] * tokens_per_image,
                    END_OF_IMAGE_ID, DOUBLE_NEWLINE_ID]
        else:
            out.append(int(t))
    arr = np.asarray(out, np.int32)
    return ImagePrompt(ids=arr, spans=image_spans(arr))


def check_spans(spans: Sequence[tuple[int, int]], tokens_per_image: int) -> None:
    """Raise ValueError unless every span holds exactly one image's soft tokens."""
    for i, (a, b) in enumerate(spans):
        if b - a != tokens_per_image:
            raise ValueError(f"image {i} has {b - a} soft tokens at [{a}, {b}), "
                             f"expected {tokens_per_image}")


def visible_positions(positions: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per token, the last key position it may attend to: its own position (causal), or for a
    soft token the position of its image's last soft token. `positions` [T] are the tokens'
    positions (their indices in a whole prompt; a chunk's slice of them); spans index the same
    tokens."""
    positions = np.asarray(positions)
    visible = positions.copy()
    for a, b in spans:
        visible[a:b] = positions[b - 1]
    return visible


def merge_image_features(embeds: jax.Array, features: jax.Array, soft_mask: jax.Array) -> jax.Array:
    """The text embeddings [T, D] (already scaled by sqrt(d_model)) with the soft tokens' rows
    replaced, in order, by the image features [n_images * tokens_per_image, D] (not scaled);
    soft_mask bool [T]. A mask with fewer True entries than feature rows uses the first rows
    (a prefill chunk passes the features its soft tokens need); more is a caller error that
    repeats the last row. jit-friendly: no data-dependent shapes."""
    index = jnp.clip(jnp.cumsum(soft_mask.astype(jnp.int32)) - 1, 0, features.shape[0] - 1)
    rows = jnp.take(features, index, axis=0).astype(embeds.dtype)
    return jnp.where(soft_mask[:, None], rows, embeds)


def merge_at(embeds: jax.Array, features: jax.Array, index: jax.Array) -> jax.Array:
    """embeds [T, D] with row index[j] replaced by features[j] for every j; index [M] int32
    (entries >= T are dropped: padding of a fixed-size index)."""
    return embeds.at[index].set(features.astype(embeds.dtype), mode="drop")
