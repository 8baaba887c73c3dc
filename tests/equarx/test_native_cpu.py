"""equarx.native_cpu: the CPU kernels give the pure-JAX forms' bits (a NaN where they have a
NaN, of any bits: equarx.groups, "NaN"; testkit.assert_same_bits) and are what the CPU program
runs. The un-rotation of int8, int4 and fp8 codes (groups.unrotate_codes): bfloat16 and float32,
NaN / Inf / zero / tiny groups, vmap, inside the collective. The encode with its sum
(codecs.encode_sum): a strided piece of a bfloat16 or float32 buffer read in place with 0-2
arrivals, zero / tiny / huge groups, NaN and Inf groups decoded as NaN, bad geometry refused.
The product with grouped int8 weights: each group's sum then its scale, a row's bits whatever
rows beside it. The AVX-512, AVX2 and plain builds each against the pure-JAX form (the product:
the same bits in every build). Both fall back cleanly."""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from equarx import AllReduceConfig, all_reduce, codec_spec, codecs, groups, native_cpu
from equarx.layout import plan_token_layout
from testkit import NATIVE_BUILDS, assert_same_bits, native_build_targets

G = 32


CODES = ["int8", "int4", "fp8"]


def _wire(rows: int, width: int = 1024, seed: int = 0, edges: bool = True, code: str = "int8"):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    x *= np.exp(3 * rng.standard_normal((rows, 1))).astype(np.float32)  # scales far apart
    if edges:
        x[1, 40] = np.nan
        x[2, 100] = -np.inf
        x[3] = 0.0
        x[4, :G] = 1e-40  # a group whose scale is subnormal
        x[5, :G] = 3e38
        x[6, 7] = 1e-30  # one value far below its group's step: rounds to a zero code
        # A normal scale over 32 below the normal range: XLA:CPU flushes such results to
        # zero, and the kernel, run on its threads, does the same.
        x[7, :G] = rng.standard_normal(G) * 1e-36
    return jax.jit(lambda v: codec_spec.wire_parts(groups.encode(groups.rotate(v, G), G, code),
                                                   (1, width), G, code))(x)


def _pure(codes, steps, exponents, dtype, code="int8"):
    # Compiled, as the collective runs it (one program, not one per eager op).
    return jax.jit(lambda *p: groups.unrotate_codes(*p, G, code, dtype, native=False))(
        codes, steps, exponents)


def _decode(wire, code, shape):
    return np.asarray(jax.jit(lambda w: codec_spec.decode(w, G, code, shape))(wire))


def test_the_kernel_builds_here():
    assert native_cpu.compiler() is not None
    assert native_cpu.available()


