"""The vision half of Gemma 3 checkpoints: SigLIP tower + projector, from and to Hugging Face
`Gemma3ForConditionalGeneration` safetensors and the official `gemma` parameter tree (nested
under `vision_encoder/siglip_encoder` and `embedder`, or flat `SigLiPFromPatches_0/...`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from models.gemma3.hf_checkpoint import (CONFIG_FILE, MULTIMODAL_TEXT_PREFIX, HFCheckpointError,
                                         HFLayout, config_to_hf, hf_layout, hf_tensors,
                                         write_safetensors)
from models.gemma3.multimodal import END_OF_IMAGE_ID, IMAGE_SOFT_TOKEN_ID, START_OF_IMAGE_ID
from models.gemma3.projector import ProjectorWeights
from models.gemma3.vision import VisionConfig, VisionLayerWeights, VisionWeights, map_vision_weights
from models.gemma3.weights import lookup

# The tower's and the projector's tensor names below their modules (SiglipVisionTransformer,
# Gemma3MultiModalProjector), and their prefixes in the layout the published checkpoints have,
# which transformers 4.50-5.x all load (`hf_checkpoint.hf_layout` finds any other).
_TOWER_NAMES = {"patch_embed": ("embeddings.patch_embedding.weight",),
                "patch_bias": ("embeddings.patch_embedding.bias",),
                "pos_embed": ("embeddings.position_embedding.weight",),
                "final_norm_scale": ("post_layernorm.weight",),
                "final_norm_bias": ("post_layernorm.bias",)}
_TOWER_LAYER_NAMES = {
    "ln1_scale": ("layer_norm1.weight",), "ln1_bias": ("layer_norm1.bias",),
    "ln2_scale": ("layer_norm2.weight",), "ln2_bias": ("layer_norm2.bias",),
    "qkv": tuple(f"self_attn.{x}_proj.weight" for x in "qkv"),
    "qkv_bias": tuple(f"self_attn.{x}_proj.bias" for x in "qkv"),
    "o": ("self_attn.out_proj.weight",), "o_bias": ("self_attn.out_proj.bias",),
    "fc1": ("mlp.fc1.weight",), "fc1_bias": ("mlp.fc1.bias",),
    "fc2": ("mlp.fc2.weight",), "fc2_bias": ("mlp.fc2.bias",)}
PROJECTOR_TENSOR_NAMES = ("mm_input_projection_weight", "mm_soft_emb_norm.weight")
TOWER_PREFIX, PROJECTOR_PREFIX = "vision_tower.vision_model.", "multi_modal_projector."


def tower_tensor_names(num_layers: int) -> list[str]:
    """The tower's tensor names below its prefix, as transformers names them."""
    names = [n for group in _TOWER_NAMES.values() for n in group]
    for i in range(num_layers):
        names += [f"encoder.layers.{i}.{n}" for group in _TOWER_LAYER_NAMES.values()
                  for n in group]
    return names


@dataclasses.dataclass(frozen=True)
class ImageTokenIds:
    start: int = START_OF_IMAGE_ID
    end: int = END_OF_IMAGE_ID
    soft: int = IMAGE_SOFT_TOKEN_ID


@dataclasses.dataclass(frozen=True)
class VisionModel:
    """What a multimodal checkpoint adds to the text model. Arrays are host numpy arrays; the
    engine places them (replicated, docs/vision.md says why)."""

    config: VisionConfig
    vision: VisionWeights
    projector: ProjectorWeights
    tokens: ImageTokenIds = ImageTokenIds()


# ---------------------------------------------------------------------------------------------
# config.json


