"""The full-size SigLIP So400m tower + projector (Gemma 3 4B's: text width 2,560) on random
weights against transformers, and the encoder's speed replicated vs split over tp devices.

Not part of the test suite (a few minutes on 2 cores). Needs torch and transformers (not project
dependencies):

    python -m eval.check_vision_full [--images 1] [--tp 2] [--skip-reference]

Prints the features' max relative difference (max |ours - theirs| / max |theirs|, float32) and
images/s of `vision.encode` at tp=1 and split over --tp virtual CPU devices.
"""
from __future__ import annotations

import argparse
import time

import jax_platform


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    jax_platform.request_cpu_devices(max(1, args.tp))

    import jax
    import numpy as np

    from models.gemma3.projector import image_features, random_projector_weights
    from models.gemma3.vision import VISION_CONFIGS, random_vision_weights
    from models.gemma3.vision_checkpoint import VisionModel, hf_vision_tensors
    from models.gemma3.vision_sharding import encode_sharded, vision_mesh

    c = VISION_CONFIGS["so400m"]
    vm = VisionModel(c, random_vision_weights(c), random_projector_weights(c, args.d_model))
    rng = np.random.default_rng(0)
    pixels = rng.uniform(-1, 1, (args.images, c.image_size, c.image_size, 3)).astype(np.float32)

    fn = jax.jit(lambda v, p, x: image_features(v, p, x, c))
    t0 = time.perf_counter()
    ours = np.asarray(fn(vm.vision, vm.projector, pixels))
    print(f"tp=1 first call (compile + run): {time.perf_counter() - t0:.1f} s")
    best = min(_timed(lambda: fn(vm.vision, vm.projector, pixels).block_until_ready())
               for _ in range(args.repeats))
    print(f"tp=1 replicated: {best:.2f} s for {args.images} image(s), "
          f"{args.images / best:.3f} images/s")

    if args.tp > 1:
        mesh = vision_mesh(args.tp)
        encode_sharded(vm.vision, pixels, c, mesh).block_until_ready()
        best_tp = min(_timed(lambda: encode_sharded(vm.vision, pixels, c, mesh).block_until_ready())
                      for _ in range(args.repeats))
        print(f"tp={args.tp} split heads/MLP (encoder only, f32 all_reduce): {best_tp:.2f} s, "
              f"{args.images / best_tp:.3f} images/s")

    if args.skip_reference:
        return
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from models.gemma3.vision_checkpoint import vision_config_to_hf

    config = Gemma3Config(
        text_config=dict(vocab_size=16, hidden_size=args.d_model, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=8),
        vision_config=vision_config_to_hf(c), mm_tokens_per_image=c.tokens_per_image)
    model = Gemma3ForConditionalGeneration(config)
    model.model.vision_tower.config._attn_implementation = "eager"
    state = {k.replace("model.vision_tower.vision_model.", "model.vision_tower."): torch.from_numpy(
        np.ascontiguousarray(v)) for k, v in hf_vision_tensors(vm).items()}
    keep = {k for k in model.state_dict() if k.startswith(("model.vision_tower.",
                                                            "model.multi_modal_projector."))}
    missing = keep - set(state)
    if missing:
        raise SystemExit(f"names not written: {sorted(missing)[:3]}")
    model.load_state_dict({k: state[k] for k in keep}, strict=False, assign=True)
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        theirs = model.model.get_image_features(
            torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy()), return_dict=True
        ).pooler_output.numpy()
    print(f"transformers: {time.perf_counter() - t0:.1f} s")
    diff = np.max(np.abs(ours.astype(np.float64) - theirs)) / np.max(np.abs(theirs))
    print(f"features {ours.shape}: max relative difference vs transformers {diff:.2e}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
