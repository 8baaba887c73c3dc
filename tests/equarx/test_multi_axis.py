"""equarx.all_reduce over several mesh axes (the multi-axis schedule) on 4 and 8 virtual CPU
devices: sums within the codec's bound against a float32 psum, identical replicas, exact sums
with small integers, token-locality, and the links it uses."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from equarx import AllReduceConfig, all_reduce
from equarx.multi_axis import axis_orders

MESHES = {"2x2": (2, 2), "2x4": (2, 4), "2x2x2": (2, 2, 2)}
AXES = ("x", "y", "z")
CONFIGS = {
    "bf16_ring-full": AllReduceConfig("bf16_ring", "full", pipelined=False),
    "int8-full": AllReduceConfig("int8", "full", pipelined=False),
    "int8-full+tile": AllReduceConfig("int8", "full", blocks="tile"),
    "int8-semi+tile": AllReduceConfig("int8", "semi", blocks="tile", pipelined=False),
    "int8-twoshot": AllReduceConfig("int8", "twoshot"),
}


def _mesh(dims: tuple[int, ...]) -> tuple[Mesh, tuple[str, ...]]:
    axes = AXES[:len(dims)]
    n = int(np.prod(dims))
    return Mesh(np.array(jax.devices()[:n]).reshape(dims), axes), axes


def _reduce(dims, configs, x: np.ndarray) -> list[np.ndarray]:
    """x: [n, *shape], row d = the partial of the d-th device in the mesh's order. Returns,
    per config, [n, *shape]: what each device holds."""
    mesh, axes = _mesh(dims)

    def body(a):
        return tuple(all_reduce(a[0], axes, c)[None] for c in configs)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
    return [np.asarray(o) for o in f(x)]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sums_within_bound_and_replicas_identical(mesh):
    dims = MESHES[mesh]
    n = int(np.prod(dims))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 24, 256)).astype(jnp.bfloat16)
    exact = x.astype(np.float64).sum(0)
    # 8 devices and three axes compile slowly: the codecs are covered on 2x2 and 2x4.
    names = ["bf16_ring-full", "int8-full+tile"] if mesh == "2x2x2" else list(CONFIGS)
    outs = _reduce(dims, [CONFIGS[c] for c in names], x)
    for name, out in zip(names, outs):
        assert out.dtype == x.dtype
        bits = out.view(np.uint16)
        assert all(np.array_equal(bits[0], bits[d]) for d in range(n)), (mesh, name)
        err = np.abs(out[0].astype(np.float64) - exact)
        rms = np.sqrt(np.mean(err ** 2)) / np.sqrt(np.mean(exact ** 2))
        # bf16 rounding of the partials on each hop (~2^-8 relative) or the int8 codec's
        # (rms ~1% of a block's absmax per quantization, a handful of quantizations here).
        assert rms < (0.01 if name.startswith("bf16") else 0.03), (mesh, name, rms)
        if "tile" in name:  # the paper's codec: a bound from the block absmax
            hops = sum(d - 1 for d in dims) + 1
            assert err.max() <= hops * np.abs(x.astype(np.float64)).sum(0).max() / 254 * 1.01


@pytest.mark.parametrize("mesh,variant", [("2x4", "full"), ("2x2x2", "semi"),
                                          ("2x4", "twoshot")])
def test_schedule_sums_the_right_shards_exactly(mesh, variant):
    """Small integers are exact in bf16, so the bf16 ring must reproduce the sum bit for bit:
    any block sent to the wrong place or summed twice shows up (the quantized methods share the
    schedule)."""
    dims = MESHES[mesh]
    n = int(np.prod(dims))
    x = np.random.default_rng(1).integers(-8, 9, (n, 5, 1003)).astype(np.float32)
    (out,) = _reduce(dims, [AllReduceConfig("bf16_ring", variant, minishards=3)], x)
    np.testing.assert_array_equal(out, np.broadcast_to(x.sum(0), out.shape))


def test_int8_pieces_travel_alike_pipelined_or_not():
    """One ppermute per piece or one per chain and hop: the same bytes, the same result."""
    x = np.random.default_rng(4).standard_normal((8, 64, 1024)).astype(np.float32)
    cfgs = [AllReduceConfig("int8", "full", blocks="tile", minishards=2, pipelined=p)
            for p in (True, False)]
    a, b = _reduce((2, 4), cfgs, x)
    np.testing.assert_array_equal(a, b)


def test_f32_and_bf16_psum_over_a_tuple_of_axes():
    x = np.random.default_rng(2).standard_normal((8, 3, 7)).astype(np.float32)
    f32, bf16 = _reduce((2, 2, 2), [AllReduceConfig("f32"), AllReduceConfig("bf16")], x)
    np.testing.assert_allclose(f32[0], x.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bf16[0], x.sum(0), rtol=2e-2, atol=5e-2)


def test_group_codec_is_token_local():
    """A row's result does not depend on the other rows (nor on how many there are)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 40, 512)).astype(np.float32)
    cfg = AllReduceConfig("int8", "full", pipelined=False)
    assert cfg.token_local
    (whole,) = _reduce((2, 2), [cfg], x)
    (part,) = _reduce((2, 2), [cfg], x[:, 7:10])
    np.testing.assert_array_equal(whole[:, 7:10], part)


def test_every_axis_carries_a_part_at_once():
    """The compiled program's first reduce-scatter stage sends along x and along y: the two
    parts' first collective-permutes pair devices differing in x and devices differing in y."""
    mesh, axes = _mesh((2, 2))
    f = jax.jit(jax.shard_map(lambda a: all_reduce(a[0], axes, CONFIGS["int8-full"])[None],
                              mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
    hlo = f.lower(np.zeros((4, 16, 512), np.float32)).compile().as_text()
    pairs = re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}", hlo)
    kinds = {tuple(sorted(tuple(map(int, p.split(","))) for p in re.findall(r"\d+,\d+", s)))
             for s in pairs}
    x_pairs = ((0, 2), (1, 3), (2, 0), (3, 1))
    y_pairs = ((0, 1), (1, 0), (2, 3), (3, 2))
    assert x_pairs in kinds and y_pairs in kinds, kinds
    assert axis_orders(3) == [(0, 1, 2), (1, 2, 0), (2, 0, 1)]
