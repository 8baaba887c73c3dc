"""Hugging Face checkpoints against transformers, the second reference.

Reference: tests/golden/gemma3_270m_hf.npz, made by tests/golden/make_hf_golden.py with
transformers' own GGUF loader, tokenizer and chat templates (torch is not needed here). The
checkpoint under test is written by our writer from our own load of the real 270M (float32,
sharded safetensors with their index) and read back by our reader: bitwise the original's
weights at tp 4 (whose logits tests/models/test_parity.py checks against the official ones,
which transformers' match to 8e-6), served at tp 1 with transformers' greedy text; the golden
script checked once that transformers reads that writer's checkpoints with logits identical to
its own. A second golden, tests/golden/tiny_pattern_hf.npz
(make_pattern_golden.py), holds a small random checkpoint with another layer pattern (a global
layer every 3rd) and transformers' logits.
"""
import json

import jax
import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import CONFIGS, load_model
from models.gemma3.hf_checkpoint import (
    INDEX_FILE, HFCheckpointError, SafetensorsDir, SafetensorsFile, config_from_hf, config_to_hf,
    write_safetensors)
from models.gemma3.hf_tokenizer import (
    ChatTemplate, JsonTokenizer, read_tokenizer, save_tokenizer)
from models.gemma3.tokenizer import Tokenizer
from serving.chat_template import render_chat
from testkit import HF_GOLDEN_NPZ, PATTERN_GOLDEN_NPZ

pytestmark = pytest.mark.slow

F32 = AllReduceConfig(method="f32")
SHARD_BYTES = 400 << 20  # the 270M's 1.07 GB of float32 in two files


@pytest.fixture(scope="module")
def golden():
    data = np.load(HF_GOLDEN_NPZ)
    n = len(data["prompts"])
    out = {key: [data[f"{key}_{i}"] for i in range(n)]
           for key in ("tokens", "top_idx", "top_val", "greedy")}
    out["prompts"] = [str(p) for p in data["prompts"]]
    out["texts"] = [str(t) for t in data["tokenizer_texts"]]
    out["text_ids"] = [data[f"tokenizer_ids_{j}"].tolist() for j in range(len(out["texts"]))]
    out["chat_template"] = str(data["chat_template"])
    out["chats"] = json.loads(str(data["chat_messages"]))
    out["chat_ids"] = [data[f"chat_ids_{k}"].tolist() for k in range(len(out["chats"]))]
    return out


@pytest.fixture(scope="module")
def original():
    """Our own load of the real 270M (float32, from the GGUF)."""
    return load_model("gemma3-270m", dtype="float32", allreduce=F32)


@pytest.fixture(scope="module")
def hf_dir(original, golden, tmp_path_factory):
    """The 270M written by our writer, with Gemma 3's chat template in its tokenizer files."""
    path = tmp_path_factory.mktemp("hf") / "gemma3-270m"
    original.tokenizer.chat_template = ChatTemplate(golden["chat_template"])
    try:
        original.save(path, format="hf", max_shard_bytes=SHARD_BYTES)
    finally:
        original.tokenizer.chat_template = None
    return path


def test_round_trip_is_bitwise_and_sharded(original, hf_dir):
    """Write -> read gives the same bits; at tp=4 each device holds a quarter of a sharded
    tensor, read straight from the mapped files."""
    m = load_model(hf_dir, tp=4, dtype="float32", allreduce=F32)
    for a, b in zip(jax.tree.leaves(original.weights), jax.tree.leaves(m.weights)):
        assert a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))
    q = m.weights.layers[0].q  # [D, N, H], heads sharded
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // 4, q.shape[2])}


