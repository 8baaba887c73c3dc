"""Bucket sizes: a step's dynamic sizes (tokens, rows, pages, feature rows, frames) are rounded
up to powers of two, so that a few compiled programs serve every size. The engines, the image
encoder, the logits processing and the watchdog's step keys (which must name the same shapes
the programs were compiled for) round with this one function.

No jax import (serving/distributed.py's rule).
"""


def pow2(n: int, smallest: int = 1) -> int:
    """The smallest power of two >= n (and >= smallest): a bucket size."""
    return max(smallest, 1 << max(0, int(n) - 1).bit_length())