def vision_config_from_hf(raw: dict) -> VisionConfig | None:
    """The VisionConfig of a Gemma3ForConditionalGeneration config.json; None for a text-only one."""
    v = raw.get("vision_config")
    if not v:
        return None
    if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise HFCheckpointError(f"vision_config.model_type {v.get('model_type')!r}: only SigLIP")
    if v.get("vision_use_head"):
        raise HFCheckpointError("vision_use_head=True: Gemma 3 uses no pooling head")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise HFCheckpointError(f"vision hidden_act {act!r}: Gemma 3's tower uses gelu_pytorch_tanh")
    d = VisionConfig(name="so400m")  # SiglipVisionConfig's defaults differ; Gemma 3's are these
    return VisionConfig(
        name="siglip", image_size=int(v.get("image_size", d.image_size)),
        patch_size=int(v.get("patch_size", d.patch_size)), width=int(v.get("hidden_size", d.width)),
        num_layers=int(v.get("num_hidden_layers", d.num_layers)),
        num_heads=int(v.get("num_attention_heads", d.num_heads)),
        mlp_hidden=int(v.get("intermediate_size", d.mlp_hidden)),
        channels=int(v.get("num_channels", 3)), norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        tokens_per_image=int(raw.get("mm_tokens_per_image", 256)))


def token_ids_from_hf(raw: dict) -> ImageTokenIds:
    return ImageTokenIds(start=int(raw.get("boi_token_index", START_OF_IMAGE_ID)),
                         end=int(raw.get("eoi_token_index", END_OF_IMAGE_ID)),
                         soft=int(raw.get("image_token_index", raw.get("image_token_id",
                                                                         IMAGE_SOFT_TOKEN_ID))))


def vision_config_to_hf(c: VisionConfig) -> dict:
    return {"model_type": "siglip_vision_model", "hidden_size": c.width,
            "image_size": c.image_size, "patch_size": c.patch_size,
            "intermediate_size": c.mlp_hidden, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_channels": c.channels,
            "layer_norm_eps": c.norm_eps, "vision_use_head": False,
            "hidden_act": "gelu_pytorch_tanh", "attention_dropout": 0.0}


# ---------------------------------------------------------------------------------------------
# Hugging Face


def has_hf_vision(path: str | os.PathLike) -> bool:
    raw = json.loads((Path(path) / CONFIG_FILE).read_text())
    return vision_config_from_hf(raw) is not None


def load_hf_vision(path: str | os.PathLike, dtype=np.float32,
                   layout: HFLayout | None = None) -> VisionModel | None:
    """The vision tower and projector of a checkpoint directory, or None when it is text-only
    (no vision_config). Raises HFCheckpointError for missing or misshapen tensors
    (`hf_checkpoint.hf_layout` finds them, under whatever prefix they are stored)."""
    if layout is None and not has_hf_vision(path):
        return None
    layout = layout or hf_layout(path)
    c = vision_config_from_hf(layout.raw)
    if c is None:
        return None
    files, dt = layout.files, np.dtype(dtype)

    def t(name: str) -> np.ndarray:
        return np.asarray(files.tensor(name), dt)

    W, N, H = c.width, c.num_heads, c.head_dim

    def make(layer, name, shape):
        if layer is None:
            (x,) = (t(layout.tower + n) for n in _TOWER_NAMES[name])
            if name == "patch_embed":  # torch Conv2d [W, C, P, P] -> [P*P*C, W]
                x = x.transpose(2, 3, 1, 0).reshape(c.patch_dim, W)
        else:
            parts = [t(f"{layout.tower}encoder.layers.{layer}.{n}")
                     for n in _TOWER_LAYER_NAMES[name]]
            x = {"qkv": lambda: np.stack([p.T.reshape(W, N, H) for p in parts], axis=1),
                 "qkv_bias": lambda: np.stack([p.reshape(N, H) for p in parts]),
                 "o": lambda: parts[0].T.reshape(N, H, W),
                 "fc1": lambda: parts[0].T, "fc2": lambda: parts[0].T}.get(name, lambda: parts[0])()
        if x.shape != tuple(shape):
            raise HFCheckpointError(f"{path}: vision {name} (layer {layer}) has shape {x.shape}, "
                                    f"vision_config implies {tuple(shape)}")
        return np.ascontiguousarray(x)

    try:
        vision = map_vision_weights(c, make)
    except ValueError as e:  # a stored shape that does not even reshape
        if isinstance(e, HFCheckpointError):
            raise
        raise HFCheckpointError(f"{path}: vision tower tensors do not fit vision_config: {e}") from None
    proj, norm = (t(layout.projector + n) for n in PROJECTOR_TENSOR_NAMES)
    if proj.shape[0] != c.width or norm.shape != (c.width,):
        raise HFCheckpointError(f"{path}: projector shapes {proj.shape}, {norm.shape} do not match "
                                f"vision width {c.width}")
    return VisionModel(c, vision, ProjectorWeights(norm=norm, proj=proj),
                       token_ids_from_hf(layout.raw))


