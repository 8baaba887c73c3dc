"""The official `gemma` library's vision encoder as a second reference for ours, on random weights.

The official modules run as published: `gemma/multimodal/vision_utils.py` (ViTModel, the SigLIP
tower) and `gemma/multimodal/vision.py`'s VisionExit (the 4x4 average pooling), read from the
`gemma` wheel, then the embedder's `encode_vision` (RMSNorm with 1 + scale, then
`...tm,md->...td`). The whole `gemma` package does not install beside this project's pins
(its dependency resolution over TensorFlow / kauldron does not finish here), so the two files run
in a plain Flax environment with `kauldron.typing` (used only for shape annotations) stubbed.

Two steps, two environments:

    # 1. this project's venv: random weights -> the official tree, pixels, our features
    python tests/golden/official_vision_check.py export --config tiny vision_case.npz
    # 2. python 3.12 with flax and einops (pip install flax einops), and the gemma wheel unzipped
    #    (pip download --no-deps gemma; unzip gemma-*.whl -d gemma_src):
    python tests/golden/official_vision_check.py run vision_case.npz --gemma-src gemma_src

Step 2 prints the max relative difference of the features (after the projector).
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import numpy as np


def export(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import jax_platform

    jax_platform.request_cpu_devices(1)
    from models.gemma3.projector import image_features, random_projector_weights
    from models.gemma3.vision import VISION_CONFIGS, random_vision_weights
    from models.gemma3.vision_checkpoint import VisionModel, vision_to_official

    c = VISION_CONFIGS[args.config]
    vm = VisionModel(c, random_vision_weights(c, seed=3), random_projector_weights(c, args.d_model))
    pixels = np.random.default_rng(4).uniform(
        -1, 1, (args.images, c.image_size, c.image_size, 3)).astype(np.float32)
    ours = np.asarray(image_features(vm.vision, vm.projector, pixels, c))
    flat = {}

    def walk(prefix, node):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}/", v)
            else:
                flat[f"p:{prefix}{k}"] = np.asarray(v)

    walk("", vision_to_official(vm))
    sizes = np.array([c.patch_size, c.width, c.num_layers, c.mlp_hidden, c.num_heads,
                      c.image_size, c.tokens_per_image])
    np.savez(args.path, pixels=pixels, ours=ours, sizes=sizes, **flat)
    print(f"wrote {args.path}: {c.name}, features {ours.shape}")


def run(args) -> None:
    import importlib.util

    import jax
    import jax.numpy as jnp

    kauldron = types.ModuleType("kauldron")
    ktyping = types.ModuleType("kauldron.typing")

    class _Shape:
        def __getitem__(self, _):
            return jax.Array

    for name in ("Float", "Int", "Bool", "UInt8"):
        setattr(ktyping, name, _Shape())
    ktyping.typechecked = lambda f: f
    kauldron.typing = ktyping
    sys.modules.update({"kauldron": kauldron, "kauldron.typing": ktyping})

    src = Path(args.gemma_src) / "gemma" / "multimodal" / "vision_utils.py"
    spec = importlib.util.spec_from_file_location("official_vision_utils", src)
    vu = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = vu  # flax dataclasses look their module up
    spec.loader.exec_module(vu)

    z = np.load(args.path)
    patch, width, depth, mlp, heads, image_size, tokens = (int(x) for x in z["sizes"])
    tree: dict = {}
    for key in z.files:
        if key.startswith("p:"):
            node = tree
            *parts, last = key[2:].split("/")
            for p in parts:
                node = node.setdefault(p, {})
            node[last] = jnp.asarray(z[key])
    vit = vu.ViTModel(patch_size=(patch, patch), width=width, depth=depth, mlp_dim=mlp,
                      num_heads=heads)
    hidden = vit.apply({"params": tree["vision_encoder"]["siglip_encoder"]},
                       jnp.asarray(z["pixels"]))
    # VisionExit (gemma/multimodal/vision.py): avg_pool over (h, w) windows to `tokens`.
    side, out_side = int(hidden.shape[1] ** 0.5), int(tokens ** 0.5)
    window = side // out_side
    import flax.linen as nn

    grid = hidden.reshape(hidden.shape[0], side, side, -1)
    pooled = nn.avg_pool(grid, (window, window), strides=(window, window))
    pooled = pooled.reshape(hidden.shape[0], tokens, -1)
    # Embedder.encode_vision: _layers.RMSNorm (1 + scale, eps 1e-6), then the einsum.
    emb = tree["embedder"]
    var = jnp.mean(jnp.square(pooled), axis=-1, keepdims=True)
    normed = pooled * jax.lax.rsqrt(var + 1e-6) * (1 + emb["mm_soft_embedding_norm"]["scale"])
    theirs = np.asarray(jnp.einsum("...tm,md->...td", normed, emb["mm_input_projection"]["w"]))
    ours = z["ours"]
    diff = np.max(np.abs(ours.astype(np.float64) - theirs)) / np.max(np.abs(theirs))
    print(f"features {theirs.shape}: max relative difference ours vs official {diff:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    e = sub.add_parser("export")
    e.add_argument("path")
    e.add_argument("--config", default="tiny", choices=["tiny", "so400m"])
    e.add_argument("--images", type=int, default=2)
    e.add_argument("--d-model", type=int, default=64)
    r = sub.add_parser("run")
    r.add_argument("path")
    r.add_argument("--gemma-src", required=True)
    args = ap.parse_args()
    (export if args.step == "export" else run)(args)


if __name__ == "__main__":
    main()
