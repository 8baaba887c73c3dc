"""Make tests/golden/tiny_pattern_hf.npz: transformers as the reference for a Gemma 3 whose layers
are arranged otherwise than the published sizes' 5 local : 1 global. Run once; the small output is
committed.

The model is small and random: 5 layers with a global layer every 3rd (local, local, global,
local, local), a sliding window of 8 (shorter than the prompts, so local and global layers see
different keys), linear RoPE scaling 8 on the global layers. It is written by this project's
Hugging Face writer (config.json with `sliding_window_pattern` 3 and `layer_types`), read by
transformers' `Gemma3ForCausalLM`, and transformers' float32 logits are stored with the
checkpoint's tensors, so the test needs no random number generator, torch or transformers.

    pip install torch==2.13.0 transformers accelerate
    python tests/golden/make_pattern_golden.py

Output keys (numpy .npz, no pickles):
  config            str                  the checkpoint's config.json
  w/<name>          float32              the checkpoint's tensors, by their Hugging Face names
  tokens_{i}        int32 [T]            a prompt (BOS, then random ids)
  logits_{i}        float32 [T, V]       transformers' logits at every position
  versions          str                  transformers and torch versions
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
from transformers import Gemma3ForCausalLM  # noqa: E402

from equarx import AllReduceConfig  # noqa: E402
from models.gemma3 import load_model  # noqa: E402
from models.gemma3.hf_checkpoint import SafetensorsDir  # noqa: E402

OUT = Path(__file__).resolve().parent / "tiny_pattern_hf.npz"
SPEC = "random:tiny?d=32&ffn=64&layers=5&global_every=3"
LENGTHS = (24, 13)


@torch.no_grad()
def main() -> None:
    ours = load_model(SPEC, tp=1, dtype="float32", allreduce=AllReduceConfig("f32"), seed=3)
    rng = np.random.default_rng(0)
    prompts = [[2] + rng.integers(4, ours.config.vocab_size, n - 1).tolist() for n in LENGTHS]
    out = {"versions": f"transformers {transformers.__version__}, torch {torch.__version__}"}
    with tempfile.TemporaryDirectory() as d:
        ours.save(d, format="hf", dtype="float32")
        config = json.loads((Path(d) / "config.json").read_text())
        assert config["sliding_window_pattern"] == 3, config
        files = SafetensorsDir(d)
        out["config"] = json.dumps(config)
        out.update({f"w/{name}": np.asarray(files.tensor(name), np.float32) for name in files.where})
        model = Gemma3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        print("transformers' layer types:", model.config.layer_types)
    mine = ours.score(prompts)
    for i, ids in enumerate(prompts):
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
        out[f"tokens_{i}"] = np.array(ids, np.int32)
        out[f"logits_{i}"] = logits.astype(np.float32)
        diff = np.abs(mine[i, :len(ids)] - logits).max() / np.abs(logits).max()
        print(f"prompt {i} ({len(ids)} tokens): ours vs transformers, max |diff| / max |logit| "
              f"= {diff:.2e}")
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes), {out['versions']}")


if __name__ == "__main__":
    main()
