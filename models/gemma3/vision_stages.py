"""The image encoder cut into small stages, so that a server can run it a bounded piece at a time
between engine steps (`serving.image_encoder`) instead of holding up every stream for a whole
image:

    embed block 0..nb-1 | (qkv block 0..nb-1, rows block 0..nb-1) for each encoder block | finish

Each stage is the one-shot encoder's functions (`vision.attention_inputs`, `vision.block_rows`)
on 1/nb of the rows, so the stages compute what `projector.image_features` computes.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models.gemma3.projector import ProjectorWeights, project
from models.gemma3.vision import (VisionConfig, VisionWeights, attention_inputs, block_rows,
                                  embed_patches, layer_flops, layer_norm,
                                  patchify)


@dataclasses.dataclass(frozen=True)
class Stage:
    kind: str  # "embed" | "qkv" | "rows" | "finish"
    layer: int = -1
    block: int = 0  # which 1/nb of the tokens (qkv) or rows (rows)
    flops: float = 0.0  # matmul FLOPs for one frame


def stages(c: VisionConfig, blocks: int, d_model: int) -> tuple[Stage, ...]:
    """Every stage of one frame's encoding, in order (`blocks` must divide num_patches)."""
    if blocks < 1 or c.num_patches % blocks:
        raise ValueError(f"blocks ({blocks}) must divide the {c.num_patches} patches")
    qkv, rows = layer_flops(c)
    embed = 2.0 * c.num_patches * c.patch_dim * c.width
    out = [Stage("embed", -1, b, embed / blocks) for b in range(blocks)]
    for layer in range(c.num_layers):
        out += [Stage("qkv", layer, b, qkv / blocks) for b in range(blocks)]
        out += [Stage("rows", layer, b, rows / blocks) for b in range(blocks)]
    out.append(Stage("finish", flops=2.0 * c.tokens_per_image * c.width * d_model))
    return tuple(out)


def blocks_for(c: VisionConfig, budget_flops: float, most: int = 64) -> int:
    """The fewest power-of-two blocks (dividing num_patches, at most `most`) whose embed, qkv
    and rows stages of one frame each cost at most `budget_flops`; `most` where none does."""
    qkv, rows = layer_flops(c)
    rows = max(rows, 2.0 * c.num_patches * c.patch_dim * c.width)
    b = 1
    while max(qkv, rows) / b > budget_flops and b < most and c.num_patches % (2 * b) == 0:
        b *= 2
    return b


class State(NamedTuple):
    """One image's frames between stages: the residual stream x [f, L, W], inside a block the
    queries, keys and values [f, L, N, Hd] filled so far (None outside), and the pixels
    [f, H, W, 3] until every patch is embedded."""

    x: jax.Array
    qkv: tuple | None = None
    pixels: jax.Array | None = None


def _pack(arrays, frames: int):
    """Concatenates per-image arrays along the frames and pads to `frames` rows with zeros."""
    x = arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays)
    pad = frames - x.shape[0]
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x


def _unpack(x, counts):
    out, i = [], 0
    for n in counts:
        out.append(x[i:i + n])
        i += n
    return out


