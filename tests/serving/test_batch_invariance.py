"""Batch invariance on the real engine over tiny random models (window 8, so that prompts
overflow the sliding window): in deterministic mode a greedy request alone and among concurrent
different requests gives the same tokens and bit-identical logprobs, at tp=1 and tp=2 with the
exact and the token-local AllReduces, float32 and bfloat16, and with an int8 KV cache (a token's
codes depend on that token alone).

`reference` is the engine's independent answer: greedy tokens found one at a time by forward
passes over the whole text so far (`Gemma3Model.score`, no KV cache carried between them).
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


def model(tp=1, dtype="float32", allreduce="f32", kv_cache_dtype="auto"):
    key = (tp, dtype, allreduce, kv_cache_dtype)
    if key not in _models:
        _models[key] = load_model(TINY, tp=tp, dtype=dtype, allreduce=AllReduceConfig.from_label(allreduce),
                                  kv_cache_dtype=kv_cache_dtype)
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
    """What `generate` should give, from the model alone: each greedy token the argmax of a
    forward pass over the prompt and the tokens before it (`score`), with its logprob there."""
    texts = [list(p) for p in prompts]
    out = [[] for _ in prompts]
    for _ in range(max_tokens):
        lps = log_softmax(m.score(texts))
        for i, t in enumerate(texts):
            tok = int(np.argmax(lps[i, len(t) - 1]))
            out[i].append((tok, float(lps[i, len(t) - 1, tok])))
            t.append(tok)
    return out


def paged(m, **kw):
    args = dict(max_num_seqs=4, max_seq_len=96, page_size=4, long_prefill_token_threshold=8)
    args.update(kw)
    return PagedRunner(m, **args)


# ---- deterministic (batch-invariant) mode ----

# (tp, dtype, AllReduce, KV cache dtype): tp=1, and tp=2 with the exact psums and both
# token-local modes; an int8 KV cache at tp=1 and beside the int8 AllReduce at tp=2.
CONFIGS = [(1, "bfloat16", "f32", "auto"), (2, "float32", "f32", "auto"),
           (2, "bfloat16", "bf16", "auto"), (2, "bfloat16", "bf16_ring", "auto"),
           (2, "float32", "int8", "auto"), (2, "bfloat16", "int8", "auto"),
           (1, "bfloat16", "f32", "int8"), (2, "bfloat16", "int8", "int8")]


@pytest.mark.parametrize("tp,dtype,allreduce,kv_cache_dtype", CONFIGS)
def test_a_request_alone_equals_it_among_others(tp, dtype, allreduce, kv_cache_dtype):
    engine = paged(model(tp, dtype, allreduce, kv_cache_dtype), deterministic=True)
    target = prompt(37, 7)
    others = [prompt(n, 10 + i) for i, n in enumerate((5, 60, 23, 14, 41))]
    alone = generate(engine, [target])[0]
    mixed = generate(engine, others[:2] + [target] + others[2:])
    assert mixed[2] == alone  # tokens and bit-identical logprobs
