"""The per-step inputs of the sampler's logits processing (`serving.sampling.LogitsExtras`), built
from the sequences of a step: penalties over the tokens each has seen, logit bias, the tokens
banned until min_tokens, min_p, and the grammar masks (`serving.structured_output`).

A step whose rows need none of it gets None, and the sampler runs its plain program: requests that
use no processing pay nothing. Shapes are padded to powers of two (bias entries, tokens seen), so
that a server compiles few variants.
"""
from __future__ import annotations

import numpy as np

from serving.sampling import LogitsExtras
from models.shapes import pow2


def step_extras(seqs, structured, eos_ids: tuple[int, ...]) -> LogitsExtras | None:
    """seqs: the step's rows (a `sequence.Sequence`, or None for an idle row); structured: the
    `StructuredOutputs` holding their grammar matchers (or None)."""
    if not any(s is not None and s.params.needs_extras for s in seqs):
        return None
    n = len(seqs)
    bias: list[list[tuple[int, float]]] = []
    for s in seqs:
        entries: list[tuple[int, float]] = []
        if s is not None:
            p = s.params
            entries = list(p.logit_bias)
            if len(s.generated) < p.min_tokens:
                entries += [(t, -np.inf) for t in sorted(set(eos_ids) | set(p.stop_token_ids))]
        bias.append(entries)
    seen_len = max((s.length for s in seqs if s is not None and s.params.has_penalties), default=0)
    k = max(len(b) for b in bias)
    ex = LogitsExtras.neutral(n, k=pow2(k, 1) if k else 0, length=pow2(seen_len, 16) if seen_len else 0,
                              min_p=any(s is not None and s.params.min_p > 0 for s in seqs))
    for i, (s, entries) in enumerate(zip(seqs, bias)):
        if s is None:
            continue
        p = s.params
        for j, (t, b) in enumerate(entries):
            ex.bias_ids[i, j], ex.bias_vals[i, j] = t, b
        if ex.min_p is not None:
            ex.min_p[i] = p.min_p
        if p.has_penalties:
            ex.presence[i], ex.frequency[i], ex.repetition[i] = (p.presence_penalty, p.frequency_penalty,
                                                                 p.repetition_penalty)
            seen = s.prompt + s.generated
            ex.seen_ids[i, :len(seen)] = seen
            ex.seen_output[i, len(s.prompt):len(seen)] = True
    mask = None
    if structured is not None and len(structured):
        mask = structured.masks([None if s is None else s.id for s in seqs])
    return ex._replace(mask=mask)
