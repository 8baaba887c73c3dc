"""Gemma 3's image encoder: SigLIP So400m/14 at 896x896, as pure functions over a weights pytree.

A ViT without a pooling head (the official `ViTModel`, transformers' `SiglipVisionModel`) over
channels-last pixels [B, H, W, 3] already normalized to [-1, 1] (`serving.media`); the projector
into the text model is `projector.py`. Numerics follow transformers' float32 path. Biases are
added after a matmul's result is reduced, so the same block runs on a tensor-parallel shard of
the heads and the MLP (`encode(..., reduce=...)`, docs/vision.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = Any


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """SigLIP encoder sizes and the projector's pooled token count (`mm_tokens_per_image`)."""

    name: str
    image_size: int = 896
    patch_size: int = 14
    width: int = 1152
    num_layers: int = 27
    num_heads: int = 16
    mlp_hidden: int = 4304
    channels: int = 3
    norm_eps: float = 1e-6
    tokens_per_image: int = 256

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size {self.patch_size} must divide image_size {self.image_size}")
        if self.width % self.num_heads:
            raise ValueError(f"num_heads {self.num_heads} must divide width {self.width}")
        side = round(self.tokens_per_image ** 0.5)
        if side * side != self.tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"tokens_per_image {self.tokens_per_image} must be a square whose side "
                             f"divides the {self.patches_per_side} patches a side")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.channels

    @property
    def tokens_per_side(self) -> int:
        return round(self.tokens_per_image ** 0.5)

    @property
    def pool(self) -> int:
        """Side of the average-pooling window (4 for So400m at 896: 64 patches -> 16 tokens)."""
        return self.patches_per_side // self.tokens_per_side

    def replace(self, **changes) -> "VisionConfig":
        return dataclasses.replace(self, **changes)


