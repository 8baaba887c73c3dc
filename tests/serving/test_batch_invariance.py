"""Batch invariance on the real engine over tiny random models (window 8, so that prompts
overflow the sliding window), and the model's own chunked prefill.

- Deterministic mode: a greedy request alone and among concurrent different requests gives the
  same tokens and bit-identical logprobs, at tp=1 and tp=2 with the exact and the token-local
  AllReduces, float32 and bfloat16.
- Chunked prefill (model programs over a slot cache, which `eval/check_long_context.py` runs):
  a prompt prefilled in chunks, shorter or longer than the window, leaves the cache and the last
  logits that one prefill of the whole prompt leaves.

`reference` is the engines' independent answer: the model's own greedy generation (one prefill,
then decode steps over a dense cache) scored by a forward pass over the whole text.
"""

import jax
import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import load_model
from serving.paged_runner import PagedRunner
from serving.sampling import SamplingParams
from testkit import finish_all, running_core

TINY = "random:tiny"  # 3 layers (the middle one global), window 8, 2 KV heads, vocabulary 512
_models: dict = {}


def model(tp=1, dtype="float32", allreduce="f32"):
    key = (tp, dtype, allreduce)
    if key not in _models:
        _models[key] = load_model(TINY, tp=tp, dtype=dtype, allreduce=AllReduceConfig.from_label(allreduce))
    return _models[key]


def prompt(n, seed):
    rng = np.random.default_rng(seed)
    return [2] + rng.integers(4, 512, n - 1).tolist()


def generate(engine, prompts, max_tokens=6, core=None):
    """Greedy tokens and their logprobs for each prompt, all submitted at once (through `core`
    when given, else a core of its own)."""
    with running_core(engine, core) as c:
        outs = finish_all(c, [(p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True, logprobs=0)) for p in prompts])
    for o in outs:
        assert o.finish == "length", o.error
    return [[(t.id, t.logprob) for t in o.tokens] for o in outs]


def log_softmax(logits):
    return np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1))


def reference(m, prompts, max_tokens=6):
    """What `generate` should give, from the model alone: its greedy tokens (`generate`), each
    with its logprob from a forward pass over the prompt and the tokens before it (`score`)."""
    new = m.generate(prompts, max_tokens)
    lps = log_softmax(m.score([p + t for p, t in zip(prompts, new)]))
    return [[(tok, float(lps[i, len(p) - 1 + j, tok])) for j, tok in enumerate(t)]
            for i, (p, t) in enumerate(zip(prompts, new))]


def paged(m, **kw):
    args = dict(max_num_seqs=4, max_seq_len=96, page_size=4, long_prefill_token_threshold=8)
    args.update(kw)
    return PagedRunner(m, **args)


# ---- deterministic (batch-invariant) mode ----

# (tp, dtype, AllReduce): tp=1, and tp=2 with the exact psums and both token-local modes.
CONFIGS = [(1, "bfloat16", "f32"), (2, "float32", "f32"), (2, "bfloat16", "bf16"),
           (2, "bfloat16", "bf16_ring"), (2, "float32", "int8"), (2, "bfloat16", "int8")]


@pytest.mark.parametrize("tp,dtype,allreduce", CONFIGS)
def test_a_request_alone_equals_it_among_others(tp, dtype, allreduce):
    engine = paged(model(tp, dtype, allreduce), deterministic=True)
    target = prompt(37, 7)
    others = [prompt(n, 10 + i) for i, n in enumerate((5, 60, 23, 14, 41))]
    alone = generate(engine, [target])[0]
    mixed = generate(engine, others[:2] + [target] + others[2:])
    assert mixed[2] == alone  # tokens and bit-identical logprobs


# ---- chunked prefill == one prefill ----

@pytest.mark.parametrize("tp,chunk", [(1, 4), (2, 16)])
def test_chunked_prefill_equals_one_prefill(tp, chunk):
    m = model(tp)
    n = 45  # > window 8; chunks of 4 wrap the ring, chunks of 16 overflow it
    ids = prompt(n, 0)
    cache = m.init_cache(2, 64)
    tokens = np.zeros((1, 64), np.int32)
    tokens[0, :n] = ids
    ref, cache = m.prefill(cache, tokens, np.array([n]), np.array([0]))
    for start in range(0, n, chunk):
        length = min(chunk, n - start)
        t = np.zeros((1, chunk), np.int32)
        t[0, :length] = ids[start:start + length]
        logits, kv = m.prefill_chunk(cache, t, start, length, 1)
        cache = m.write_chunk(cache, kv, start, length, 1)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-5)
    for layer in cache.layers:
        k, v = np.asarray(layer.k), np.asarray(layer.v)
        held = min(n, k.shape[-1])  # global rows: positions 0..n-1; ring rows: all W entries
        np.testing.assert_allclose(k[1, ..., :held], k[0, ..., :held], atol=2e-5)
        np.testing.assert_allclose(v[1, :, :held], v[0, :, :held], atol=2e-5)
    # Decoding on from both rows gives the same next logits.
    logits, cache = m.decode_step(cache, np.array([7, 7]), np.array([n, n]))
    logits = np.asarray(logits)
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-5)


def test_chunk_padding_near_the_end_of_the_cache():
    """A last chunk padded past the global rows' end keeps the positions before it."""
    m = model()
    n = 30  # cache of 32 positions; the chunk at 16 is padded to 16 tokens: fits, at 24 it would not
    ids = prompt(n, 1)
    cache = m.init_cache(2, 32)
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :n] = ids
    ref, cache = m.prefill(cache, tokens, np.array([n]), np.array([0]))
    for start, length in ((0, 8), (8, 8), (16, 8), (24, 6)):
        t = np.zeros((1, 16), np.int32)
        t[0, :length] = ids[start:start + length]
        logits, kv = m.prefill_chunk(cache, t, start, length, 1)
        cache = m.write_chunk(cache, kv, start, length, 1)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-5)
    g = np.asarray(cache.layers[1].k)  # the global layer
    np.testing.assert_allclose(g[1, ..., :n], g[0, ..., :n], atol=2e-5)
