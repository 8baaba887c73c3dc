"""A plain, unsharded forward pass of Gemma 3 for parity tests: every position's logits of one
sequence by dense attention over all its keys, the mask written out from the rule (key j is seen
by query i iff j <= visible[i] and, in a local layer, j > i - W). Built from model.py's blocks at
tp=1, no cache, no pages: an independent check of the ragged step's paged attention."""
import jax
import jax.numpy as jnp
import numpy as np

from equarx import AllReduceConfig
from models.gemma3 import model as forward


def attend(q, k, v, mask):
    """q [1, T, N, H], k, v [1, T, K, H], mask [T, T] (True: attend) -> [1, T, N, H]."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask[None, None], logits.astype(q.dtype), forward.K_MASK)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v,
                      preferred_element_type=jnp.float32).astype(q.dtype)


def reference_logits(m, tokens, visible=None) -> np.ndarray:
    """float32 logits [T, V] of `tokens` under model `m` (its weights at tp=1); visible[i]:
    the last key position query i sees (default: causal)."""
    n, window = len(tokens), m.config.sliding_window
    visible = list(range(n)) if visible is None else visible
    ctx = forward.Ctx(config=m.config, tp=1, allreduce=AllReduceConfig("f32"))
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    masks = {kind: np.array([[j <= visible[i] and (kind == "global" or j > i - window)
                              for j in range(n)] for i in range(n)])
             for kind in ("global", "local")}

    def logits(weights, tokens, masks):
        def attn(x, w, layer, kind):
            q, k, v = forward.project_qkv(x, w, positions, kind, ctx)
            return forward.output_projection(attend(q, k, v, masks[kind]), w.o), None

        x = forward.embed_tokens(weights.embed, tokens, ctx)
        x, _ = forward.run_layers(x, weights, attn, ctx)
        x = forward.rms_norm(x[0], weights.final_norm, m.config.norm_eps)
        return forward.output_logits(x, weights.embed)

    weights = jax.tree.map(np.asarray, m.weights)  # unsharded, on the default device
    # One compiled program (the same blocks), not one per eager op.
    return np.asarray(jax.jit(logits)(weights, jnp.asarray([tokens], jnp.int32), masks))