VISION_CONFIGS: dict[str, VisionConfig] = {
    "so400m": VisionConfig(name="siglip-so400m-14-896"),
    # For tests: 8x8 patches of 8 px pooled 2x2 to 16 tokens, two blocks, heads split at tp=2.
    "tiny": VisionConfig(name="siglip-tiny", image_size=64, patch_size=8, width=32, num_layers=2,
                         num_heads=4, mlp_hidden=64, tokens_per_image=16),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionLayerWeights:
    """One encoder block, contracted dimension first."""

    ln1_scale: Array  # [W]
    ln1_bias: Array  # [W]
    qkv: Array  # [W, 3, N, Hd]     official MultiHeadDotProductAttention_0/{query,key,value}/kernel
    qkv_bias: Array  # [3, N, Hd]
    o: Array  # [N, Hd, W]          official .../out/kernel
    o_bias: Array  # [W]
    ln2_scale: Array  # [W]
    ln2_bias: Array  # [W]
    fc1: Array  # [W, F]            official MlpBlock_0/Dense_0/kernel
    fc1_bias: Array  # [F]
    fc2: Array  # [F, W]            official MlpBlock_0/Dense_1/kernel
    fc2_bias: Array  # [W]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionWeights:
    patch_embed: Array  # [P*P*C, W]  rows in (row, column, channel) order of a patch
    patch_bias: Array  # [W]
    pos_embed: Array  # [num_patches, W]
    layers: tuple[VisionLayerWeights, ...]
    final_norm_scale: Array  # [W]
    final_norm_bias: Array  # [W]


def layer_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    W, N, H, F = c.width, c.num_heads, c.head_dim, c.mlp_hidden
    return {"ln1_scale": (W,), "ln1_bias": (W,), "qkv": (W, 3, N, H), "qkv_bias": (3, N, H),
            "o": (N, H, W), "o_bias": (W,), "ln2_scale": (W,), "ln2_bias": (W,),
            "fc1": (W, F), "fc1_bias": (F,), "fc2": (F, W), "fc2_bias": (W,)}


def map_vision_weights(c: VisionConfig, fn: Callable[[int | None, str, tuple[int, ...]], Any]
                       ) -> VisionWeights:
    """A VisionWeights tree from fn(layer, name, shape); layer None outside the blocks."""
    W = c.width
    layers = tuple(VisionLayerWeights(**{f: fn(i, f, s) for f, s in layer_shapes(c).items()})
                   for i in range(c.num_layers))
    return VisionWeights(
        patch_embed=fn(None, "patch_embed", (c.patch_dim, W)),
        patch_bias=fn(None, "patch_bias", (W,)), pos_embed=fn(None, "pos_embed", (c.num_patches, W)),
        layers=layers, final_norm_scale=fn(None, "final_norm_scale", (W,)),
        final_norm_bias=fn(None, "final_norm_bias", (W,)))


def random_vision_weights(c: VisionConfig, dtype=np.float32, seed: int = 0) -> VisionWeights:
    """Random weights of realistic scale (LayerNorm scales near 1), as host numpy arrays."""
    rng = np.random.default_rng(seed)

    def make(layer, name, shape):
        if name.endswith("scale"):
            x = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            x = 0.02 * rng.standard_normal(shape)
        else:
            fan_in = shape[0] if name != "o" else shape[0] * shape[1]
            x = rng.standard_normal(shape) / np.sqrt(fan_in)
        return np.asarray(x, dtype)

    return map_vision_weights(c, make)


# ---------------------------------------------------------------------------------------------
# Forward pass


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis, computed in float32 (as torch does for half inputs)."""
    y = x.astype(jnp.float32)
    mean = jnp.mean(y, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
    y = (y - mean) * lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _mm(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def patchify(pixels: jax.Array, c: VisionConfig) -> jax.Array:
    """[B, H, W, C] -> [B, num_patches, P*P*C]: patches row-major over the image, each patch's
    values in (row, column, channel) order."""
    b, p, s = pixels.shape[0], c.patch_size, c.patches_per_side
    if pixels.shape[1:] != (c.image_size, c.image_size, c.channels):
        raise ValueError(f"pixels must be [B, {c.image_size}, {c.image_size}, {c.channels}], "
                         f"got {tuple(pixels.shape)}")
    x = pixels.reshape(b, s, p, s, p, c.channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, s * s, c.patch_dim)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, query_chunk: int) -> jax.Array:
    """Bidirectional attention, q/k/v [B, L, Nl, Hd] (q already scaled) -> [B, L, Nl, Hd].
    Queries go in chunks so that the logits of 4,096 x 4,096 tokens x 16 heads (1 GiB in float32
    an image) never exist at once."""
    b, length, n, h = q.shape

    def block(qc):  # [B, Lc, Nl, Hd]
        logits = jnp.einsum("bqnh,bknh->bnqk", qc, k, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.einsum("bnqk,bknh->bqnh", probs, v,
                          preferred_element_type=jnp.float32).astype(v.dtype)

    if length <= query_chunk or length % query_chunk:
        return block(q)
    chunks = q.reshape(b, length // query_chunk, query_chunk, n, h).swapaxes(0, 1)
    return lax.map(block, chunks).swapaxes(0, 1).reshape(b, length, n, h)


def _identity(x: jax.Array) -> jax.Array:
    return x


def attention_inputs(x: jax.Array, w: VisionLayerWeights, c: VisionConfig
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A block's first half on x [B, L, W]: the queries (already scaled), keys and values
    [B, L, N, Hd] of every token. Split from `block_rows` so that a staged encoder
    (`vision_stages`) can run the rest of a block a few rows at a time."""
    y = layer_norm(x, w.ln1_scale, w.ln1_bias, c.norm_eps)
    qkv = _mm("blw,wcnh->blcnh", y, w.qkv) + w.qkv_bias.astype(x.dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    return q * jnp.asarray(c.head_dim ** -0.5, q.dtype), k, v


def block_rows(x: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, w: VisionLayerWeights,
               c: VisionConfig, reduce: Callable[[jax.Array], jax.Array] = _identity,
               query_chunk: int = 1024) -> jax.Array:
    """A block's second half for some rows: x [B, R, W] and their queries [B, R, N, Hd]
    attend to all keys and values [B, L, N, Hd], then the MLP; every row independent."""
    att = _attention(q, k, v, query_chunk)
    x = x + (reduce(_mm("blnh,nhw->blw", att, w.o)) + w.o_bias.astype(x.dtype))
    y = layer_norm(x, w.ln2_scale, w.ln2_bias, c.norm_eps)
    y = jax.nn.gelu(_mm("blw,wf->blf", y, w.fc1) + w.fc1_bias.astype(x.dtype), approximate=True)
    return x + (reduce(_mm("blf,fw->blw", y, w.fc2)) + w.fc2_bias.astype(x.dtype))


def encoder_layer(x: jax.Array, w: VisionLayerWeights, c: VisionConfig,
                  reduce: Callable[[jax.Array], jax.Array] = _identity,
                  query_chunk: int = 1024) -> jax.Array:
    """One block on x [B, L, W]. The weights may be a shard of the heads and of the MLP's hidden
    units: `reduce` then sums the two partial products (the attention output and the MLP's down
    projection) over the shards before their biases are added."""
    q, k, v = attention_inputs(x, w, c)
    return block_rows(x, q, k, v, w, c, reduce, query_chunk)


def embed_patches(weights: VisionWeights, pixels: jax.Array, c: VisionConfig,
                  patched: bool = False) -> jax.Array:
    """pixels [B, H, W, 3] (normalized) -> the first block's input [B, num_patches, W]; or, with
    patched, some patches [B, R, P*P*C] -> theirs (pos_embed then holds those R rows)."""
    dtype = weights.patch_embed.dtype
    patches = pixels.astype(dtype) if patched else patchify(pixels.astype(dtype), c)
    x = _mm("bpd,dw->bpw", patches, weights.patch_embed)
    return x + weights.patch_bias.astype(dtype) + weights.pos_embed.astype(dtype)[None]


def encode(weights: VisionWeights, pixels: jax.Array, c: VisionConfig,
           reduce: Callable[[jax.Array], jax.Array] = _identity,
           query_chunk: int = 1024) -> jax.Array:
    """pixels [B, H, W, 3] (normalized) -> the encoder's last hidden state [B, num_patches, W]
    (after the final LayerNorm), in the weights' dtype."""
    x = embed_patches(weights, pixels, c)
    for w in weights.layers:
        x = encoder_layer(x, w, c, reduce, query_chunk)
    return layer_norm(x, weights.final_norm_scale, weights.final_norm_bias, c.norm_eps)


def layer_flops(c: VisionConfig) -> tuple[float, float]:
    """Matmul FLOPs of one block for one image: (the queries, keys and values of every token,
    the rest of the block for every row: attention, output projection and MLP)."""
    n, w = c.num_patches, c.width
    qkv = 2.0 * n * w * 3 * w
    rows = 4.0 * n * n * w + 2.0 * n * w * w + 4.0 * n * w * c.mlp_hidden
    return qkv, rows
