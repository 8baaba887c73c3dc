"""Make tests/golden/gemma3_vision_tiny_hf.npz: transformers' Gemma3ForConditionalGeneration on a
tiny random multimodal config, the reference for the vision encoder, the projector, the merge of
image features into the prompt and (for the engine) the logits of prompts with images.

Needs torch and transformers, which are not dependencies of the project (tests do not import
them):

    pip install torch==2.13.0 transformers
    python tests/golden/make_vision_golden.py

Made with transformers 5.24.0, torch 2.13.0 (CPU), float32, eager attention; a few seconds.

The model: the text part is our "tiny" config (vocab 512, 3 layers, a global layer every 2nd,
window 8); the vision tower is our "tiny" VisionConfig (64 px images, 8 px patches, width 32,
2 blocks, 4 heads) pooled to 16 soft tokens an image. The image tokens, beyond a 512-token
vocabulary, are renumbered: <start_of_image> 500, <end_of_image> 501, soft token 502. Every
parameter is drawn from a seeded normal (norm scales included, which transformers initializes
to constants).

Output keys (numpy .npz, no pickles):
  config                  str      the config.json transformers writes (save_pretrained)
  w:{name}                float32  every tensor of the state dict, Hugging Face names
  ids_{k}                 int32 [T]           prompt k (k = 0..3: 0, 1, 2 images, and 3 images
                                              standing for one image with two pan-and-scan crops)
  pixels_{k}              float32 [n, 64, 64, 3]   its images, normalized, channels last
  features_{k}            float32 [n, 16, 64]      get_image_features (after the projector)
  hidden_{k}              float32 [n, 64, 32]      the vision tower's last hidden state
  embeds_{k}              float32 [T, 64]          the merged input embeddings
  logits_{k}              float32 [T, 512]         forward with token_type_ids (bidirectional
                                                   attention within each image's soft tokens)
  greedy_{k}              int32 [32]               greedy continuation, a full forward per step
  pre_src_{j}             uint8 [h, w, c]          source images for the preprocessing check
  pre_mode_{j}            str                      their PIL mode
  pre_out_{j}             float32 [1 + crops, 32, 32, 3]  Gemma3ImageProcessorPil at 32 px,
                                                   pan-and-scan with 16 px minimum crops
  versions                str
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import Gemma3Config, Gemma3ForConditionalGeneration  # noqa: E402

from models.gemma3.config import get_config  # noqa: E402
from models.gemma3.hf_checkpoint import config_to_hf  # noqa: E402
from models.gemma3.vision import VISION_CONFIGS  # noqa: E402

OUT = Path(__file__).resolve().parent / "gemma3_vision_tiny_hf.npz"
BOI, EOI, SOFT = 500, 501, 502
GREEDY_STEPS = 32


def hf_config() -> Gemma3Config:
    text = config_to_hf(get_config("tiny"), np.float32)
    text = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")}
    v = VISION_CONFIGS["tiny"]
    vision = dict(model_type="siglip_vision_model", hidden_size=v.width, image_size=v.image_size,
                  patch_size=v.patch_size, intermediate_size=v.mlp_hidden,
                  num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads,
                  layer_norm_eps=v.norm_eps, vision_use_head=False,
                  hidden_act="gelu_pytorch_tanh", num_channels=3)
    return Gemma3Config(text_config=text, vision_config=vision,
                        mm_tokens_per_image=v.tokens_per_image, boi_token_index=BOI,
                        eoi_token_index=EOI, image_token_index=SOFT)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if "layer_norm" in name or "layernorm" in name:
            x = (1.0 if name.endswith("weight") else 0.0) + 0.1 * rng.standard_normal(shape)
        elif p.ndim == 1 or name.endswith(("bias",)):
            x = 0.1 * rng.standard_normal(shape)  # Gemma RMS norms (1 + w) and biases
        elif name.endswith("mm_input_projection_weight"):
            x = rng.standard_normal(shape) / np.sqrt(shape[0])
        elif name.endswith("embed_tokens.weight") or name.endswith("position_embedding.weight"):
            x = 0.5 * rng.standard_normal(shape)
        else:  # torch layouts: [out, in, ...]
            x = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.asarray(x, np.float32)))


def image_block(n: int) -> list[int]:
    return [108, BOI, *[SOFT] * n, EOI, 108]


def prompts(tokens_per_image: int) -> list[list[int]]:
    block = image_block(tokens_per_image)
    return [
        [2, 17, 23, 99, 104, 7, 300, 45, 12],
        [2, 105, 30, 31, *block, 40, 41, 42, 106],
        [2, 105, 50, *block, 51, 52, *block, 53, 106],
        [2, 105, 60, 61, *block, 62, 63, 64, *block, 65, *block, 106],
    ]


def forward(model, ids, pixels):
    input_ids = torch.tensor([ids])
    kwargs = dict(input_ids=input_ids, token_type_ids=(input_ids == SOFT).long())
    if pixels is not None:
        kwargs["pixel_values"] = torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy())
    return model(**kwargs).logits[0]


def preprocessing_references(out: dict) -> None:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    rng = np.random.default_rng(7)
    sources = [
        ("RGB", rng.integers(0, 256, (40, 100, 3), dtype=np.uint8)),  # wide: 2 crops
        ("RGBA", rng.integers(0, 256, (90, 30, 4), dtype=np.uint8)),  # tall: 3 crops, alpha
        ("L", rng.integers(0, 256, (50, 50), dtype=np.uint8)),  # square: none
        ("P", rng.integers(0, 16, (35, 45), dtype=np.uint8)),
    ]
    proc = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                   image_std=[0.5] * 3, rescale_factor=1 / 255)
    for j, (mode, arr) in enumerate(sources):
        img = Image.fromarray(arr, mode)
        if mode == "P":
            img.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tolist())
        res = proc(images=[img], do_pan_and_scan=True, pan_and_scan_min_crop_size=16,
                   pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2,
                   return_tensors="np")
        out[f"pre_src_{j}"] = arr
        out[f"pre_mode_{j}"] = np.array(mode)
        if mode == "P":
            out[f"pre_palette_{j}"] = np.asarray(img.getpalette(), np.uint8)
        out[f"pre_out_{j}"] = np.asarray(res["pixel_values"], np.float32).transpose(0, 2, 3, 1)


def main() -> None:
    torch.manual_seed(0)
    config = hf_config()
    model = Gemma3ForConditionalGeneration(config).eval()
    model.config._attn_implementation = "eager"
    for sub in (model.model.vision_tower, model.model.language_model):
        sub.config._attn_implementation = "eager"
    randomize(model)
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        out["config"] = np.array((Path(tmp) / "config.json").read_text())
    for name, t in model.state_dict().items():
        if name != "lm_head.weight":  # tied to embed_tokens
            out[f"w:{name}"] = t.detach().numpy().astype(np.float32)
    v = VISION_CONFIGS["tiny"]
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for k, ids in enumerate(prompts(v.tokens_per_image)):
            n = ids.count(BOI)
            pixels = (rng.uniform(-1, 1, (n, v.image_size, v.image_size, 3)).astype(np.float32)
                      if n else None)
            out[f"ids_{k}"] = np.asarray(ids, np.int32)
            input_ids = torch.tensor([ids])
            emb = model.model.get_input_embeddings()(input_ids)[0]
            if n:
                out[f"pixels_{k}"] = pixels
                px = torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy())
                feats = model.model.get_image_features(px, return_dict=True)
                out[f"features_{k}"] = feats.pooler_output.numpy()
                out[f"hidden_{k}"] = feats.last_hidden_state.numpy()
                mask = (input_ids[0] == SOFT)[:, None].expand_as(emb)
                emb = emb.masked_scatter(mask, feats.pooler_output.reshape(-1, emb.shape[-1]))
            out[f"embeds_{k}"] = emb.numpy()
            out[f"logits_{k}"] = forward(model, ids, pixels).numpy()
            seq, greedy = list(ids), []
            for _ in range(GREEDY_STEPS):
                nxt = int(forward(model, seq, pixels)[-1].argmax())
                greedy.append(nxt)
                seq.append(nxt)
            out[f"greedy_{k}"] = np.asarray(greedy, np.int32)
    preprocessing_references(out)
    out["versions"] = np.array(json.dumps({"transformers": transformers.__version__,
                                           "torch": torch.__version__}))
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
