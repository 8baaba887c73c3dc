"""Gemma 3 tokenizer rebuilt from the real 270M GGUF: special ids, round trips, byte fallback,
whitespace handling, agreement with transformers' tokenizer's ids, file loading and errors."""
from __future__ import annotations

import numpy as np
import pytest

from models.gemma3 import tokenizer as T
from models.gemma3.gguf import default_gguf_path
from models.gemma3.tokenizer import Tokenizer, TokenizerError
from testkit import HF_GOLDEN_NPZ

# transformers' ids (tests/golden/make_hf_golden.py): its own tokenizer built from the same GGUF.
# (The official golden's ids are not a reference here: the official tokenizer was given our
# rebuilt SentencePiece model.)
GOLDEN = HF_GOLDEN_NPZ
BYTE_BASE = 238  # id of the piece <0x00>; byte b is BYTE_BASE + b


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path())


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


def test_special_tokens(tok):
    assert tok.vocab_size == 262144
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    assert (tok.start_of_turn_id, tok.end_of_turn_id) == (105, 106)
    assert [tok.id_to_piece(i) for i in (0, 1, 2, 3, 105, 106)] == [
        "<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    assert tok.piece_to_id("<end_of_turn>") == 106
    # Control tokens decode to nothing, as in SentencePiece; they are never produced from text.
    assert tok.decode([tok.bos_id, tok.start_of_turn_id]) == ""
    assert tok.decode([tok.start_of_turn_id] + tok.encode("hi") + [tok.end_of_turn_id]) == "hi"
    assert 105 not in tok.encode("<start_of_turn>user\nhi")


@pytest.mark.parametrize("text", [
    "The capital of France is",
    "naïve café, Straße, Ελληνικά, русский, 東京, 서울, हिन्दी",
    "emoji 😀🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "  leading, inner   and trailing spaces  ",
    "tabs\tnew\nlines\n\n\nand\r\nCRLF",
    "control \x00\x01\x7f bytes",
    "",
])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.bos_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(np.array(ids, np.int32)) == text  # arrays are accepted too


def test_byte_fallback(tok):
    # Mathematical fraktur letters are not in the vocabulary: each becomes its UTF-8 bytes.
    for ch in "𝔘ꙮ":
        ids = tok.encode(ch)
        assert ids == [BYTE_BASE + b for b in ch.encode("utf-8")]
        assert [tok.id_to_piece(i) for i in ids] == [f"<0x{b:02X}>" for b in ch.encode("utf-8")]
        assert tok.decode(ids) == ch
    assert tok.unk_id not in tok.encode("𝔘𝔫 ꙮ \x00")


def test_multibyte_in_vocab(tok):
    # Common non-ASCII words are whole pieces, not byte sequences.
    for word in ("café", "東京"):
        ids = tok.encode(" " + word)
        assert len(ids) == 1 and tok.id_to_piece(ids[0]) == "▁" + word


def test_whitespace(tok):
    # No dummy prefix: the first word has no leading "▁"; spaces are kept, never collapsed.
    assert [tok.id_to_piece(i) for i in tok.encode("Hello world")] == ["Hello", "▁world"]
    assert tok.id_to_piece(tok.encode(" Hello")[0]).startswith("▁")
    assert tok.encode("Hello world") != tok.encode(" Hello world")
    assert tok.decode(tok.encode("a  b")) == "a  b" and len(tok.encode("a  b")) > len(tok.encode("a b"))
    assert tok.encode("\n") == [107] and tok.encode("\n\n") == [108]
    # Runs of spaces are Gemma's user-defined whitespace pieces (llama.cpp stores them with
    # spaces in place of U+2581; the rebuilt model has them back).
    assert [tok.id_to_piece(i) for i in tok.encode("    x")] == ["\u2581" * 4, "x"]


def test_matches_transformers_tokenizer(tok, golden):
    """Ids recorded with transformers' tokenizer of the same GGUF (tests/golden), control
    tokens written in text encoded as text."""
    for i, prompt in enumerate(golden["prompts"]):
        expected = golden[f"tokens_{i}"]
        assert expected[0] == tok.bos_id
        assert tok.encode(str(prompt)) == expected[1:].tolist(), prompt
    for j, text in enumerate(golden["tokenizer_texts"]):
        assert tok.encode(str(text)) == golden[f"tokenizer_ids_{j}"].tolist(), text


def test_from_file_and_cache(tok, tmp_path, monkeypatch):
    model = tmp_path / "tokenizer.model"
    model.write_bytes(tok.serialized_model())
    from_file = Tokenizer.from_file(model)
    text = "Round trip through a tokenizer.model file: 東京 😀"
    assert from_file.encode(text) == tok.encode(text) and from_file.vocab_size == tok.vocab_size

    # A rebuild writes the model to the cache; the next process reads it back unchanged.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    T._gguf_model_proto_cached.cache_clear()
    rebuilt = Tokenizer.from_gguf(default_gguf_path())
    cached = list((tmp_path / "cache").rglob("*.model"))
    assert len(cached) == 1 and cached[0].read_bytes() == rebuilt.serialized_model()
    T._gguf_model_proto_cached.cache_clear()
    assert Tokenizer.from_gguf(default_gguf_path()).encode(text) == tok.encode(text)


def test_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_file(tmp_path / "missing.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"definitely not a protobuf")
    with pytest.raises(TokenizerError):
        Tokenizer.from_file(junk)
    # A valid SentencePiece model whose ids are not Gemma 3's.
    pieces = ["<unk>", "<s>", "</s>", "<pad>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁a"]
    types = [3, 3, 3, 3] + [6] * 256 + [1]
    with pytest.raises(TokenizerError, match="not a Gemma 3 vocabulary"):
        Tokenizer(T.build_model_proto(pieces, [0.0] * len(pieces), [2] + types[1:]))
    with pytest.raises(TokenizerError, match="differ in length"):
        T.build_model_proto(pieces, [0.0], types)
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        tok.id_to_piece(-1)
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_tokens_added_beside_a_tokenizer_model_are_single_ids(tok, tmp_path):
    """A checkpoint with tokenizer.model and tokenizer.json (the official 4B-27B ones): the
    tokens tokenizer.json adds are the tokenizer's too, one id each. `<image_soft_token>`
    (262,144, special) is what a chat template writes it as, never what text encodes to, and
    decodes to nothing; a plain added token is what text encodes to; Gemma's own pieces keep
    their ids. The image tokens and the ids generation_config.json suppresses are the ids the
    model never generates."""
    import json

    from models.gemma3.hf_tokenizer import read_tokenizer
    from serving.chat_jinja import render_template

    (tmp_path / "tokenizer.model").write_bytes(tok.serialized_model())
    added = [(106, "<end_of_turn>", True), (255999, "<start_of_image>", True),
             (262144, "<image_soft_token>", True), (262145, "<tool_call>", False)]
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": special}
                         for i, c, special in added],
        "model": {"type": "BPE", "vocab": {}, "merges": []}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"suppress_tokens": [4]}))
    t = read_tokenizer(tmp_path)
    assert t.vocab_size == 262146
    assert t.encode("call <tool_call> now") == tok.encode("call ") + [262145] + tok.encode(" now")
    assert 262144 not in t.encode("a <image_soft_token>")  # special: text stays text
    assert t.encode("a <start_of_image>") == tok.encode("a <start_of_image>")
    assert (t.piece_to_id("<image_soft_token>"), t.id_to_piece(262145)) == (262144, "<tool_call>")
    assert t.control_tokens()["<image_soft_token>"] == 262144
    assert t.control_tokens()["<end_of_turn>"] == 106
    ids = tok.encode("a") + [262144] * 3 + [262145, 106] + tok.encode("b")
    assert t.decode(ids) == "a<tool_call>b"
    rendered = render_template("{{ messages[0]['content'] }}<image_soft_token>", {},
                               [{"role": "user", "content": "hi <image_soft_token>"}], t,
                               add_generation_prompt=False)
    # The template's soft token is its id; the user's is text.
    assert rendered.count(262144) == 1 and rendered[-1] == 262144
    assert t.decode(rendered[:-1]) == "hi <image_soft_token>"
    assert T.never_generate_ids(t) == (4, 255999, 256000, 262144)
    assert T.never_generate_ids(tok) == (255999, 256000)
    with pytest.raises(TokenizerError, match="without a gap"):
        Tokenizer(tok.serialized_model(), [T.AddedToken(262150, "<far>")])


