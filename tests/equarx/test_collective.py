"""equarx.all_reduce on 8 virtual CPU devices: sums, replicas, shapes, dtypes, edge values."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equarx import AllReduceConfig, all_reduce, collectives, plan_for, plan_layout, resolved_variant
from equarx import layout as layout_module
from equarx.layout import MIN_TILES_PER_MINISHARD

ALL_METHODS = {
    "f32": AllReduceConfig("f32"),
    "bf16": AllReduceConfig("bf16"),
    "bf16_ring-full": AllReduceConfig("bf16_ring", "full"),
    "bf16_ring-twoshot": AllReduceConfig("bf16_ring", "twoshot"),
    "int8": AllReduceConfig("int8"),
    "int8-full": AllReduceConfig("int8", "full"),
    "int8-semi-rs": AllReduceConfig("int8", "semi", phases="rs"),
    "int8-twoshot-ag/64": AllReduceConfig("int8", "twoshot", phases="ag", group_size=64),
    "int4": AllReduceConfig("int4"),
    "fp8-full": AllReduceConfig("fp8", "full"),
    "int8-full+tile": AllReduceConfig("int8", "full", blocks="tile"),
    "int8-semi-ag+tile": AllReduceConfig("int8", "semi", phases="ag", blocks="tile"),
    "int8-semi-unpipelined+tile": AllReduceConfig("int8", "semi", pipelined=False, blocks="tile"),
    "int8-full+hadamard": AllReduceConfig("int8", "full", blocks="hadamard"),
}
# Per codec: the largest rounding error as a fraction of its block's absmax (the tile codec's
# float32 scales are exact; the group codec's are rounded up onto a grid of 32 steps an octave,
# by at most 3%), and an rms error bound for the random tests below.
HALF_STEP = {"int8": 1 / 254, "int4": 1 / 14, "fp8": 1 / 16}
RMS_BOUND = {"int8": 0.02, "int4": 0.3, "fp8": 0.08}
SHAPES = [(1,), (3, 1000), (5, 3, 129)]


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("tp",))


def reduce_everywhere(n: int, configs: list, inputs: list) -> list[list[np.ndarray]]:
    """inputs[i]: [n, *shape], row d = device d's partial sum. Returns out[c][i]: [n, *shape],
    row d = what device d holds after all_reduce with configs[c]. One jit for everything."""

    def body(*xs):
        return tuple(tuple(all_reduce(x[0], "tp", c)[None] for x in xs) for c in configs)

    f = jax.jit(jax.shard_map(body, mesh=_mesh(n), in_specs=(P("tp"),) * len(inputs),
                              out_specs=P("tp")))
    return jax.tree.map(np.asarray, f(*inputs))


def _replicas_identical(out: np.ndarray) -> bool:
    bits = out.view(np.uint16 if out.dtype.itemsize == 2 else np.uint32)
    return all(np.array_equal(bits[0], bits[d]) for d in range(1, len(out)))


def _quantizations(cfg: AllReduceConfig, n: int) -> int:
    """Upper bound on how many times one element is quantized on its way (RS hops + 1 AG)."""
    rs = 1 if resolved_variant(cfg, n, 0) == "twoshot" else n - 1
    return (rs + 1 if cfg.phases == "both" else 1 if cfg.phases == "ag" else rs)


def _largest_block_absmax(cfg: AllReduceConfig, x: np.ndarray) -> float:
    """A bound on the absmax of any block any partial sum can have."""
    mag = np.abs(x).sum(0).reshape(-1)
    if cfg.blocks == "tile":
        return mag.max()
    if cfg.blocks == "group":
        # Rotated runs of one row: |(D H s)_i| <= sqrt(g) |s|_2 <= sqrt(g) |row|_2, and
        # un-rotating (M^T / g) maps an error e back to at most max|e|.
        rows = np.abs(x).sum(0).reshape(-1, x.shape[-1])
        return np.sqrt(cfg.group_size) * np.linalg.norm(rows, axis=1).max()
    # Rotated 128-groups: |(H D s)_i| <= sqrt(128) |s|_2, and un-rotating (H D / 128) maps a
    # per-element error e back to at most max|e|.
    groups = np.pad(mag, (0, -mag.size % 128)).reshape(-1, 128)
    return np.sqrt(128) * np.linalg.norm(groups, axis=1).max()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_every_method_shape_and_axis_size(n):
    rng = np.random.default_rng(n)
    inputs = [rng.standard_normal((n,) + s).astype(np.float32) for s in SHAPES]
    names, cfgs = zip(*ALL_METHODS.items())
    outs = reduce_everywhere(n, list(cfgs), inputs)
    for name, cfg, per_shape in zip(names, cfgs, outs):
        for x, out in zip(inputs, per_shape):
            where = f"{name} n={n} shape={x.shape[1:]}"
            assert out.shape == x.shape and out.dtype == np.float32, where
            assert _replicas_identical(out), where
            if n == 1:
                assert np.array_equal(out, x), where  # no communication, no rounding
                continue
            exact = x.astype(np.float64).sum(0)
            err = np.abs(out[0] - exact)
            if name == "f32":
                np.testing.assert_allclose(out[0], exact, rtol=1e-6, atol=1e-5, err_msg=where)
            elif name.startswith("bf16"):
                # bf16 rounding of each partial sum: ~2^-8 relative, n roundings at most.
                assert err.max() <= n * 2**-8 * np.abs(x).sum(0).max(), where
            else:
                # Each quantization errs by at most half a step, absmax/254, and no partial sum
                # exceeds sum_d |x_d|; the rms error must also be small (a misrouted shard
                # would be off by O(1)).
                half_step = HALF_STEP[cfg.method] * (1.03 if cfg.blocks == "group" else 1 + 2**-7)
                bound = _quantizations(cfg, n) * _largest_block_absmax(cfg, x) * half_step
                assert err.max() <= bound, where
                if x[0].size >= 1000:  # an rms over a handful of values says little
                    rms_bound = RMS_BOUND[cfg.method] * np.sqrt(np.mean(exact**2))
                    assert np.sqrt(np.mean(err**2)) <= rms_bound, where


@pytest.mark.parametrize("variant,pipelined,sizes", [
    ("full", True, (2, 3, 4, 8)), ("semi", True, (2, 3, 4, 8)), ("twoshot", True, (2, 3, 4, 8)),
    ("full", False, (3, 8)), ("semi", False, (3, 8)), ("twoshot", False, (3, 8))])
def test_schedules_sum_the_right_shards_exactly(variant, pipelined, sizes, monkeypatch):
    """Small integers are exact in bf16, so bf16_ring must reproduce the sum bit for bit; with
    several minishards per shard this checks every chain / send of the schedule, which the
    quantized methods share. The token layout's pieces are made small so that a small message
    has 3 of them."""
    monkeypatch.setattr(layout_module, "MIN_PIECE_ELEMENTS", 64)
    for n in sizes:
        shape = (97, 5 * n + 3)  # not a multiple of anything: exercises the padding
        cfg = AllReduceConfig("bf16_ring", variant, minishards=3, pipelined=pipelined)
        assert plan_for(cfg, shape, n, variant).minishards == 3
        x = np.random.default_rng(n).integers(-8, 9, size=(n, *shape)).astype(np.float32)
        (out,), = reduce_everywhere(n, [cfg], [x])
        assert np.array_equal(out, np.broadcast_to(x.sum(0), out.shape)), (variant, n, pipelined)


@pytest.mark.parametrize("variant", ["full", "semi"])
def test_flat_layout_ring_sums_the_right_shards_exactly(variant):
    """The same on the paper's flat layout (blocks="tile"): int8 phases left unquantized
    ("ag" with the reduce-scatter in float32 of small integers is exact up to the AG's int8,
    so here phases="rs" is unused; bf16 partials through Int8 tile chains are checked by
    comparing the unpipelined and pipelined runs bit for bit)."""
    tiles = 3 * MIN_TILES_PER_MINISHARD
    n = 3
    n_el = n * tiles * 1024 - 777
    assert plan_layout(n_el, n, 3).minishards == 3
    x = np.random.default_rng(n).standard_normal((n, n_el)).astype(np.float32)
    cfgs = [AllReduceConfig("int8", variant, minishards=3, blocks="tile", pipelined=p)
            for p in (True, False)]
    (a,), (b,) = reduce_everywhere(n, cfgs, [x])
    assert np.array_equal(a, b)
    exact = x.astype(np.float64).sum(0)
    assert np.sqrt(np.mean((a[0] - exact) ** 2)) < 0.02 * np.sqrt(np.mean(exact ** 2))


@pytest.mark.parametrize("variant", ["full", "semi"])
def test_int8_error_against_float64_sum_with_several_minishards(variant):
    n, m = 4, 2
    n_el = n * m * MIN_TILES_PER_MINISHARD * 1024
    x = np.random.default_rng(7).standard_normal((n, n_el)).astype(np.float32)
    cfgs = [AllReduceConfig("int8", variant, minishards=m, blocks="tile"),
            AllReduceConfig("int8", variant, phases="ag", minishards=m, blocks="tile"),
            AllReduceConfig("int8", variant, minishards=m, pipelined=False, blocks="tile")]
    (both,), (ag,), (one_message,) = reduce_everywhere(n, cfgs, [x])
    # Same blocks, same scales, same order of additions: only the message count differs.
    assert np.array_equal(one_message, both)
    exact = x.astype(np.float64).sum(0)
    assert _replicas_identical(both) and _replicas_identical(ag)
    mse_both = np.mean((both[0] - exact) ** 2)
    mse_ag = np.mean((ag[0] - exact) ** 2)
    # Uniform rounding error of one quantization: step^2 / 12 with step = absmax / 127; the
    # absmax of 128 N(0, n) values is about 2.9 sqrt(n).
    one_step = (2.9 * np.sqrt(n) / 127) ** 2 / 12
    assert 0.5 * one_step < mse_ag < 1.5 * one_step
    assert mse_ag < mse_both < n * one_step
    assert abs(np.mean(both[0] - exact)) < 1e-3  # round half to even: no bias


def test_bf16_in_bf16_out():
    n = 4
    x = jnp.asarray(np.random.default_rng(3).standard_normal((n, 37, 300)), jnp.bfloat16)
    cfgs = list(ALL_METHODS.values())
    outs = reduce_everywhere(n, cfgs, [x])
    exact = np.asarray(x, np.float64).sum(0)
    for cfg, (out,) in zip(cfgs, outs):
        assert out.dtype == jnp.bfloat16 and out.shape == x.shape, cfg.label
        assert _replicas_identical(out), cfg.label
        rel = np.sqrt(np.mean((out[0].astype(np.float64) - exact) ** 2) / np.mean(exact**2))
        # Tiny message: tile blocks here hold 3 values each, rotated rows 128 (~1% rms at n=4).
        bound = {"int4": 0.2, "fp8": 0.05}.get(cfg.method, 2e-2 if cfg.blocks == "hadamard"
                                                 else 1e-2)
        assert rel < bound, (cfg.label, rel)


def test_zeros_stay_exactly_zero():
    n = 8
    x = np.zeros((n, 3, 1000), np.float32)
    x[:, 0, :5] = 1.0  # a few live values: the rest are all-zero blocks next to live ones
    cfgs = list(ALL_METHODS.values())
    # The message travels beside zeros of SHAPES' other shapes, so that this is the program of
    # test_every_method_shape_and_axis_size[8], which the session's compilation cache returns.
    where = SHAPES.index(x.shape[1:])
    inputs = [x if i == where else np.zeros((n,) + s, np.float32) for i, s in enumerate(SHAPES)]
    for cfg, per_shape in zip(cfgs, reduce_everywhere(n, cfgs, inputs)):
        out = per_shape[where]
        # Rotation mixes a group (128 or 32 values): its zeros pick up quantization noise, the
        # next group's don't.
        rotated = cfg.method in ("int8", "int4", "fp8") and cfg.blocks != "tile"
        live = (128 if cfg.blocks == "hadamard" else cfg.group_size) if rotated else 5
        tol = {"int4": 0.25, "fp8": 0.1}.get(cfg.method, 2e-2)
        assert np.all(out[:, 1:] == 0) and np.all(out[:, 0, live:] == 0), cfg.label
        assert np.abs(out[:, 0, 5:live]).max(initial=0) < tol * n, cfg.label
        np.testing.assert_allclose(out[:, 0, :5], n, rtol=tol, err_msg=cfg.label)


def test_nan_and_inf_come_out_non_finite_on_every_device():
    n, m = 4, 2
    n_el = n * m * MIN_TILES_PER_MINISHARD * 1024
    layout = plan_layout(n_el, n, m)
    x = np.random.default_rng(5).standard_normal((n, n_el)).astype(np.float32)
    bad = {12345: np.nan, n_el - 3: np.inf}  # two different shards
    x[1, 12345] = np.nan
    x[3, n_el - 3] = np.inf
    cfgs = list(ALL_METHODS.values())
    block = layout.tiles * 1024  # elements of one minishard; lane = index % 1024
    poisoned = np.zeros(n_el, bool)
    for i in bad:
        start = i - i % block
        poisoned[start + (i % 1024)::1024][: layout.tiles] = True
    def run_of(size):  # rotated blocks: the bad value's run (aligned in the row's columns)
        mask = np.zeros(n_el, bool)
        for i in bad:
            mask[i - i % size: i - i % size + size] = True
        return mask

    for cfg, (out,) in zip(cfgs, reduce_everywhere(n, cfgs, [x])):
        if cfg.method in ("int8", "int4", "fp8") and cfg.blocks != "tile":
            in_group = run_of(128 if cfg.blocks == "hadamard" else cfg.group_size)
            assert not np.isfinite(out[:, in_group]).any(), cfg.label
            assert np.isfinite(out[:, ~in_group]).all(), cfg.label
            continue
        for i in bad:
            assert not np.isfinite(out[:, i]).any(), (cfg.label, i)
        # Nothing outside the two poisoned blocks is touched.
        assert np.isfinite(out[:, ~poisoned]).all(), cfg.label


def _compiled(n: int, cfg: AllReduceConfig, shape, dtype=jnp.bfloat16):
    mesh = _mesh(n)
    f = jax.jit(jax.shard_map(lambda a: all_reduce(a, "tp", cfg), mesh=mesh,
                              in_specs=P("tp"), out_specs=P("tp")))
    spec = jax.ShapeDtypeStruct((n * shape[0],) + shape[1:], dtype,
                                sharding=NamedSharding(mesh, P("tp")))
    return f.lower(spec).compile()


def test_min_bytes_falls_back_to_the_bf16_psum():
    n = 4
    x = np.random.default_rng(9).standard_normal((n, 3, 1000)).astype(np.float32)  # 12000 B
    small = AllReduceConfig("int8", min_bytes=12001)
    (fallback,), (psum,) = reduce_everywhere(n, [small, AllReduceConfig("bf16")], [x])
    assert np.array_equal(fallback, psum)
    kinds = {op.kind for op in collectives(_compiled(n, small, (3, 1000), jnp.float32))}
    assert kinds == {"all-reduce"}
    kinds = {op.kind for op in collectives(
        _compiled(n, AllReduceConfig("int8", min_bytes=12000), (3, 1000), jnp.float32))}
    assert kinds == {"collective-permute"}


def test_axis_of_one_device_communicates_nothing():
    assert collectives(_compiled(1, AllReduceConfig("int8"), (64, 64))) == []


def test_bad_input_is_rejected():
    with pytest.raises(TypeError, match="floating"):
        reduce_everywhere(2, [AllReduceConfig("int8")], [np.ones((2, 4), np.int32)])
    with pytest.raises(TypeError, match="AllReduceConfig"):
        reduce_everywhere(2, ["int8"], [np.ones((2, 4), np.float32)])
    with pytest.raises(ValueError, match="method"):
        AllReduceConfig("int2")
    with pytest.raises(ValueError, match="minishards"):
        AllReduceConfig("int8", minishards=2.5)
    with pytest.raises(ValueError, match="blocks"):
        AllReduceConfig("int8", blocks="rows")
    with pytest.raises(ValueError, match="group_size"):
        AllReduceConfig("int8", group_size=48)
    with pytest.raises(ValueError, match="needs blocks='group'"):
        AllReduceConfig("int4", blocks="tile")
    with pytest.raises(ValueError, match="pipelined"):
        AllReduceConfig("int8", pipelined="no")
    assert type(AllReduceConfig("int8", minishards=np.int64(8)).minishards) is int
    with pytest.raises(ValueError):
        plan_layout(0, 4, 1)


@pytest.mark.parametrize("label", ["f32", "bf16", "bf16_ring", "bf16_ring-semi", "int8",
                                   "int8-full", "int8-semi+tile", "int8-full-ag+tile",
                                   "int8-semi-rs+hadamard", "int8-twoshot-ag", "int4-twoshot",
                                   "fp8/64", "int8-full/128"])
def test_config_from_label_inverts_label(label):
    cfg = AllReduceConfig.from_label(label, minishards=16, min_bytes=1024)
    assert cfg.label == label and (cfg.minishards, cfg.min_bytes) == (16, 1024)


@pytest.mark.parametrize("label", ["int2", "int8-diagonal", "bf16+hadamard", "int8-full+",
                                   "int8-full-rs-x", "bf16-full-rs", "int8-full+rows", "int8/48",
                                   "bf16_ring+tile", "int8+tile/64", "bf16_ring-rs", "int4+tile"])
def test_config_from_label_rejects_typos(label):
    with pytest.raises(ValueError):
        AllReduceConfig.from_label(label)


def test_hadamard_blocks_beat_tiles_on_outlier_channels():
    """Activations with a few huge channels (as transformer residuals have): tile scales are set
    by the outliers for every element sharing a lane, rotated row scales are not."""
    n, tokens, d = 4, 512, 640
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n, tokens, d)).astype(np.float32)
    x[:, :, [3, 200, 517]] *= 60.0
    cfgs = [AllReduceConfig("int8", "full", blocks="tile"),
            AllReduceConfig("int8", "full", blocks="hadamard"), AllReduceConfig("int8", "full")]
    (tile,), (had,), (group,) = reduce_everywhere(n, cfgs, [x])
    exact = x.astype(np.float64).sum(0)
    bulk = np.ones(d, bool)
    bulk[[3, 200, 517]] = False
    mse_tile = np.mean((tile[0] - exact)[:, bulk] ** 2)
    mse_had = np.mean((had[0] - exact)[:, bulk] ** 2)
    mse_group = np.mean((group[0] - exact)[:, bulk] ** 2)
    assert _replicas_identical(had) and _replicas_identical(group)
    assert mse_had < 0.25 * mse_tile, (mse_had, mse_tile)
    assert mse_group < 0.25 * mse_tile, (mse_group, mse_tile)