class StagedEncoder:
    """Runs `stages` on a placed tower and projector (`Gemma3StepAPI.vision`): run(stage, states)
    advances several images' states by one stage in one program (frames concatenated and
    padded to a power of two; a block's weights are arguments, so one program serves every
    block)."""

    def __init__(self, vision, c: VisionConfig, blocks: int, dtype):
        self.vision, self.config, self.blocks, self.dtype = vision, c, blocks, dtype
        self.rows = c.num_patches // blocks
        # The queries, keys and values filled so far (qkv) and the residual stream (rows) are
        # donated: a lone image's stage then updates them in place instead of copying them.
        self._embed = jax.jit(self._embed_fn, static_argnums=(4, 5), donate_argnums=(1,))
        self._qkv = jax.jit(self._qkv_fn, static_argnums=(4, 5), donate_argnums=(2,))
        self._block = jax.jit(self._rows_fn, static_argnums=(4, 5), donate_argnums=(1,))
        self._finish = jax.jit(self._finish_fn, static_argnums=(3, 5))

    def run(self, stage: Stage, states: list, frames: int) -> list:
        """states: per image, its pixels [f, H, W, 3] before the first stage, else a `State`;
        frames: the padded batch (>= the images' frames). Returns the next states (features
        [f * tokens_per_image, D] after "finish")."""
        states = [s if isinstance(s, State) else self._start(s) for s in states]
        counts = tuple(int(s.x.shape[0]) for s in states)
        v = self.vision.vision
        start = jnp.int32(stage.block * self.rows)
        if stage.kind == "embed":
            head = dataclasses.replace(v, layers=())
            x = self._embed(head, [s.x for s in states], [s.pixels for s in states], start,
                            frames, counts)
            last = stage.block == self.blocks - 1
            return [State(xi, None, None if last else s.pixels) for xi, s in zip(x, states)]
        if stage.kind == "finish":
            return self._finish(v.final_norm_scale, v.final_norm_bias, self.vision.projector,
                                frames, [s.x for s in states], counts)
        w = v.layers[stage.layer]
        if stage.kind == "qkv":
            prev = [s.qkv if s.qkv is not None else self._empty(s.x) for s in states]
            out = self._qkv(w, [s.x for s in states], prev, start, frames, counts)
            return [State(s.x, q) for s, q in zip(states, out)]
        x = self._block(w, [s.x for s in states], [s.qkv for s in states], start, frames, counts)
        last = stage.block == self.blocks - 1  # the block's queries, keys and values are spent
        return [State(xi, None if last else s.qkv) for xi, s in zip(x, states)]

    def _start(self, pixels) -> State:
        c = self.config
        # Where the tower is (one device of the mesh, or all of it): the stages run there.
        where = jax.tree.leaves(self.vision.vision)[0].sharding
        pixels = jax.device_put(np.asarray(pixels, self.dtype), where)
        x = jax.device_put(np.zeros((pixels.shape[0], c.num_patches, c.width), self.dtype), where)
        return State(x, None, pixels)

    def _empty(self, x):
        c = self.config
        shape = (x.shape[0], c.num_patches, c.num_heads, c.head_dim)
        return tuple(jnp.zeros(shape, x.dtype) for _ in range(3))

    # The jitted bodies; `counts` (static) is each image's frames, to split the batch back.
    def _embed_fn(self, head: VisionWeights, xs, pixels, start, frames, counts):
        c = self.config
        patches = lax.dynamic_slice_in_dim(patchify(_pack(pixels, frames), c), start, self.rows, 1)
        pos = lax.dynamic_slice_in_dim(head.pos_embed, start, self.rows, 0)
        x = embed_patches(dataclasses.replace(head, pos_embed=pos), patches, c, patched=True)
        return _unpack(lax.dynamic_update_slice_in_dim(_pack(xs, frames), x, start, axis=1), counts)

    def _qkv_fn(self, w, xs, prev, start, frames, counts):
        x = lax.dynamic_slice_in_dim(_pack(xs, frames), start, self.rows, axis=1)
        new = attention_inputs(x, w, self.config)
        out = []
        for j, old in enumerate(zip(*prev)):  # q, k, v
            full = _pack(list(old), frames)
            out.append(_unpack(lax.dynamic_update_slice_in_dim(full, new[j], start, axis=1),
                               counts))
        return [tuple(parts) for parts in zip(*out)]

    def _rows_fn(self, w, xs, qkvs, start, frames, counts):
        x = _pack(xs, frames)
        q, k, v = (_pack([t[j] for t in qkvs], frames) for j in range(3))
        rows = lax.dynamic_slice_in_dim(x, start, self.rows, axis=1)
        qr = lax.dynamic_slice_in_dim(q, start, self.rows, axis=1)
        rows = block_rows(rows, qr, k, v, w, self.config)
        return _unpack(lax.dynamic_update_slice_in_dim(x, rows, start, axis=1), counts)

    def _finish_fn(self, scale, bias, projector: ProjectorWeights, frames, xs, counts):
        c = self.config
        x = layer_norm(_pack(xs, frames), scale, bias, c.norm_eps)
        feats = project(projector, x, c).astype(self.dtype)
        return [f.reshape(-1, f.shape[-1]) for f in _unpack(feats, counts)]
