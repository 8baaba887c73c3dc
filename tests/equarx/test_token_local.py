"""The token layout and group codecs: a row's result depends on that row alone, bitwise (2, 4
and 8 devices); the codec's rounding bounds; variant="auto"."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from equarx import AllReduceConfig, all_reduce, codec_spec, groups, resolved_variant, schedule
from testkit import assert_same_bits

# The codec's steps as compiled programs (as a schedule runs them), one program each per shape
# rather than one per eager op.
_encode = jax.jit(groups.encode, static_argnums=(1, 2))
_decode = jax.jit(codec_spec.decode, static_argnums=(1, 2, 3))
_wire_parts = jax.jit(codec_spec.wire_parts, static_argnums=(1, 2, 3))
_unrotate_codes = jax.jit(groups.unrotate_codes, static_argnums=(3, 4, 5))
_unrotate = jax.jit(groups.unrotate, static_argnums=1)
_rotate = jax.jit(groups.rotate, static_argnums=1)

TOKEN_LOCAL = ["bf16_ring", "bf16_ring-semi", "int8", "int8-full", "int8-twoshot-rs", "int4",
               "int8-semi/64", "bf16"]


def _reduce(n: int, cfgs: list, x: np.ndarray) -> list[np.ndarray]:
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    f = jax.jit(jax.shard_map(lambda v: tuple(all_reduce(v[0], "tp", c)[None] for c in cfgs),
                              mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    return [np.asarray(o) for o in f(x)]


@pytest.mark.parametrize("n,labels", [
    (2, TOKEN_LOCAL), (4, ["bf16_ring-full", "int8", "int8-semi"]),
    (8, ["int8", "fp8-full"])])
def test_a_rows_result_does_not_depend_on_the_other_rows(n, labels):
    """Rows 0..5 of a 40-row message, of a 9-row message whose other rows differ, and one row
    alone: bitwise the same result for every token-local config."""
    cfgs = [AllReduceConfig.from_label(label) for label in labels]
    assert all(c.token_local for c in cfgs)
    rng = np.random.default_rng(n)
    big = rng.standard_normal((n, 40, 640)).astype(np.float32)
    big[:, :, 7] *= 50  # an outlier channel, so scales differ from group to group
    other = big[:, :9].copy()
    other[:, 6:] = 100 * rng.standard_normal(other[:, 6:].shape)
    # One program per config, as a model runs one (a program holding several configs lets XLA
    # share and fuse their common parts differently from one message length to another).
    for label, cfg in zip(labels, cfgs):
        results = [_reduce(n, [cfg], m)[0] for m in (big, other, big[:, :1].copy())]
        for r, rows in zip(results[1:], (6, 1)):
            assert np.array_equal(r[:, :rows], results[0][:, :rows]), (label, n, rows)
        assert all(np.array_equal(results[0][0], results[0][d]) for d in range(n)), label


def test_the_flat_layouts_are_not_token_local_and_say_so():
    """The paper's tile scales mix tokens: the same rows in a different batch come out
    differently, which is why `token_local` is False for them."""
    n = 4
    cfgs = [AllReduceConfig("int8", "full", blocks="tile"),
            AllReduceConfig("int8", "full", blocks="hadamard")]
    assert not any(c.token_local for c in cfgs)
    rng = np.random.default_rng(0)
    big = rng.standard_normal((n, 40, 640)).astype(np.float32)
    other = big[:, :9].copy()  # fewer rows: the first rows' values land in other shards
    other[:, 6:] *= 30
    a, b = _reduce(n, cfgs, big), _reduce(n, cfgs, other)
    for i in range(len(cfgs)):
        assert not np.array_equal(a[i][:, :6], b[i][:, :6])


@pytest.mark.parametrize("code,half_step", [("int8", 1 / 254), ("int4", 1 / 14), ("fp8", 1 / 16)])
def test_group_codec_round_trip_is_within_half_a_step(code, half_step):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 7, 96)).astype(np.float32) * np.exp(rng.uniform(-8, 8, (3, 7, 1)))
    wire = _encode(jnp.asarray(x), 32, code)
    assert wire.dtype == jnp.int8
    assert wire.size == x.size * codec_spec.wire_bytes_per_value(32, code, 96)
    assert wire.size == 3 * (7 * 96 * (0.5 if code == "int4" else 1) + 7 * (3 + 1))
    y = np.asarray(_decode(wire, 32, code, x.shape))
    amax = np.abs(x).reshape(3, 7, 3, 32).max(-1, keepdims=True)
    err = np.abs(y - x).reshape(3, 7, 3, 32)
    # The scale is rounded up onto a grid of 32 bfloat16 steps per octave: at most 3% larger
    # than absmax / code_max.
    assert np.all(err <= amax * half_step * 1.03 + 1e-30), code


def test_group_codec_special_values():
    x = np.random.default_rng(2).standard_normal((1, 4, 64)).astype(np.float32)
    x[0, 0, :32] = 0.0  # a zero group
    x[0, 1, 40] = np.nan  # poisons its group only
    x[0, 2, 3] = np.inf
    x[0, 3, :32] = 1e-40  # too small for a finite 1/scale: decodes to 0
    y = np.asarray(_decode(_encode(jnp.asarray(x), 32, "int8"), 32, "int8", x.shape))
    assert np.all(y[0, 0, :32] == 0)
    assert np.isnan(y[0, 1, 32:]).all() and np.isfinite(y[0, 1, :32]).all()
    assert not np.isfinite(y[0, 2, :32]).any() and np.isfinite(y[0, 2, 32:]).all()
    assert np.all(y[0, 3, :32] == 0) and np.isfinite(y[0, 3, 32:]).all()


def test_scales_are_the_finest_grid_point_at_or_above_the_run():
    """codec_spec.scale_parts against a search of the grid in float64: a row's exponent is the
    smallest power of two at or above its largest finite scale (absmax / code_max); a run's
    scale the finest of the 255 points 2^(e - k // 32) (64 - k % 32) / 64 (bfloat16 values:
    at most 7 significant bits) still at or above its
    own, the last one for runs more than 8 octaves down; NaN / Inf runs NOT_FINITE."""
    rng = np.random.default_rng(7)
    amax = np.exp(rng.uniform(-60, 60, (64, 1)) + rng.uniform(-7, 0, (64, 12)))
    amax = amax.astype(np.float32)
    amax[0, 3], amax[1, 5], amax[2], amax[3, 2], amax[4, 0] = 0, np.inf, 0, np.nan, 3e38
    amax[5, 1] = amax[5, 0] * 2.0**-12  # far below its row's largest run
    step, e, scale, inv = (np.asarray(a) for a in
                           jax.jit(lambda a: codec_spec.scale_parts(a, 127.0))(amax))
    s = (amax * np.float32(1 / 127)).astype(np.float64)
    finite = np.isfinite(s)
    m = np.where(finite, s, 0).max(-1)
    frac, exp = np.frexp(m)
    want_e = np.clip(np.where(frac == 0.5, exp - 1, exp), -100, 126)
    want_e[m == 0] = -100
    np.testing.assert_array_equal(e[:, 0], want_e)
    k = np.arange(255)
    grid = np.exp2(want_e[:, None] - k // 32) * (64 - k % 32) / 64  # [rows, 255], decreasing
    assert (np.diff(grid, axis=1) < 0).all()
    assert (grid.astype(ml_dtypes.bfloat16).astype(np.float64) == grid).all()
    want = np.where(finite, (grid[:, None, :] >= s[..., None]).sum(-1) - 1, codec_spec.NOT_FINITE)
    np.testing.assert_array_equal(step, want)
    assert step[5, 1] == 254 and (step[2] == 254).all() and step[1, 5] == step[3, 2] == 255
    rows = np.arange(64)[:, None].repeat(12, 1)
    chosen = grid[rows, np.minimum(want, 254)].astype(np.float32)
    np.testing.assert_array_equal(scale[finite], chosen[finite])
    np.testing.assert_array_equal(inv[finite], (1 / chosen[finite]).astype(np.float32))
    assert np.isnan(scale[~finite]).all() and (inv[~finite] == 0).all()
    assert (scale[finite] >= s[finite]).all()


@pytest.mark.parametrize("code", ["int8", "int4"])
def test_unrotating_the_codes_is_decoding_then_unrotating_bit_for_bit(code):
    """The all-gather's decode rotates the integer codes back and scales once
    (groups.unrotate_codes); that is exact, so it must equal decode-then-unrotate bitwise, for
    scales from tiny to huge and with non-finite groups."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, 128)).astype(np.float32)
    x *= np.exp(rng.uniform(-60, 60, (2, 6, 4, 1))).repeat(32, -1).reshape(x.shape)
    x[0, 0, :32] = 0.0
    x[0, 1, 40] = np.nan
    x[1, 2, 100] = -np.inf
    x[1, 3, :32] = 1e-40
    shape = (2, 6, 128)
    wire = _encode(jnp.asarray(x), 32, code)
    want = _unrotate(_decode(wire, 32, code, shape), 32)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = _unrotate_codes(*_wire_parts(wire, (6, 128), 32, code), 32, code, dtype)
        assert got.dtype == dtype and got.shape == shape
        assert_same_bits(got, want.astype(dtype))