def test_sharded_files_and_index(hf_dir):
    index = json.loads((hf_dir / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    # The embedding (671 MB) is alone in its file; the other tensors fill the next one.
    assert len(files) == 2 and files[0].endswith("-of-00002.safetensors")
    assert [len(SafetensorsFile(hf_dir / f).entries) for f in files] == [1, 18 * 13 + 1]
    names = set(index["weight_map"])
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert len(names) == 2 + 18 * 13 and all(n.startswith("model.") for n in names)
    assert index["metadata"]["total_size"] == 4 * 268_098_176  # the 270M's parameters, float32
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["torch_dtype"] == "float32"
    assert json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"] == [1, 106]


def test_reads_as_the_safetensors_library_does(hf_dir):
    """Our reader and writer against the format's reference implementation."""
    import safetensors.numpy as safetensors_numpy
    files = SafetensorsDir(hf_dir)
    f = sorted(files.files.values(), key=lambda f: len(f.entries))[0]
    theirs = safetensors_numpy.load_file(f.path)
    assert set(theirs) == set(f.entries)
    for name, x in theirs.items():
        assert np.array_equal(x, f.tensor(name)), name


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny", tp=1, dtype="float32", allreduce=F32, seed=5)


def test_multimodal_layout_bfloat16_and_configs(tiny, tmp_path):
    """The text of a Gemma3ForConditionalGeneration (language_model.model.* names, a text_config
    with transformers' defaults left out), stored in bfloat16."""
    tiny.save(tmp_path / "causal", format="hf", dtype="bfloat16")
    causal = SafetensorsDir(tmp_path / "causal")
    text = {k: v for k, v in config_to_hf(tiny.config, "bfloat16").items()
            if k not in ("architectures", "query_pre_attn_scalar", "rms_norm_eps", "layer_types")}
    text["query_pre_attn_scalar"] = 16
    mm = tmp_path / "multimodal"
    mm.mkdir()
    tensors = {"language_model." + k: causal.tensor(k) for k in causal.where}
    write_safetensors(mm / "model.safetensors", tensors)
    (mm / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text}))
    m = load_model(mm, tp=2, dtype="bfloat16", allreduce=F32)
    assert m.config == tiny.config
    for a, b in zip(jax.tree.leaves(tiny.weights), jax.tree.leaves(m.weights)):
        assert b.dtype == jax.numpy.bfloat16
        assert np.array_equal(np.asarray(a).astype(jax.numpy.bfloat16), np.asarray(b))
    # bfloat16 files into a float32 model: the stored values, exactly.
    m32 = load_model(mm, tp=1, dtype="float32", allreduce=F32)
    for a, b in zip(jax.tree.leaves(m.weights), jax.tree.leaves(m32.weights)):
        assert b.dtype == np.float32 and np.array_equal(np.asarray(a).astype(np.float32), np.asarray(b))


