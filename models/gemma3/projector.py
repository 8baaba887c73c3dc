"""Gemma 3's multimodal projector: the vision encoder's patches -> soft tokens in the text width.

The encoder's 64x64 grid of patches is average-pooled 4x4 to 16x16 = 256 tokens, RMS-normed in
Gemma's (1 + scale) form, and multiplied by a [vision width, text width] matrix
(transformers' `Gemma3MultiModalProjector`; in the official tree `embedder/mm_soft_embedding_norm`
and `embedder/mm_input_projection`). The result replaces the image's soft tokens' embeddings
as it is: unlike text embeddings it is not scaled by sqrt(d_model).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models.gemma3.vision import VisionConfig, VisionWeights, encode

Array = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProjectorWeights:
    norm: Array  # [Wv]      mm_soft_emb_norm (the official `scale`: applied as 1 + scale)
    proj: Array  # [Wv, D]   mm_input_projection_weight (official mm_input_projection/w)


def random_projector_weights(c: VisionConfig, d_model: int, dtype=np.float32,
                             seed: int = 1) -> ProjectorWeights:
    rng = np.random.default_rng(seed)
    return ProjectorWeights(
        norm=np.asarray(0.1 * rng.standard_normal(c.width), dtype),
        proj=np.asarray(rng.standard_normal((c.width, d_model)) / np.sqrt(c.width), dtype))


def pool(x: jax.Array, c: VisionConfig) -> jax.Array:
    """[B, num_patches, Wv] -> [B, tokens_per_image, Wv]: the mean of each pool x pool window
    of the patch grid, tokens row-major."""
    b, t, k = x.shape[0], c.tokens_per_side, c.pool
    grid = x.reshape(b, t, k, t, k, x.shape[-1]).astype(jnp.float32)
    return jnp.mean(grid, axis=(2, 4)).reshape(b, t * t, x.shape[-1]).astype(x.dtype)


def project(weights: ProjectorWeights, hidden: jax.Array, c: VisionConfig) -> jax.Array:
    """The encoder's last hidden state [B, num_patches, Wv] -> soft tokens [B, tokens_per_image, D]."""
    x = pool(hidden, c)
    y = x.astype(jnp.float32)
    y = y * lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + c.norm_eps)
    y = (y * (1.0 + weights.norm.astype(jnp.float32))).astype(x.dtype)
    return jnp.einsum("btw,wd->btd", y, weights.proj.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def image_features(vision: VisionWeights, projector: ProjectorWeights, pixels: jax.Array,
                   c: VisionConfig, **encode_kwargs) -> jax.Array:
    """pixels [B, H, W, 3] (normalized, `serving.media`) -> soft tokens [B, tokens_per_image, D]:
    what replaces each image's soft tokens' embeddings in the prompt."""
    return project(projector, encode(vision, pixels, c, **encode_kwargs), c)