@pytest.mark.parametrize("g", [32, 64])
def test_unrotating_fp8_codes_rounds_once(g):
    """e4m3 codes' rotated sums are exact (multiples of 2^-9 below 2^9, groups of up to 64), so
    un-rotating the codes and scaling once is the exact value rounded once: float64's, rounded
    to float32 (then to bfloat16). Decoding first rounds partial sums and can be further off."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 256)).astype(np.float32)
    x *= np.exp(rng.uniform(-40, 40, (2, 6, 256 // g, 1))).repeat(g, -1).reshape(x.shape)
    x[0, 0, :g] = 0.0
    x[0, 1, 3] = np.nan
    wire = _encode(jnp.asarray(x), g, "fp8")
    codes, steps, exponents = _wire_parts(wire, (6, 256), g, "fp8")
    q = np.asarray(np.asarray(codes).view(ml_dtypes.float8_e4m3fn), np.float64).reshape(-1, g)
    s = np.asarray(jax.jit(codec_spec.row_scales)(steps, exponents), np.float64).reshape(-1, 1)
    exact = (q @ codec_spec.rotation(g).T.astype(np.float64)) * (s / g)
    want32 = exact.astype(np.float32).reshape(2, 6, 256)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = _unrotate_codes(codes, steps, exponents, g, "fp8", dtype)
        assert got.dtype == dtype and got.shape == (2, 6, 256)
        assert_same_bits(got, jnp.asarray(want32).astype(dtype))
    assert np.isnan(want32[0, 1, :g]).all() and not want32[0, 0, :g].any()
    # Decode-then-unrotate is within a few float32 roundings of it.
    twice = np.asarray(_unrotate(_decode(wire, g, "fp8", (2, 6, 256)), g))
    ok = np.isfinite(want32)
    np.testing.assert_allclose(twice[ok], want32[ok], rtol=1e-5, atol=0)


def test_rotation_is_invertible_and_orthogonal_up_to_its_scale():
    m = codec_spec.rotation(32)
    np.testing.assert_array_equal(m @ m.T, 32 * np.eye(32, dtype=np.float32))
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    y = np.asarray(_unrotate(_rotate(jnp.asarray(x), 32), 32))
    np.testing.assert_allclose(y, x, rtol=0, atol=1e-5)
    # A bfloat16 message is widened by its bits: the same rotation as of its float32 copy.
    xb = jnp.asarray(x, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(_rotate(xb, 32)),
                                  np.asarray(_rotate(xb.astype(jnp.float32), 32)))


def test_auto_picks_two_shot_on_switched_links_and_the_ring_for_large_messages_on_a_torus():
    assert schedule.choose(2, 1 << 30, "ring") == "twoshot"  # the same sends either way
    for n in (4, 8, 16):
        assert schedule.choose(n, 1 << 30, "switched") == "twoshot"
        assert schedule.choose(n, 64 << 20, "ring") == "full"
        assert schedule.choose(n, 1 << 10, "ring") == "twoshot"  # latency-bound
    assert schedule.two_shot_link_load(4) == 2 and schedule.two_shot_link_load(16) == 32
    cfg = AllReduceConfig("int8", topology="ring")
    assert resolved_variant(cfg, 16, 64 << 20) == "full"
    assert resolved_variant(AllReduceConfig("int8", "semi"), 16, 1) == "semi"
    # This machine has no TPU: "auto" topology means switched.
    assert resolved_variant(AllReduceConfig("int8"), 16, 64 << 20) == "twoshot"


def test_two_shot_quantizes_each_value_twice_whatever_n():
    """Error of int8 two-shot does not grow with N the way the ring's does (N-1 re-quantizations
    of a growing partial sum): from 4 to 8 devices its rms error relative to the sum stays
    within 1.3x, while the full ring's grows by more."""
    rel = {}
    rng = np.random.default_rng(4)
    for n in (4, 8):
        x = rng.standard_normal((n, 64, 640)).astype(np.float32)
        exact = x.astype(np.float64).sum(0)
        outs = _reduce(n, [AllReduceConfig("int8", "twoshot"), AllReduceConfig("int8", "full")], x)
        rel[n] = [np.sqrt(np.mean((o[0] - exact) ** 2) / np.mean(exact**2)) for o in outs]
    assert rel[8][0] < 1.3 * rel[4][0], rel
    assert rel[8][1] / rel[4][1] > rel[8][0] / rel[4][0], rel


