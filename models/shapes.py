"""A ragged step's shape, the one type that names a compiled step program: the engine pads each step
to one, the model keys its programs by it, a multi-process group sends it with each step.

`pow2` is the one bucketing rule (sizes round up to powers of two, so few programs serve every
size). No jax import: a group's processes read it before jax starts."""
from __future__ import annotations

import dataclasses


def pow2(n: int, smallest: int = 1) -> int:
    """The smallest power of two >= n (and >= smallest): a bucket size."""
    return max(smallest, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class StepShape:
    """T tokens, S sequence rows, Q query slots per row, Pg and Pl pages per row in the global
    and local block tables, F image feature rows (0: a text step); whether the step returns
    its rows' logits, and every token's (prompt logprobs)."""

    tokens: int
    seqs: int
    queries: int
    global_pages: int
    local_pages: int
    logits: bool = True
    every_token: bool = False
    features: int = 0

    @property
    def packed_size(self) -> int:
        """Length of the int32 array a batch of this shape travels in (`ragged.pack`): six
        arrays of T, the queries and both tables, two arrays of S."""
        return 6 * self.tokens + self.seqs * (self.queries + self.global_pages
                                              + self.local_pages + 2)

    def describe(self) -> str:
        """"T=.. S=.. Q=.. Pg=.. Pl=..[ F=..][ (no logits)][ (every token's logits)]"."""
        return (f"T={self.tokens} S={self.seqs} Q={self.queries} Pg={self.global_pages} "
                f"Pl={self.local_pages}" + (f" F={self.features}" if self.features else "")
                + ("" if self.logits else " (no logits)")
                + (" (every token's logits)" if self.every_token else ""))