def hf_vision_tensors(vm: VisionModel) -> dict[str, np.ndarray]:
    """Hugging Face name -> tensor (torch layouts) of the tower and projector, named as the
    published checkpoints name them (`vision_tower.vision_model.`, `multi_modal_projector.`)."""
    c, v = vm.config, vm.vision
    W, P = c.width, c.patch_size
    host = lambda x: np.asarray(x)  # noqa: E731
    vp = TOWER_PREFIX
    out = {vp + "embeddings.patch_embedding.weight":
           host(v.patch_embed).reshape(P, P, c.channels, W).transpose(3, 2, 0, 1),
           vp + "embeddings.patch_embedding.bias": host(v.patch_bias),
           vp + "embeddings.position_embedding.weight": host(v.pos_embed)}
    for i, lw in enumerate(v.layers):
        p = f"{vp}encoder.layers.{i}."
        out[p + "layer_norm1.weight"], out[p + "layer_norm1.bias"] = host(lw.ln1_scale), host(lw.ln1_bias)
        out[p + "layer_norm2.weight"], out[p + "layer_norm2.bias"] = host(lw.ln2_scale), host(lw.ln2_bias)
        for j, x in enumerate("qkv"):
            out[p + f"self_attn.{x}_proj.weight"] = host(lw.qkv)[:, j].reshape(W, W).T
            out[p + f"self_attn.{x}_proj.bias"] = host(lw.qkv_bias)[j].reshape(W)
        out[p + "self_attn.out_proj.weight"] = host(lw.o).reshape(W, W).T
        out[p + "self_attn.out_proj.bias"] = host(lw.o_bias)
        out[p + "mlp.fc1.weight"], out[p + "mlp.fc1.bias"] = host(lw.fc1).T, host(lw.fc1_bias)
        out[p + "mlp.fc2.weight"], out[p + "mlp.fc2.bias"] = host(lw.fc2).T, host(lw.fc2_bias)
    out[vp + "post_layernorm.weight"] = host(v.final_norm_scale)
    out[vp + "post_layernorm.bias"] = host(v.final_norm_bias)
    proj, norm = PROJECTOR_TENSOR_NAMES
    out[PROJECTOR_PREFIX + proj] = host(vm.projector.proj)
    out[PROJECTOR_PREFIX + norm] = host(vm.projector.norm)
    return out


