"""Real English text for the quality evaluation with no download: the prose paragraphs of the
Python Language Reference, which ships with CPython (`pydoc_data/topics.py`, the text
`help("if")` shows); indented blocks (grammar, code) and headings are dropped."""
from __future__ import annotations

import re

SOURCE = "Python standard library, pydoc_data/topics.py (Python Language Reference prose)"
MIN_WORDS = 8


def prose_paragraphs() -> list[str]:
    """Prose paragraphs of the reference, topics in sorted order (deterministic)."""
    from pydoc_data import topics

    out = []
    for key in sorted(topics.topics):
        for block in re.split(r"\n\s*\n", topics.topics[key]):
            lines = block.split("\n")
            if any(line.startswith(" ") for line in lines):  # code, grammar, tables
                continue
            if re.fullmatch(r"[*=\-~^]+", lines[-1].strip() or "-"):  # a heading
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text.split()) >= MIN_WORDS:
                out.append(text)
    return out


def token_windows(tokenize, n_tokens: int, window: int, bos_id: int) -> list[list[int]]:
    """The corpus as consecutive windows of `window` ids, each starting with BOS and continuing
    the running text (so each window scores window - 1 real next-token predictions), until
    `n_tokens` predictions are covered. Raises if the corpus is too short."""
    if window < 2 or n_tokens < 1:
        raise ValueError(f"need window >= 2 and n_tokens >= 1, got {window}, {n_tokens}")
    ids: list[int] = []
    for para in prose_paragraphs():
        ids.extend(tokenize(para + "\n\n"))
        if len(ids) >= n_tokens + window:
            break
    per = window - 1
    count = -(-n_tokens // per)
    if len(ids) < count * per + 1:
        raise ValueError(f"corpus has {len(ids)} tokens, fewer than the {count * per} requested")
    return [[bos_id] + ids[i * per:(i + 1) * per] for i in range(count)]


def prompt_set(tokenize, n_prompts: int, prompt_tokens: int, skip_paragraphs: int = 400
               ) -> list[list[int]]:
    """`n_prompts` prompts of `prompt_tokens` ids: the opening of paragraphs taken from the later
    part of the corpus (past `skip_paragraphs`, away from the scored windows), every paragraph
    long enough, spread evenly. No BOS (the caller adds it)."""
    paras = prose_paragraphs()[skip_paragraphs:]
    candidates = [ids for ids in (tokenize(p) for p in paras) if len(ids) >= prompt_tokens]
    if len(candidates) < n_prompts:
        raise ValueError(f"only {len(candidates)} paragraphs have {prompt_tokens} tokens")
    step = len(candidates) / n_prompts
    return [candidates[int(i * step)][:prompt_tokens] for i in range(n_prompts)]