def test_checkpoint_that_does_not_fit_its_config(tiny, tmp_path):
    tiny.save(tmp_path, format="hf", dtype="float32")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    with pytest.raises(HFCheckpointError, match="kv of layer 0 has shape"):
        load_model(tmp_path, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").unlink()
    files = {"model.embed_tokens.weight": np.zeros((512, 64), np.float32)}
    write_safetensors(tmp_path / "model.safetensors", files)
    with pytest.raises(HFCheckpointError, match=r"40 of the text model's 41 tensors are missing "
                       r"\(config.json's 3 layers\): model.norm.weight, "
                       r"model.layers.0.self_attn.q_proj.weight"):
        load_model(tmp_path, dtype="float32")



def _resized_entry(data: bytes) -> bytes:
    """A safetensors file whose first tensor's data_offsets span 4 bytes less than its shape and
    dtype need (the header rewritten at its own length)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"][1] -= 4
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    return data[:8] + text + b" " * (n - len(text)) + data[8 + n:]


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:4], "4 bytes: shorter than the 8-byte header length"),
    (lambda b: b[:1000], r"header of \d+ bytes runs past the end of the file \(1000 bytes\)"),
    (lambda b: (1 << 62).to_bytes(8, "little") + b[8:], "header of 4611686018427387904 bytes"),
    (lambda b: b[:8] + b"x" + b[9:], "invalid JSON header"),
    (lambda b: b[:-1000], r"truncated: model\.\S+ ends at byte \d+, the file has \d+"),
    (_resized_entry, r"holds \d+ bytes where its shape \[\d+, \d+\] in F32 needs \d+"),
])
def test_a_damaged_safetensors_file_is_named_with_what_is_wrong(tiny, tmp_path, damage, message):
    """A truncated download or a corrupt header: an HFCheckpointError that names the file and
    says what is wrong (it was a struct.error, a bare JSONDecodeError or MemoryError, or a
    shape error that blamed config.json)."""
    tiny.save(tmp_path, format="hf", dtype="float32")
    f = tmp_path / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    with pytest.raises(HFCheckpointError, match=message) as e:
        load_model(tmp_path, dtype="float32")
    assert str(f) in str(e.value)

def test_config_spellings():
    # google/gemma-3-27b-it's text_config: everything else is Gemma3TextConfig's default.
    published = {"text_config": {
        "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
        "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024}, "model_type": "gemma3"}
    c = config_from_hf(published)
    assert c == CONFIGS["27b"].replace(vocab_size=262_208, query_scale=c.query_scale)
    assert c.query_scale == pytest.approx(CONFIGS["27b"].query_scale, rel=1e-12)
    # transformers 5.x writes RoPE per layer type.
    v5 = {**config_to_hf(CONFIGS["4b"], "float32"), "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
        del v5[key]
    assert config_from_hf(v5) == CONFIGS["4b"]
    for bad in ({"final_logit_softcapping": 30.0},
                {"layer_types": ["full_attention", "sliding_attention"] * 17},
                {"layer_types": ["sliding_attention"] * 33}, {"sliding_window_pattern": 0},
                {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}},
                {"tie_word_embeddings": False}):
        with pytest.raises(HFCheckpointError):
            config_from_hf({**config_to_hf(CONFIGS["4b"], "float32"), **bad})


def test_layer_pattern_spellings():
    """The period of global layers: sliding_window_pattern, layer_types, or both."""
    every3 = CONFIGS["4b"].replace(global_every=3)
    hf = config_to_hf(every3, "float32")
    assert hf["sliding_window_pattern"] == 3 and hf["layer_types"][:3] == [
        "sliding_attention", "sliding_attention", "full_attention"]
    assert config_from_hf(hf) == every3
    listed = {k: v for k, v in hf.items() if k != "sliding_window_pattern"}
    assert config_from_hf(listed) == every3
    stated = {k: v for k, v in hf.items() if k != "layer_types"}
    assert config_from_hf(stated) == every3
    # The list wins over a stale pattern; every layer global is a period of 1.
    assert config_from_hf({**hf, "sliding_window_pattern": 6}) == every3
    assert config_from_hf({**hf, "layer_types": ["full_attention"] * 34}).global_every == 1
    # Only local layers (a model shorter than its period): the stated period is kept.
    short = CONFIGS["4b"].replace(num_layers=4)
    assert config_from_hf(config_to_hf(short, "float32")).global_every == 6


def test_another_layer_pattern_matches_transformers(tmp_path):
    """A checkpoint whose global layers come every 3rd (window 8, shorter than the prompts):
    logits within 1e-5 of transformers' (tests/golden/make_pattern_golden.py); read as the
    published sizes' every 6th instead, the same weights give other logits."""
    data = np.load(PATTERN_GOLDEN_NPZ)
    config = json.loads(str(data["config"]))
    write_safetensors(tmp_path / "model.safetensors",
                      {k.removeprefix("w/"): data[k] for k in data.files if k.startswith("w/")})
    seqs = [data[f"tokens_{i}"].tolist() for i in range(2)]

    def logits(cfg):
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        m = load_model(tmp_path, tp=2, dtype="float32", allreduce=F32)
        return m.config, m.score(seqs)

    c, got = logits(config)
    assert c.global_every == 3 and c.num_layers == 5 and c.sliding_window == 8
    misread = {k: v for k, v in config.items() if k != "layer_types"}
    c6, other = logits({**misread, "sliding_window_pattern": 6})
    assert c6.global_every == 6
    for i, s in enumerate(seqs):
        want = data[f"logits_{i}"]
        scale = np.abs(want).max()
        assert np.abs(got[i, :len(s)] - want).max() <= 1e-5 * scale, i
        assert np.abs(other[i, :len(s)] - want).max() > 1e-2 * scale, i


def test_tokenizer_json_and_model_agree_with_transformers(hf_dir, golden):
    """tokenizer.model (SentencePiece) and the tokenizer.json converted from it (the
    `tokenizers` library) give transformers' ids on the golden prompts and texts."""
    sp = Tokenizer.from_file(hf_dir / "tokenizer.model")
    js = JsonTokenizer.from_file(hf_dir / "tokenizer.json")
    for prompt, tokens in zip(golden["prompts"], golden["tokens"]):
        assert [sp.bos_id] + sp.encode(prompt) == tokens.tolist() == [js.bos_id] + js.encode(prompt)
    for text, ids in zip(golden["texts"], golden["text_ids"]):
        assert sp.encode(text) == ids == js.encode(text), text
        assert js.decode(ids) == sp.decode(ids)
    assert js.control_tokens() == sp.control_tokens()


@pytest.mark.parametrize("kind", ["model", "json"])
def test_chat_template_renders_as_transformers(hf_dir, golden, tmp_path, kind):
    """The checkpoint's own template, rendered and tokenized as transformers does
    (sanitized: control tokens in a message stay text)."""
    if kind == "json":  # only a tokenizer.json, EOS ids from generation_config.json
        js = JsonTokenizer.from_file(hf_dir / "tokenizer.json")
        js.chat_template = ChatTemplate(golden["chat_template"])
        save_tokenizer(tmp_path, js, eos_ids=(1, 106, 50))
        assert not (tmp_path / "tokenizer.model").exists()
        # The template as transformers 5 saves it: chat_template.jinja beside the config.
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        (tmp_path / "chat_template.jinja").write_text(config.pop("chat_template"))
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        tok = read_tokenizer(tmp_path)
        assert isinstance(tok, JsonTokenizer) and tok.eos_ids == (1, 106, 50)
    else:
        tok = read_tokenizer(hf_dir)
        assert isinstance(tok, Tokenizer) and tok.eos_ids == (1, 106)
    for messages, ids in zip(golden["chats"], golden["chat_ids"]):
        assert render_chat([(m["role"], m["content"]) for m in messages], tok) == ids
    with pytest.raises(ValueError, match="alternate"):
        render_chat([("user", "a"), ("user", "b")], tok)


def _with_generation_config(hf_dir, path, fields: dict):
    """`hf_dir`'s files linked into `path`, with `fields` added to its generation_config.json."""
    path.mkdir()
    for f in hf_dir.iterdir():
        if f.name != "generation_config.json":
            (path / f.name).symlink_to(f)
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, **fields}))
    return path


