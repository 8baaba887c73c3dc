"""Next-token sampling for `Gemma3Model.generate`: greedy, temperature, top-k, top-p."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@jax.jit
def greedy(logits: jax.Array) -> jax.Array:
    """[B, V] -> int32 [B]; ties go to the lowest id (as numpy/jnp argmax)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("top_k", "use_top_p"))
def _sample(logits, key, temperature, top_p, *, top_k: int | None, use_top_p: bool):
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if use_top_p:
        # Keep the smallest set of most likely tokens whose probability reaches top_p: a token
        # survives when the mass strictly before it (in descending order) is below top_p.
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.where(before < top_p, sorted_logits, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None) -> jax.Array:
    """Sample one id per row of logits [B, V]; temperature 0 is greedy."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[-1]}], got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0.0:
        return greedy(logits)
    return _sample(logits, key, jnp.float32(temperature), jnp.float32(top_p or 1.0),
                   top_k=top_k, use_top_p=top_p is not None and top_p < 1.0)
