"""equarx.native_cpu: the CPU kernel that un-rotates int8, int4 and fp8 codes gives
groups.unrotate_codes' pure-JAX bits (AVX-512, AVX2 and plain builds, bfloat16 and float32, NaN /
Inf / zero / tiny groups, vmap, inside the collective; fp8 NaNs as NaNs), is what the CPU
program runs, and falls back cleanly."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from equarx import AllReduceConfig, all_reduce, groups, native_cpu

G = 32


CODES = ["int8", "int4", "fp8"]


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype == jnp.bfloat16 else np.uint32)


def _assert_same(got, want):
    """Bit for bit, except that a NaN only has to be a NaN (fp8's NaN codes: the sum's NaN
    payload follows the order of the additions)."""
    nan = np.isnan(np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.isnan(np.asarray(got, np.float32)), nan)
    np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan])


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
    wire = groups.encode(groups.rotate(jnp.asarray(x), G), G, code)
    return groups.wire_parts(wire, (1, width))


def _pure(codes, scale_bytes, dtype, code="int8"):
    return groups.unrotate_codes(codes, scale_bytes, G, code, dtype, native=False)


def test_the_kernel_builds_here():
    assert native_cpu.compiler() is not None
    assert native_cpu.available()


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_same_bits_as_the_pure_form(dtype, code):
    codes, scale_bytes = _wire(64, code=code)
    native = jax.jit(lambda c, s: groups.unrotate_codes(c, s, G, code, dtype))
    assert native_cpu.TARGET in native.lower(codes, scale_bytes).as_text()
    got = native(codes, scale_bytes)
    want = jax.jit(_pure, static_argnums=(2, 3))(codes, scale_bytes, dtype, code)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == (64, 1, 1024)
    if code == "fp8":
        _assert_same(got, want)
    else:
        np.testing.assert_array_equal(_bits(got), _bits(want))
    # Every edge case is there: a NaN group, an Inf group, +0 groups (not -0), finite values.
    out = np.asarray(got, np.float32).reshape(-1, G)
    assert np.isnan(out).any() and np.isfinite(out).any()
    assert (_bits(got).reshape(-1, G)[3 * 32] == 0).all()  # row 3's groups: +0.0, bit for bit


def test_leading_shapes_and_vmap():
    codes, scale_bytes = _wire(48, width=256, seed=1)
    c, s = codes.reshape(4, 12, 1, 256), scale_bytes.reshape(4, 12, 1, 16)
    want = _pure(c, s, jnp.bfloat16)
    np.testing.assert_array_equal(
        _bits(groups.unrotate_codes(c, s, G, "int8", jnp.bfloat16)), _bits(want))
    vmapped = jax.vmap(lambda a, b: groups.unrotate_codes(a, b, G, "int8", jnp.bfloat16))
    np.testing.assert_array_equal(_bits(vmapped(c, s)), _bits(want))


@pytest.mark.parametrize("arch", ["x86-64-v3", "x86-64"])
def test_the_other_builds_give_the_same_bits(arch, tmp_path):
    """The AVX2 path (x86-64-v3: no AVX-512) and the plain loop kept for any other processor and
    group size (x86-64), each built and called beside the default build."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the other builds are checked on x86-64")
    lib = native_cpu.build(native_cpu.compiler(), arch=arch, directory=tmp_path)
    target = f"equarx_test_unrotate_{arch.replace('-', '_')}"
    native_cpu.register(lib, target)
    for code in CODES:
        codes, scale_bytes = _wire(64, seed=2, code=code)
        for dtype in (jnp.bfloat16, jnp.float32):
            got = jax.jit(lambda c, s, d=dtype, k=code: native_cpu.unrotate(
                c, s, groups.rotation(G).T, k, d, target=target))(codes, scale_bytes)
            _assert_same(got, _pure(codes, scale_bytes, dtype, code))


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
    assert native_cpu.TARGET in f.lower(jnp.asarray(x, jnp.bfloat16)).as_text()
    monkeypatch.setattr(native_cpu, "available", lambda: False)
    f, pure = run()
    assert native_cpu.TARGET not in f.lower(jnp.asarray(x, jnp.bfloat16)).as_text()
    _assert_same(native, pure)


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
        codes, scale_bytes = _wire(8, edges=False)
        f = jax.jit(lambda c, s: groups.unrotate_codes(c, s, G, "int8", jnp.bfloat16))
        assert native_cpu.TARGET not in f.lower(codes, scale_bytes).as_text()
        monkeypatch.setenv("EQUARX_NATIVE_CPU", "0")
        monkeypatch.delenv("CXX")
        native_cpu._load.cache_clear()
        assert not native_cpu.available()  # switched off: no build is tried
        assert not list(tmp_path.glob("*.so*"))
    finally:
        native_cpu._load.cache_clear()