def test_a_bad_sampling_default_stops_the_server_before_it_compiles(hf_dir, tmp_path):
    from serving.config import ServerConfig
    from serving.runtime import load_runner, model_sampling_defaults

    model_dir = _with_generation_config(hf_dir, tmp_path / "bad", {"top_p": 1.5})
    said = []
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\], got 1.5"):
        load_runner(ServerConfig(model=str(model_dir), dtype="float32", allreduce="f32", max_num_seqs=1,
                                 max_seq_len=32, compile_cache_dir=""), said.append)
    assert said and said[-1].startswith("weights loaded"), said  # nothing compiled
    # --generation-config none does not use them.
    none = ServerConfig(model=str(model_dir), generation_config="none")
    assert model_sampling_defaults(none, read_tokenizer(model_dir)) == {}


def test_serve_hf_checkpoint(hf_dir, golden, tmp_path):
    """What `gemma3-serve --model DIR` runs (its engine loader and the HTTP app on a real
    server): a completion that names no sampling parameters samples with the checkpoint's
    generation_config.json (here top_k 1, so greedy whatever its temperature) and equals
    transformers' greedy continuation, and a chat is rendered with the checkpoint's own
    template. The checkpoint's sampling defaults survive our tokenizer writer."""
    import httpx

    from models.gemma3.hf_tokenizer import read_sampling_defaults
    from serving.config import ServerConfig
    from serving.runtime import load_runner
    from testkit import ServerThread

    defaults = {"temperature": 0.7, "top_k": 1}
    model_dir = _with_generation_config(hf_dir, tmp_path / "with-defaults", defaults)
    tok = read_tokenizer(model_dir)
    assert tok.sampling_defaults == defaults
    save_tokenizer(tmp_path / "written", tok)
    assert read_sampling_defaults(tmp_path / "written") == defaults

    # precompile="warmup", the suite's setting for the servers it starts (tests/conftest.py):
    # the warm-up's programs, not every step shape (test_precompile.py checks "all").
    config = ServerConfig(model=str(model_dir), dtype="float32", allreduce="f32", max_num_seqs=1,
                          max_seq_len=32, compile_cache_dir="", precompile="warmup")
    server = ServerThread(config, load_runner(config, lambda _: None))
    try:
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": config.model_name, "prompt": golden["prompts"][0], "max_tokens": 8, "seed": 3})
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": config.model_name, "messages": golden["chats"][1], "max_tokens": 1})
    finally:
        server.stop()
    assert health["sampling_defaults"] == defaults
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(golden["greedy"][0][:8])
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(golden["chat_ids"][1])