def test_a_padded_gemma_vocabulary_gets_the_gemma_tokenizer(tok):
    """4B-27B embed 262,208 rows for Gemma's 262,144 pieces: such a model from a source with no
    tokenizer files (an official tree, a download of config.json and safetensors only) is
    tokenized as Gemma, never as bytes; a small random vocabulary keeps the byte tokenizer."""
    from models.gemma3.byte_tokenizer import ByteTokenizer
    from models.gemma3.step_api import default_tokenizer

    for rows in (262_144, 262_208):
        fallback = default_tokenizer(rows)
        assert isinstance(fallback, Tokenizer) and fallback.vocab_size == 262_144
        assert fallback.encode("Hi there") == tok.encode("Hi there")
    assert isinstance(default_tokenizer(512), ByteTokenizer)


@pytest.mark.parametrize("cut", ["half", "empty", "flipped"])
def test_a_damaged_cache_file_is_rebuilt_and_said(tmp_path, monkeypatch, caplog, cut):
    """A cached vocabulary cut short (a crash before it reached the disk) or damaged is found
    out, removed and rebuilt, with a warning naming it: it neither fails every later start nor
    loads a different vocabulary."""
    import gguf

    pieces = [T.SPECIAL_PIECES.get(i, f"<unused{i}>") for i in range(107)]
    pieces += [f"<0x{b:02X}>" for b in range(256)] + list("abcdefghijklmnopqrstuvwxyz")
    pieces += ["\u2581", "he", "ll", "hell", "hello"]
    types = [3 if i in T.SPECIAL_PIECES else 5 for i in range(107)] + [6] * 256
    types += [1] * (len(pieces) - len(types))
    scores = [0.0] * 363 + [-float(i) for i in range(len(pieces) - 363)]
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    T._gguf_model_proto_cached.cache_clear()
    fresh = Tokenizer.from_gguf(path)
    (cached,) = (tmp_path / "cache").rglob("*.model")
    proto = cached.read_bytes()
    assert proto == fresh.serialized_model()
    damaged = {"half": proto[:len(proto) // 2 + 3], "empty": b"",
               "flipped": proto[:100] + bytes([proto[100] ^ 1]) + proto[101:]}[cut]
    cached.write_bytes(damaged)
    T._gguf_model_proto_cached.cache_clear()  # a new process
    with caplog.at_level("WARNING", logger=T.__name__):
        again = Tokenizer.from_gguf(path)
    assert again.serialized_model() == proto
    assert again.encode("hello hell") == fresh.encode("hello hell")
    assert any(str(cached) in r.getMessage() for r in caplog.records), caplog.text
    assert [p.read_bytes() for p in (tmp_path / "cache").rglob("*.model")] == [proto]


def _write_vocab_gguf(path, extra: str) -> None:
    """A small Gemma-shaped SentencePiece vocabulary as a GGUF file; `extra` is its last piece."""
    import gguf

    pieces = [T.SPECIAL_PIECES.get(i, f"<unused{i}>") for i in range(107)]
    pieces += [f"<0x{b:02X}>" for b in range(256)] + list("abcdefghijklmnopqrstuvwxyz")
    pieces += ["\u2581", "he", "ll", "hell", extra]
    types = [3 if i in T.SPECIAL_PIECES else 5 for i in range(107)] + [6] * 256
    types += [1] * (len(pieces) - len(types))
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 363 + [-float(i) for i in range(len(pieces) - 363)])
    w.add_token_types(types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_stale_cache_files_are_removed(tmp_path, monkeypatch):
    """A GGUF file's new cache entry (its vocabulary edited, or built by another proto version)
    replaces its older ones; files named as entries were before they carried their GGUF file's
    hash go too, and so do temporary files of writers that died long ago. Another file's entry,
    a writer's fresh temporary file and files that are not the cache's stay."""
    import os
    import time

    cache = tmp_path / "cache" / "gemma3-equarx" / "tokenizers"
    cache.mkdir(parents=True)
    legacy = cache / f"{'a' * 32}-{'b' * 16}.model"
    other = cache / f"{'c' * 16}-{'d' * 32}-{'e' * 16}.model"
    dead, live, notes = cache / "x.model.123.tmp", cache / "y.model.456.tmp", cache / "notes.txt"
    for f in (legacy, other, dead, live, notes):
        f.write_bytes(b"old")
    hours_ago = time.time() - 7200
    os.utime(dead, (hours_ago, hours_ago))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "vocab.gguf"

    def build(extra):
        _write_vocab_gguf(path, extra)
        T._gguf_model_proto_cached.cache_clear()  # a new process
        return Tokenizer.from_gguf(path).serialized_model()

    def entries():
        return sorted(p for p in cache.glob("*.model") if p != other)

    first = build("hello")
    assert [p.read_bytes() for p in entries()] == [first]
    assert sorted(p.name for p in cache.iterdir() if p not in entries()) == sorted(
        f.name for f in (other, live, notes))
    edited = build("world")
    assert edited != first and [p.read_bytes() for p in entries()] == [edited]
    monkeypatch.setattr(T, "_PROTO_VERSION", T._PROTO_VERSION + b" (next)")
    before = entries()
    assert build("world") == edited
    assert len(entries()) == 1 and entries() != before
    assert other.read_bytes() == live.read_bytes() == notes.read_bytes() == b"old"