def save_hf_multimodal(path: str | os.PathLike, weights, text_config, vm: VisionModel,
                       dtype=np.float32) -> None:
    """A Gemma3ForConditionalGeneration directory (one safetensors file, config.json) from our
    text Weights and a VisionModel, in the published checkpoints' layout
    (`language_model.model.`, `vision_tower.vision_model.`, `multi_modal_projector.`), which
    transformers 4.50 holds as it is and 4.52-5.x map to their modules when they load it. The
    text embedding keeps the rows it has (a text-only 262,144-row table stays so;
    transformers then needs `image_token_index` inside it)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dt = np.dtype(dtype)
    text = hf_tensors(weights, text_config, prefix=MULTIMODAL_TEXT_PREFIX)
    vis = hf_vision_tensors(vm)
    shapes = {k: (s, dt) for k, (s, _) in text.items()}
    shapes.update({k: (x.shape, dt) for k, x in vis.items()})
    write_safetensors(path / "model.safetensors", shapes=shapes,
                      produce=lambda k: text[k][1]() if k in text else vis[k],
                      metadata={"format": "pt"})
    tc = config_to_hf(text_config, dt)
    tc = {k: v for k, v in tc.items() if k not in ("architectures", "torch_dtype")}
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": tc, "vision_config": vision_config_to_hf(vm.config),
              "mm_tokens_per_image": vm.config.tokens_per_image,
              "boi_token_index": vm.tokens.start, "eoi_token_index": vm.tokens.end,
              "image_token_index": vm.tokens.soft, "tie_word_embeddings": True,
              "torch_dtype": dt.name}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------------------------------------
# The official tree

_OFFICIAL_LAYER = {
    "ln1_scale": ("LayerNorm_0", "scale"), "ln1_bias": ("LayerNorm_0", "bias"),
    "ln2_scale": ("LayerNorm_1", "scale"), "ln2_bias": ("LayerNorm_1", "bias"),
    "o": ("MultiHeadDotProductAttention_0", "out", "kernel"),
    "o_bias": ("MultiHeadDotProductAttention_0", "out", "bias"),
    "fc1": ("MlpBlock_0", "Dense_0", "kernel"), "fc1_bias": ("MlpBlock_0", "Dense_0", "bias"),
    "fc2": ("MlpBlock_0", "Dense_1", "kernel"), "fc2_bias": ("MlpBlock_0", "Dense_1", "bias"),
}
_QKV = ("query", "key", "value")


def _get(tree: dict, path: tuple[str, ...]) -> np.ndarray:
    return np.asarray(lookup(tree, path))


def _nest(tree: dict) -> dict:
    """Nested dicts from a tree whose keys may hold "/"-joined paths."""
    out: dict = {}
    for key, value in tree.items():
        parts = [p for p in str(key).split("/") if p]
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = _nest(value) if isinstance(value, dict) else value
    return out


def vision_from_official(tree: dict, c: VisionConfig) -> VisionModel | None:
    """The tower and projector from an official parameter tree (nested with `vision_encoder`,
    or flat with `SigLiPFromPatches_0/...` and `transformer/embedder/...` keys); None when the
    tree has no vision encoder."""
    tree = _nest(tree.get("params", tree) if len(tree) == 1 else tree)
    enc = tree.get("vision_encoder") or tree.get("SigLiPFromPatches_0")
    if enc is None:
        return None
    enc = enc["siglip_encoder"]
    embedder = (tree.get("embedder") or tree.get("transformer", {}).get("embedder") or {})
    blocks = enc["Transformer"]

    def make(layer, name, shape):
        if layer is None:
            x = {"patch_embed": lambda: _get(enc, ("embedding", "kernel")).reshape(shape),
                 "patch_bias": lambda: _get(enc, ("embedding", "bias")),
                 "pos_embed": lambda: _get(enc, ("pos_embedding",)).reshape(shape),
                 "final_norm_scale": lambda: _get(blocks, ("encoder_norm", "scale")),
                 "final_norm_bias": lambda: _get(blocks, ("encoder_norm", "bias"))}[name]()
        else:
            b = blocks[f"encoderblock_{layer}"]
            att = ("MultiHeadDotProductAttention_0",)
            if name == "qkv":
                x = np.stack([_get(b, (*att, q, "kernel")) for q in _QKV], axis=1)
            elif name == "qkv_bias":
                x = np.stack([_get(b, (*att, q, "bias")) for q in _QKV])
            else:
                x = _get(b, _OFFICIAL_LAYER[name])
        if x.shape != tuple(shape):
            raise ValueError(f"official vision {name} (layer {layer}) has shape {x.shape}, "
                             f"expected {tuple(shape)}")
        return x

    vision = map_vision_weights(c, make)
    projector = ProjectorWeights(norm=_get(embedder, ("mm_soft_embedding_norm", "scale")),
                                 proj=_get(embedder, ("mm_input_projection", "w")))
    return VisionModel(c, vision, projector)


def vision_config_from_official(tree: dict) -> VisionConfig | None:
    """The tower's sizes from an official tree's shapes (None without a vision encoder).
    Official checkpoints carry no config: the pooled token count is that of the known tower
    with these shapes (256 for So400m), else 256 when the patch grid pools to it evenly."""
    from models.gemma3.vision import VISION_CONFIGS

    tree = _nest(tree.get("params", tree) if len(tree) == 1 else tree)
    enc = tree.get("vision_encoder") or tree.get("SigLiPFromPatches_0")
    if enc is None:
        return None
    enc = enc["siglip_encoder"]
    blocks = enc["Transformer"]
    P, _, C, W = np.shape(_get(enc, ("embedding", "kernel")))
    L = np.shape(_get(enc, ("pos_embedding",)))[-2]
    att = ("encoderblock_0", "MultiHeadDotProductAttention_0")
    N = np.shape(_get(blocks, (*att, "query", "kernel")))[1]
    F = np.shape(_get(blocks, ("encoderblock_0", "MlpBlock_0", "Dense_0", "kernel")))[1]
    layers = sum(1 for k in blocks if str(k).startswith("encoderblock_"))
    side = round(L ** 0.5)
    sizes = dict(image_size=side * int(P), patch_size=int(P), width=int(W), num_layers=layers,
                 num_heads=int(N), mlp_hidden=int(F), channels=int(C))
    for known in VISION_CONFIGS.values():
        if all(getattr(known, k) == v for k, v in sizes.items()):
            return known.replace(name="siglip")
    return VisionConfig(name="siglip", **sizes, tokens_per_image=256 if side % 16 == 0 else side * side)


def official_token_ids(vocab_size: int) -> ImageTokenIds:
    """The image token ids of an official checkpoint: the Gemma 3 tokenizer's, or for a
    vocabulary too small to hold them (test models) its last rows, as random towers take."""
    if vocab_size > IMAGE_SOFT_TOKEN_ID:
        return ImageTokenIds()
    return ImageTokenIds(start=vocab_size - 12, end=vocab_size - 11, soft=vocab_size - 10)


def load_official_vision(tree: dict, vocab_size: int) -> VisionModel | None:
    """The tower and projector of an official tree (None when it has no vision encoder)."""
    c = vision_config_from_official(tree)
    if c is None:
        return None
    return dataclasses.replace(vision_from_official(tree, c), tokens=official_token_ids(vocab_size))


def vision_to_official(vm: VisionModel) -> dict:
    """{"vision_encoder": {...}, "embedder": {mm_* only}}: merge into the text model's tree."""
    c, v = vm.config, vm.vision
    P = c.patch_size
    blocks: dict = {}
    for i, lw in enumerate(v.layers):
        b: dict = {}
        att = b.setdefault("MultiHeadDotProductAttention_0", {})
        for j, q in enumerate(_QKV):
            att[q] = {"kernel": np.asarray(lw.qkv)[:, j], "bias": np.asarray(lw.qkv_bias)[j]}
        for name, path in _OFFICIAL_LAYER.items():
            node = b
            for p in path[:-1]:
                node = node.setdefault(p, {})
            node[path[-1]] = np.asarray(getattr(lw, name))
        blocks[f"encoderblock_{i}"] = b
    blocks["encoder_norm"] = {"scale": np.asarray(v.final_norm_scale),
                              "bias": np.asarray(v.final_norm_bias)}
    enc = {"embedding": {"kernel": np.asarray(v.patch_embed).reshape(P, P, c.channels, c.width),
                         "bias": np.asarray(v.patch_bias)},
           "pos_embedding": np.asarray(v.pos_embed)[None], "Transformer": blocks}
    return {"vision_encoder": {"siglip_encoder": enc},
            "embedder": {"mm_soft_embedding_norm": {"scale": np.asarray(vm.projector.norm)},
                         "mm_input_projection": {"w": np.asarray(vm.projector.proj)}}}


__all__ = ["ImageTokenIds", "VisionModel", "VisionLayerWeights", "has_hf_vision",
           "load_hf_vision", "tower_tensor_names", "PROJECTOR_TENSOR_NAMES", "save_hf_multimodal", "hf_vision_tensors", "vision_config_from_hf",
           "vision_config_to_hf", "token_ids_from_hf", "vision_from_official", "vision_to_official",
           "vision_config_from_official", "official_token_ids", "load_official_vision"]
