"""variant="auto": which schedule a message takes, from the axis size, its bytes and the topology.

Two devices or a switched topology: two-shot (2 steps instead of 2 (N-1), each value quantized
twice). Ring-connected (a TPU torus axis): from N = 4 on two-shot loads the busiest link more than
the ring (`two_shot_link_load`), so it takes only small messages. See docs/algorithm.md, "Version
2"."""
from __future__ import annotations

# One TPU v5e ICI link, one direction: 4.5e10 bytes/s, the figure of the JAX scaling book
# ("How to Scale Your Model", the TPU chapter's hardware table). Google Cloud's v5e page gives
# only the per-chip total (400 GB/s bidirectional over 4 ports), which read as an even split
# would be 50 GB/s; the book's per-link number is the one used everywhere (eval.cost_model too).
V5E_LINK_BYTES_PER_S = 45e9
# Latency of one ring step on ICI: an assumption (not published), shared with eval.cost_model.
V5E_HOP_S = 2e-6
RING_LINK_BYTES_PER_S = V5E_LINK_BYTES_PER_S
RING_HOP_S = V5E_HOP_S


def two_shot_link_load(n: int) -> float:
    """Shards per phase on the busiest link of a bidirectional ring when every device sends one
    shard straight to each other device along the shorter way."""
    return sum(min(k, n - k) for k in range(1, n)) / 2


def choose(n_devices: int, message_bytes: float, topology: str) -> str:
    """The variant ("full" or "twoshot") for a message of `message_bytes` on `n_devices`."""
    if n_devices <= 2 or topology == "switched":
        return "twoshot"
    if topology != "ring":
        raise ValueError(f"topology must be 'ring' or 'switched' here, got {topology!r}")
    shard = message_bytes / n_devices
    ring = 2 * (n_devices - 1) * (RING_HOP_S + shard / 2 / RING_LINK_BYTES_PER_S)
    two_shot = 2 * ((n_devices // 2) * RING_HOP_S
                    + two_shot_link_load(n_devices) * shard / RING_LINK_BYTES_PER_S)
    return "twoshot" if two_shot < ring else "full"


def resolve_topology(topology: str) -> str:
    """"auto" -> "ring" on TPU (torus links), "switched" elsewhere."""
    if topology != "auto":
        return topology
    import jax

    return "ring" if jax.devices()[0].platform == "tpu" else "switched"