def test_leading_shapes_and_vmap():
    codes, steps, exponents = _wire(48, width=256, seed=1)
    parts = (codes.reshape(4, 12, 1, 256), steps.reshape(4, 12, 1, 256 // G),
             exponents.reshape(4, 12, 1, 1))
    want = _pure(*parts, jnp.bfloat16)
    assert_same_bits(groups.unrotate_codes(*parts, G, "int8", jnp.bfloat16), want)
    vmapped = jax.vmap(lambda *p: groups.unrotate_codes(*p, G, "int8", jnp.bfloat16))
    assert_same_bits(vmapped(*parts), want)


@pytest.mark.parametrize("arch", list(NATIVE_BUILDS))
def test_each_instruction_set_build_puts_the_gathered_pieces_in_place(arch):
    """Each build's all-gather end against the pure-JAX form, every code, both dtypes (its
    un-rotation and encode with its sum: tests/equarx/test_codec_conformance.py)."""
    _, _, gather_target, matmul_target = native_build_targets(arch, "_test_")
    for code in CODES:
        for dtype in (jnp.bfloat16, jnp.float32):
            _check_gather(code, dtype, device=1, target=gather_target)
    x, codes, scale = _grouped_operands(13, 128, 72, 32, jnp.bfloat16)
    product = jax.jit(lambda *a: native_cpu.grouped_matmul(*a, target=matmul_target))
    assert_same_bits(product(x, codes, scale), jax.jit(native_cpu.grouped_matmul)(x, codes, scale))


def _grouped_operands(rows: int, k: int, n: int, group: int, scale_dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    codes = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = rng.random((k // group, n)).astype(np.float32) * 1e-2
    return jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scale, scale_dtype)


@pytest.mark.parametrize("rows,k,n,group,scale_dtype", [
    (1, 64, 32, 32, jnp.float32), (3, 128, 40, 32, jnp.bfloat16),  # a short column block
    (8, 640, 1024, 32, jnp.bfloat16), (17, 256, 100, 64, jnp.float32)])  # a short row tile
def test_grouped_matmul_sums_each_group_then_scales(rows, k, n, group, scale_dtype):
    """out[r, n] = sum_j scale[j, n] * sum_{k in group j} x[r, k] * codes[k, n], to float32
    rounding, and each row's bits the same alone as beside the others (batch invariance)."""
    x, codes, scale = _grouped_operands(rows, k, n, group, scale_dtype)
    product = jax.jit(native_cpu.grouped_matmul)
    got = np.asarray(product(x, codes, scale))
    parts = np.einsum("rjg,jgn->rjn", np.asarray(x, np.float64).reshape(rows, -1, group),
                      np.asarray(codes, np.float64).reshape(-1, group, n))
    want = np.einsum("rjn,jn->rn", parts, np.asarray(scale.astype(jnp.float32), np.float64))
    assert np.max(np.abs(got - want)) < 1e-6 * np.max(np.abs(want))
    alone = np.concatenate([np.asarray(product(x[r:r + 1], codes, scale)) for r in range(rows)])
    assert_same_bits(alone, got)


def _check_gather(code: str, dtype, device: int, target: str = native_cpu.GATHER_TARGET):
    """gather_unrotate of 3 shards x 2 pieces (one of 1 minishard, one of 2) against each piece
    un-rotated by the pure form and put at its shard (device + r) % 3 by hand."""
    layout = dataclasses.replace(plan_token_layout((96, 3 * 256), 3, 3, granule=G),
                                 minishards=3, rows_per_minishard=32)
    pieces = [(0, 1), (1, 3)]
    rng = np.random.default_rng(6)
    piece_codec = codecs.GroupCodec(G, code, layout.piece_shape)

    def values(minishards):
        v = rng.standard_normal((minishards, 32, 256)) * 3
        v[0, 0, :G] = 0.0  # a zero run, a NaN run, an Inf run
        v[0, 1, 5] = np.nan
        v[0, 2, 9] = -np.inf
        return jnp.asarray(v, jnp.float32)

    encode = jax.jit(piece_codec.encode)
    rows = [[encode(values(b - a)) for a, b in pieces] for _ in range(3)]
    got = jax.jit(lambda d, *w: native_cpu.gather_unrotate(
        d, w, codec_spec.rotation(G).T, code, dtype, (3, 32, 3, 1, 256),
        [layout.piece_geometry(*p) for p in pieces], target=target))(
        jnp.int32(device), *[w for row in rows for w in row])
    want = np.zeros((3, 32, 3, 1, 256), np.float32)
    pure = jax.jit(lambda w: groups.unrotate_codes(*piece_codec.wire_parts(w), G, code, dtype,
                                                   native=False))
    for r, row in enumerate(rows):
        for (a, b), wire in zip(pieces, row):
            values = pure(wire)
            want[a:b, :, (device + r) % 3, 0] = np.asarray(values, np.float32)
    assert_same_bits(got, jnp.asarray(want, dtype))


@pytest.mark.parametrize("code", CODES)
def test_gather_unrotate_puts_every_piece_in_place(code):
    assert native_cpu.available()
    for device in range(3):
        _check_gather(code, jnp.bfloat16 if device else jnp.float32, device)


def _summands(dtype, code: str, seed: int = 0, edges: bool = True, non_finite: bool = False):
    """(layout, buffer, two arrivals) for encode_sum: 2 shards of 4 minishards of 32 rows of
    512 columns; the buffer's values spread far apart from row to row, with edge cases (and
    NaN and Inf runs in shard 1's minishards 1 and 2); each arrival holds all 4 minishards (a
    piece's are arrival[j0:j1])."""
    # Four minishards (the planner keeps a piece of a message this small whole).
    layout = dataclasses.replace(plan_token_layout((128, 1024), 2, 4, granule=G), minishards=4,
                                 rows_per_minishard=32)
    assert layout.width == 512
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((128, 1024)).astype(np.float32)
    x *= np.exp(3 * rng.standard_normal((128, 1))).astype(np.float32)
    if edges:
        x[32:34] = 0.0  # zero groups (minishard 1)
        x[34, 512:512 + G] = 1e-40  # a group whose scale would be subnormal
        x[35, 520:600] = 3e38  # huge values: their sums with the arrivals overflow
        x[36, 530] = 1e-30  # far below its group's step: a zero code
        x[37, 512 + G:512 + 2 * G] = x[37, 512 + 2 * G] * np.arange(G) / 2  # exact ties (bf16)
    if non_finite:
        x[38, 512 + 40] = np.nan
        x[39, 512 + 100] = -np.inf
        x[70, 512 + 300] = np.inf
    buf = jax.jit(layout.split)(jnp.asarray(x, dtype))
    encode = jax.jit(codecs.GroupCodec(G, code, layout.piece_shape).encode)
    arrivals = [encode(jnp.asarray(rng.standard_normal((4, 32, 512)), jnp.float32) * 4)
                for _ in range(2)]
    return layout, buf, arrivals


def _encode_sum(buf, layout, shard, piece, arrivals, code, native=True):
    """codecs.encode_sum of the piece with the arrivals' minishards of it, kernel on or off."""
    arrivals = [a[piece[0]:piece[1]] for a in arrivals]
    codec = codecs.GroupCodec(G, code, layout.piece_shape)
    with pytest.MonkeyPatch.context() as mp:
        if not native:
            mp.setattr(native_cpu, "in_use", lambda: False)
        f = jax.jit(lambda b, s, *a: codecs.encode_sum(codec, b, layout, s, piece, a))
        text = f.lower(buf, jnp.int32(shard), *arrivals).as_text()
        assert (native_cpu.ENCODE_TARGET in text) == native
        return np.asarray(f(buf, jnp.int32(shard), *arrivals))


@pytest.mark.parametrize("code,dtype", [("int4", jnp.float32)])
def test_encode_sum_gives_the_pure_bits(dtype, code):
    """A strided piece read in place at a run-time shard, with 0, 1 and 2 arrivals added, every
    edge case of _summands in it, against the pure-JAX form (the same function, kernel off):
    the pieces' places in the buffer (every code and dtype against the specification:
    tests/equarx/test_codec_conformance.py)."""
    layout, buf, arrivals = _summands(dtype, code)
    for shard, piece in ((0, (0, 1)), (1, (1, 3)), (1, (3, 4))):
        for n in range(3):
            got = _encode_sum(buf, layout, shard, piece, arrivals[:n], code)
            want = _encode_sum(buf, layout, shard, piece, arrivals[:n], code, native=False)
            codes = 32 * 512 // (2 if code == "int4" else 1)  # 32 rows of 512 per minishard
            assert got.shape == want.shape == (piece[1] - piece[0], codes + 32 * (512 // G + 1))
            assert_same_bits(got, want)
            if (piece, n) == ((1, 3), 0):  # the edge cases are in what was compared
                out = _decode(got, code, (2, 32, 512))
                assert (out[0, :2] == 0).all() and (out[0, 2, :G] == 0).all()  # zero, tiny
                assert np.isclose(out[0, 3, 8:88], 3e38, rtol=0.1).all()  # huge
                assert out[0, 4, 18] == 0 and np.isfinite(out).all()


def test_fp8_encode_rounds_ties_to_even_as_xla():
    """fp8 codes of every midpoint between neighbouring e4m3 values (subnormals included), and
    of the float32 values either side of each, in runs whose scale is exactly 1 (absmax 447:
    447 / 448 rounds up to 1 on the 5-bit grid): the kernel's codes are the pure form's (XLA's
    conversion), and both are ml_dtypes' round-half-to-even."""
    layout = dataclasses.replace(plan_token_layout((128, 1024), 2, 4, granule=G), minishards=4,
                                 rows_per_minishard=32)
    e4m3 = np.arange(1, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = ((e4m3[:-1].astype(np.float64) + e4m3[1:]) / 2).astype(np.float32)
    values = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)])
    values *= np.where(np.random.default_rng(8).random(values.size) < 0.5, -1, 1)
    runs = values[:len(values) // 31 * 31].reshape(-1, 31)
    x = np.zeros((128, 1024), np.float32)
    cells = x.reshape(-1, G)
    at = np.arange(len(runs)) * 17  # runs in both shards' columns (a row holds 32 runs)
    cells[at, 0] = 447.0
    cells[at, 1:] = runs
    buf = jax.jit(layout.split)(jnp.asarray(x))
    for shard in (0, 1):
        got = _encode_sum(buf, layout, shard, (0, 4), [], "fp8")
        assert_same_bits(got, _encode_sum(buf, layout, shard, (0, 4), [], "fp8", native=False))
        decoded = _decode(got, "fp8", (4, 32, 512))
        values = np.asarray(layout.piece(buf, shard, 0, 4))
        assert (values == 447).sum() >= len(runs) // 3  # the runs are in these pieces
        np.testing.assert_array_equal(
            decoded, values.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_encode_sum_keeps_a_nan_group_nan():
    """A NaN or Inf makes its whole group decode as NaN (scale Inf), whatever the rest of the
    group holds, in both forms; the other groups' bits are the same."""
    layout, buf, arrivals = _summands(jnp.float32, "int8", seed=4, edges=False)
    x = np.asarray(buf).copy()
    x[1, 3, 1, 0, 40] = np.nan  # minishard 1, row 3, shard 1: group 1 of the row
    x[1, 5, 1, 0, 100] = -np.inf  # row 5: group 3
    buf = jnp.asarray(x)
    got = _encode_sum(buf, layout, 1, (1, 2), arrivals[:1], "int8")
    out = _decode(got, "int8", (1, 32, 512)).reshape(32, 16, G)
    assert np.isnan(out[3, 1]).all() and np.isnan(out[5, 3]).all()
    bad = np.zeros((32, 16), bool)
    bad[3, 1] = bad[5, 3] = True
    assert np.isfinite(out[~bad]).all()
    want = _encode_sum(buf, layout, 1, (1, 2), arrivals[:1], "int8", native=False)
    assert_same_bits(got, want, wire=(layout.piece_shape, G, "int8"))
    assert_same_bits(out, _decode(want, "int8", (1, 32, 512)).reshape(32, 16, G))


def test_encode_sum_refuses_a_piece_outside_its_buffer():
    assert native_cpu.available()
    layout, buf, _ = _summands(jnp.float32, "int8", edges=False)
    f = jax.jit(lambda b, s: native_cpu.encode_sum(b, s, (), layout.piece_geometry(3, 4), G,
                                                   "int8"))
    assert f(buf, jnp.int32(1)).shape == (1, 32 * 512 + 32 * (512 // G + 1))
    with pytest.raises(Exception, match="outside the buffer"):
        f(buf, jnp.int32(2)).block_until_ready()
    with pytest.raises(Exception, match="shard index is outside"):
        f(buf, jnp.int32(-1)).block_until_ready()
    with pytest.raises(Exception, match="device index is outside"):
        _check_gather("int8", jnp.float32, device=3)


@pytest.mark.parametrize("label", ["int8", "int8-full", "int4", "fp8"])
def test_the_collective_gives_the_same_bits_either_way(label, monkeypatch):
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    x = np.random.default_rng(3).standard_normal((4, 24, 512)).astype(np.float32)
    cfg = AllReduceConfig.from_label(label)

    def run():
        f = jax.jit(jax.shard_map(lambda v: all_reduce(v[0], "tp", cfg)[None], mesh=mesh,
                                  in_specs=P("tp"), out_specs=P("tp")))
        return f, f(jnp.asarray(x, jnp.bfloat16))

    f, native = run()
    text = f.lower(jnp.asarray(x, jnp.bfloat16)).as_text()
    assert native_cpu.GATHER_TARGET in text
    assert native_cpu.ENCODE_TARGET in text
    monkeypatch.setattr(native_cpu, "available", lambda: False)
    f, pure = run()
    text = f.lower(jnp.asarray(x, jnp.bfloat16)).as_text()
    assert not any(target in text for target in native_cpu.TARGETS)
    assert_same_bits(native, pure)


def test_without_a_compiler_it_warns_once_and_runs_pure(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EQUARX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")  # a "compiler" that fails
    native_cpu._load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="equarx.native_cpu"):
            assert not native_cpu.available()
            assert not native_cpu.available()
        assert len([r for r in caplog.records if "pure JAX" in r.message]) == 1
        assert not list(tmp_path.glob("*.so*"))  # nothing half-written left behind
        parts = _wire(8, edges=False)
        f = jax.jit(lambda *p: groups.unrotate_codes(*p, G, "int8", jnp.bfloat16))
        assert native_cpu.TARGET not in f.lower(*parts).as_text()
        monkeypatch.setenv("EQUARX_NATIVE_CPU", "0")
        monkeypatch.delenv("CXX")
        native_cpu._load.cache_clear()
        assert not native_cpu.available()  # switched off: no build is tried
        assert not list(tmp_path.glob("*.so*"))
    finally:
        native_cpu._load.cache_clear()