@pytest.mark.parametrize("n,labels", [(2, ["int8", "int8-full", "int4/64"]),
                                      (4, ["int8", "int8-semi", "fp8-full"])])
def test_rotated_input_skips_the_forward_rotation_bitwise(n, labels):
    """all_reduce(rotate_rows(x), rotated=True) is bitwise all_reduce(x): what a model whose
    weights carry the rotation (groups.fold_rotation) hands in. Paths that do not rotate (a
    message under min_bytes goes to the psum) un-rotate the input first."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 12, 256)).astype(np.float32)
    x[:, :, 5] *= 40
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    for label in labels + ["int8@min_bytes"]:
        name, _, small = label.partition("@")
        cfg = AllReduceConfig.from_label(name, min_bytes=1 << 30 if small else 0)
        g = cfg.group_size
        rotated = np.asarray(jax.jit(lambda v: groups.rotate_rows(v.reshape(-1, 256), g))(x))
        rotated = rotated.reshape(x.shape)

        def run(v, flag):
            body = lambda a: all_reduce(a[0], "tp", cfg, rotated=flag)[None]  # noqa: E731
            return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"),
                                                    out_specs=P("tp")))(v))

        want = run(x, False)
        got = run(rotated, True)
        if small:  # the psum of un-rotated inputs: the same sum, rounded differently
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
        else:
            assert np.array_equal(got, want), label
    with pytest.raises(ValueError, match="rotated=True"):
        cfg = AllReduceConfig("int8", "full", blocks="tile")
        jax.jit(jax.shard_map(lambda a: all_reduce(a[0], "tp", cfg, rotated=True)[None],
                              mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(x)


def test_fold_rotation_moves_the_rotation_into_the_weights():
    """x @ fold_rotation(w) equals rotate(x @ w) up to float32 rounding; shapes that the
    groups do not tile are refused."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 48)).astype(np.float32)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    folded = np.asarray(jax.jit(groups.fold_rotation, static_argnums=1)(jnp.asarray(w), 32))
    want = np.asarray(_rotate(jnp.asarray(x @ w), 32))
    np.testing.assert_allclose(x @ folded, want, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="multiple of 32"):
        groups.fold_rotation(np.zeros((4, 40), np.float32), 32)
