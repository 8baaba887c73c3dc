"""The decoded-weights cache: entries round-trip bit for bit, are keyed by the GGUF file (its
content, not only its size and mtime), the decoder and dtype, replace stale or broken versions,
respect their size limit, never fail a load, and make a real restart skip the GGUF decode."""
from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import pytest

from models.gemma3 import weights_cache as wc
from testkit import assert_same_bytes


def _tree(rng, dtype):
    return {"embedder": {"input_embedding": rng.standard_normal((64, 24)).astype(dtype)},
            "final_norm": {"scale": rng.standard_normal(24).astype(np.float32)},
            "layer_0": {"mlp": {"linear": rng.standard_normal((3, 5, 7)).astype(dtype)}}}


def _leaves(tree):
    return {path: a for path, a in wc.tree_items(tree)}


def _write_gguf(path, seed: int) -> None:
    """A small GGUF file (its header and tensor data make the key, not its meaning): another
    seed, another file of the same size."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tensor("token_embd.weight",
                 np.random.default_rng(seed).standard_normal((512, 64)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "model.gguf"
    _write_gguf(path, seed=0)
    return path


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_round_trip_is_exact_and_read_only(tmp_path, source, dtype):
    cache = tmp_path / "cache"
    tree = _tree(np.random.default_rng(0), dtype)
    assert wc.load(cache, source, dtype) is None
    assert wc.store(cache, source, dtype, wc.tree_items(tree))
    back = wc.load(cache, source, dtype)
    want, got = _leaves(tree), _leaves(back)
    assert list(got) == list(want)
    for path, a in want.items():
        assert got[path].dtype == a.dtype and got[path].shape == a.shape
        assert_same_bytes(got[path], a)
        assert not got[path].flags.writeable
    # Each array starts at a page boundary of the mapped file.
    assert all(a.ctypes.data % 4096 == got[("embedder", "input_embedding")].ctypes.data % 4096
               for a in got.values())


def test_entries_follow_the_file_and_the_dtype(tmp_path, source):
    cache = tmp_path / "cache"
    rng = np.random.default_rng(1)
    assert wc.store(cache, source, np.float32, wc.tree_items(_tree(rng, np.float32)))
    assert wc.store(cache, source, ml_dtypes.bfloat16, wc.tree_items(_tree(rng, ml_dtypes.bfloat16)))
    assert len(os.listdir(cache)) == 2  # one entry per dtype
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed
    assert wc.load(cache, source, np.float32) is None
    newer = _tree(rng, np.float32)
    assert wc.store(cache, source, np.float32, wc.tree_items(newer))
    assert len(os.listdir(cache)) == 2  # the stale float32 entry is gone, bf16 stays
    np.testing.assert_array_equal(wc.load(cache, source, np.float32)["final_norm"]["scale"],
                                  newer["final_norm"]["scale"])


def test_a_file_replaced_at_the_same_size_and_mtime_is_not_served_stale(tmp_path, source,
                                                                       monkeypatch):
    """A GGUF replaced by another of the same size with its mtime kept (cp -p, rsync -t, images
    that pin mtimes) misses the old entry, as does the same file decoded by another version of
    the gguf package."""
    from models.gemma3 import gguf as G

    cache = tmp_path / "cache"
    assert wc.store(cache, source, np.float32, wc.tree_items(_tree(np.random.default_rng(4),
                                                                   np.float32)))
    assert wc.load(cache, source, np.float32) is not None
    before = source.stat()
    _write_gguf(source, seed=1)
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = source.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert wc.load(cache, source, np.float32) is None
    # The in-process parse follows the new file too.
    np.testing.assert_array_equal(
        G.open_gguf(source).tensor("token_embd.weight"),
        np.random.default_rng(1).standard_normal((512, 64)).astype(np.float32))

    assert wc.store(cache, source, np.float32, wc.tree_items(_tree(np.random.default_rng(5),
                                                                   np.float32)))
    assert wc.load(cache, source, np.float32) is not None
    monkeypatch.setattr(wc, "_library_versions", lambda: "gguf=0.0.1")
    assert wc.load(cache, source, np.float32) is None


def test_broken_entry_is_replaced(tmp_path, source):
    cache = tmp_path / "cache"
    tree = _tree(np.random.default_rng(2), np.float32)
    assert wc.store(cache, source, np.float32, wc.tree_items(tree))
    (entry,) = cache.iterdir()
    data = entry / wc.WEIGHTS_FILE
    data.write_bytes(data.read_bytes()[:-100])  # truncated
    assert wc.load(cache, source, np.float32) is None
    assert not entry.exists()
    assert wc.store(cache, source, np.float32, wc.tree_items(tree))
    np.testing.assert_array_equal(wc.load(cache, source, np.float32)["layer_0"]["mlp"]["linear"],
                                  tree["layer_0"]["mlp"]["linear"])


def test_limits_and_unwritable_places_only_cost_the_speed_up(tmp_path, source):
    tree = _tree(np.random.default_rng(3), np.float32)
    assert not wc.store(tmp_path / "small", source, np.float32, wc.tree_items(tree), max_bytes=4096)
    assert wc.load(tmp_path / "small", source, np.float32) is None
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert not wc.store(blocker, source, np.float32, wc.tree_items(tree))
    assert wc.load(blocker, source, np.float32) is None


def test_a_store_cut_short_leaves_no_entry_and_its_leftovers_go(tmp_path, source):
    """A store failing after it wrote part of an entry leaves none (the entry is written beside
    its place and renamed); what a writer killed mid-store left beside is removed by a later
    store of the same file, once old enough that no live writer can own it."""
    import time

    class FailsMidway:  # the second array: the disk fills up while it is written
        nbytes, shape, dtype = 4, (1,), np.dtype(np.float32)

        def __array__(self, dtype=None, copy=None):
            raise OSError("disk full")

    cache = tmp_path / "cache"
    tree = _tree(np.random.default_rng(4), np.float32)
    items = wc.tree_items(tree)
    assert not wc.store(cache, source, np.float32, [items[0], (("x",), FailsMidway())])
    assert list(cache.iterdir()) == [] and wc.load(cache, source, np.float32) is None

    _, tag = wc.entry_key(source, np.float32)
    dead, live = cache / f".{tag}-dead.1", cache / f".{tag}-live.2"
    for d in (dead, live):
        d.mkdir()
        (d / wc.WEIGHTS_FILE).write_bytes(b"partial")
    hours_ago = time.time() - 7200
    os.utime(dead, (hours_ago, hours_ago))
    assert wc.store(cache, source, np.float32, items)
    assert not dead.exists() and live.exists()
    assert wc.load(cache, source, np.float32) is not None


@pytest.mark.slow
def test_restart_maps_the_decoded_and_the_quantized_weights(tmp_path, monkeypatch):
    """The real 270M GGUF: the first load decodes and fills the cache; an int8 load then
    quantizes the cached decoded tree (no decoding) and keeps its result too. Restarts of both
    neither decode nor quantize, and place bit-identical weights, which give bit-identical
    logits."""
    from models.gemma3 import gguf, load_model, programs
    from models.gemma3.quantization import quantize

    cache = tmp_path / "weights"
    prompt = [[2, 818, 5279, 529, 7001, 563]]

    def load(**kw):
        return load_model("gemma3-270m", tp=2, dtype="bfloat16", weights_cache_dir=cache, **kw)

    def leaves(m):
        return [np.asarray(a) for a in jax.tree.leaves(m.weights)]

    def never(*args, **kwargs):
        raise AssertionError("decoded or quantized again")

    first = load()
    # One forward pass (one program, not generate's prefill and decode step), compared bit for
    # bit rather than by its greedy tokens.
    want, want_logits = leaves(first), first.score(prompt)
    del first
    monkeypatch.setattr(gguf, "load_gguf_params", never)
    quantized = load(quantization="int8")
    want_q = leaves(quantized)
    del quantized
    assert len(list(cache.iterdir())) == 2  # the decoded tree and the quantized weights
    monkeypatch.setattr(programs, "quantize", never)
    for kw, expected in (({}, want), ({"quantization": "int8"}, want_q)):
        second = load(**kw)
        got = leaves(second)
        assert [a.dtype for a in got] == [a.dtype for a in expected]
        for a, b in zip(got, expected):
            assert_same_bytes(a, b)
        if not kw:
            np.testing.assert_array_equal(second.score(prompt), want_logits)
        del second
    # Another group size is another entry, beside the per-channel one, restarted the same way.
    monkeypatch.setattr(programs, "quantize", quantize)
    grouped = dict(quantization="int8", quantization_group_size=32)
    want_g = leaves(load(**grouped))
    assert len(list(cache.iterdir())) == 3
    monkeypatch.setattr(programs, "quantize", never)
    for a, b in zip(leaves(load(**grouped)), want_g, strict=True):
        assert_same_bytes(a, b)
