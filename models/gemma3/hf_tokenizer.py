"""The tokenizer side of a Hugging Face checkpoint, read and written: tokenizer.model (preferred;
with tokenizer.json's added tokens) or tokenizer.json, generation_config.json's EOS ids and
sampling defaults, the chat template (carried only: serving renders it), and the tokens not for
generation (`suppress_tokens`, image token names) for `tokenizer.never_generate_ids`."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Iterable

import numpy as np

from models.gemma3.tokenizer import SPECIAL_PIECES, AddedToken, Tokenizer, TokenizerError

TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"  # processors of multimodal checkpoints

# SentencePiece piece types (sentencepiece_model.proto).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
# Gemma's names of its special tokens, as transformers passes them to chat templates.
_SPECIAL_TOKEN_NAMES = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                        "pad_token": "<pad>"}


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's Jinja chat template and the special-token variables it is rendered with
    (bos_token, eos_token, ... from tokenizer_config.json)."""

    source: str
    variables: dict = dataclasses.field(default_factory=lambda: dict(_SPECIAL_TOKEN_NAMES))


class JsonTokenizer:
    """Text <-> ids through a `tokenizers` tokenizer.json; the interface of `Tokenizer`."""

    pad_id, eos_id, bos_id, unk_id = Tokenizer.pad_id, Tokenizer.eos_id, Tokenizer.bos_id, Tokenizer.unk_id
    start_of_turn_id, end_of_turn_id = Tokenizer.start_of_turn_id, Tokenizer.end_of_turn_id
    eos_ids = Tokenizer.eos_ids
    chat_template = None

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tk = HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # the library raises its own exception types
            raise TokenizerError(f"not a valid tokenizer.json: {e}") from e
        # Control tokens written in text stay text, as SentencePiece's encode treats them: a
        # message that contains "<start_of_turn>" cannot forge a turn.
        self._tk.encode_special_tokens = True
        self._json = tokenizer_json
        self.vocab_size: int = self._tk.get_vocab_size(with_added_tokens=True)
        for i, piece in SPECIAL_PIECES.items():
            if self._tk.id_to_token(i) != piece:
                raise TokenizerError(f"not a Gemma 3 vocabulary: id {i} should be {piece!r}")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "JsonTokenizer":
        return cls(Path(path).read_text(encoding="utf-8"))

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return list(self._tk.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in np.asarray(list(ids)).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return self._tk.decode(ids, skip_special_tokens=True)

    def id_to_piece(self, i: int) -> str:
        if not 0 <= int(i) < self.vocab_size:
            raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        return self._tk.id_to_token(int(i))

    def piece_to_id(self, piece: str) -> int:
        i = self._tk.token_to_id(piece)
        return self.unk_id if i is None else i

    def control_tokens(self) -> dict[str, int]:
        """Special added tokens (text -> id): what a chat template writes as control tokens."""
        return {t.content: i for i, t in self._tk.get_added_tokens_decoder().items() if t.special}

    def serialized_json(self) -> str:
        return self._json

    def __repr__(self) -> str:
        return f"JsonTokenizer(vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------
# tokenizer.json from a SentencePiece model


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece BPE vocabulary: every split of a piece into two
    pieces, ranked by the merged piece's id (SentencePiece ranks pieces by score, and Gemma's
    ids are in score order), then by the left part's length; transformers'
    `generate_merges` without scores."""
    merges = []
    for piece, i in vocab.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(i, len(left), len(right), left, right) for left, right in local]
    merges.sort(key=lambda m: m[:3])
    return [(m[3], m[4]) for m in merges]


def tokenizer_json_from_sentencepiece(model_proto: bytes,
                                      added: tuple[AddedToken, ...] = ()) -> str:
    """tokenizer.json (the `tokenizers` library's format) of a Gemma SentencePiece model and
    the tokens added past it (`added`, ids in order from the model's size)."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers

    m = pb.ModelProto()
    m.ParseFromString(model_proto)
    if m.trainer_spec.model_type != pb.TrainerSpec.BPE:
        raise TokenizerError("only SentencePiece BPE models convert to tokenizer.json here")
    vocab = {p.piece: i for i, p in enumerate(m.pieces)}
    unk = m.pieces[m.trainer_spec.unk_id].piece
    tk = HFTokenizer(models.BPE(vocab, _merges(vocab), unk_token=unk, fuse_unk=True,
                                byte_fallback=m.trainer_spec.byte_fallback))
    # Gemma's SentencePiece normalizer is the identity with whitespace escaped and no dummy prefix.
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    special = [p.piece for p in m.pieces if p.type in (_CONTROL, _UNKNOWN)]
    tk.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in special])
    # User-defined pieces (newline and space runs, ...) are matched whole in the escaped text, as
    # SentencePiece does. One holding a raw space never matches there (e.g. a vocabulary rebuilt
    # from a GGUF file without undoing llama.cpp's "▁" -> " "): left out, or `tokenizers`
    # would match it where SentencePiece does not.
    tk.add_tokens([AddedToken(p.piece, normalized=True, special=False)
                   for p in m.pieces if p.type == _USER_DEFINED and " " not in p.piece])
    for t in sorted(added):  # new ids are given in order from the vocabulary's size
        if t.id >= len(m.pieces):
            token = AddedToken(t.content, normalized=False, special=t.special)
            (tk.add_special_tokens if t.special else tk.add_tokens)([token])
    return tk.to_str()


# ---------------------------------------------------------------------------------------------
# Reading and writing a checkpoint directory's tokenizer files


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def read_chat_template(path: str | os.PathLike) -> ChatTemplate | None:
    """The checkpoint's own chat template: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or named templates of which "default" is used), else the
    processor's chat_template.json; None when it has none."""
    path = Path(path)
    config = _json(path / TOKENIZER_CONFIG)
    if (path / CHAT_TEMPLATE_JINJA).is_file():
        source = (path / CHAT_TEMPLATE_JINJA).read_text(encoding="utf-8")
    else:
        source = config.get("chat_template") or _json(path / CHAT_TEMPLATE_JSON).get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source}
            source = named.get("default")
    if not source:
        return None
    variables = dict(_SPECIAL_TOKEN_NAMES)
    for key, value in config.items():
        if isinstance(value, dict) and "content" in value:  # a serialized AddedToken
            value = value["content"]
        if key.endswith("_token") and isinstance(value, str):
            variables[key] = value
    return ChatTemplate(source, variables)


def read_eos_ids(path: str | os.PathLike) -> tuple[int, ...] | None:
    """generation_config.json's eos_token_id (an id or a list of them), or None."""
    eos = _json(Path(path) / GENERATION_CONFIG).get("eos_token_id")
    if eos is None:
        return None
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))


# generation_config.json's sampling fields, the defaults its authors chose for requests that leave
# them out (Gemma 3's instruction-tuned checkpoints: top_k 64, top_p 0.95); the ones vLLM's
# --generation-config auto reads. do_sample is not among them: temperature says it.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_sampling_defaults(path: str | os.PathLike) -> dict:
    """generation_config.json's sampling fields present in it ({} for none or no file)."""
    config = _json(Path(path) / GENERATION_CONFIG)
    return {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}


_ADDED_TOKENS_KEY = re.compile(r'"added_tokens"\s*:\s*\[')


def read_added_tokens(path: str | os.PathLike) -> tuple[AddedToken, ...]:
    """tokenizer.json's added tokens ((), without the file). The `tokenizers` library writes
    them before the vocabulary: only that array is parsed (Gemma's file is 33 MB)."""
    file = Path(path) / TOKENIZER_JSON
    if not file.is_file():
        return ()
    text = file.read_text(encoding="utf-8")
    key = _ADDED_TOKENS_KEY.search(text, 0, 4096)
    try:
        added = json.JSONDecoder().raw_decode(text, key.end() - 1)[0] if key else None
    except ValueError:
        added = None
    if added is None:
        added = json.loads(text).get("added_tokens") or []
    try:
        return tuple(AddedToken(int(t["id"]), str(t["content"]), bool(t.get("special", False)))
                     for t in added)
    except (KeyError, TypeError, ValueError) as e:
        raise TokenizerError(f"{path}: tokenizer.json has a malformed added token: {e!r}") from None


def read_suppressed_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """The ids generation_config.json says never to generate: `suppress_tokens` and the
    one-token entries of `bad_words_ids` (transformers' meaning)."""
    config = _json(Path(path) / GENERATION_CONFIG)
    ids = list(config.get("suppress_tokens") or [])
    ids += [w[0] for w in config.get("bad_words_ids") or [] if isinstance(w, list) and len(w) == 1]
    return tuple(sorted({int(i) for i in ids}))


def read_image_pieces(path: str | os.PathLike) -> tuple[str, ...]:
    """The names tokenizer_config.json gives the image tokens (boi_token, eoi_token,
    image_token), as transformers' Gemma 3 processor reads them."""
    config = _json(Path(path) / TOKENIZER_CONFIG)
    names = []
    for key in ("boi_token", "eoi_token", "image_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            names.append(value)
    return tuple(names)


def read_tokenizer(path: str | os.PathLike):
    """The tokenizer of a checkpoint directory (tokenizer.model with tokenizer.json's added
    tokens, else tokenizer.json; None when it has neither) with its EOS ids, chat template,
    sampling defaults and the tokens it marks as not for generation attached."""
    path = Path(path)
    if (path / TOKENIZER_MODEL).is_file():
        tok = Tokenizer.from_file(path / TOKENIZER_MODEL, read_added_tokens(path))
    elif (path / TOKENIZER_JSON).is_file():
        tok = JsonTokenizer.from_file(path / TOKENIZER_JSON)
    else:
        return None
    eos = read_eos_ids(path)
    if eos is not None:
        tok.eos_ids = eos
    tok.chat_template = read_chat_template(path)
    tok.sampling_defaults = read_sampling_defaults(path)
    tok.suppress_ids = read_suppressed_ids(path)
    tok.image_pieces = read_image_pieces(path)
    return tok


def save_tokenizer(path: str | os.PathLike, tok, eos_ids: tuple[int, ...] | None = None,
                   files: tuple[str, ...] = (TOKENIZER_MODEL, TOKENIZER_JSON)) -> None:
    """Write the tokenizer files transformers reads (those of `files` the tokenizer can give:
    tokenizer.model needs a SentencePiece one), tokenizer_config.json (with the chat template,
    if the tokenizer carries one) and generation_config.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    proto = getattr(tok, "serialized_model", None)
    proto = proto() if proto is not None else None
    if TOKENIZER_MODEL in files and proto is not None:
        (path / TOKENIZER_MODEL).write_bytes(proto)
    if TOKENIZER_JSON in files:
        text = (tok.serialized_json() if isinstance(tok, JsonTokenizer)
                else tokenizer_json_from_sentencepiece(proto, tok.added_tokens()))
        (path / TOKENIZER_JSON).write_text(text, encoding="utf-8")
    template: ChatTemplate | None = getattr(tok, "chat_template", None)
    config = {"tokenizer_class": "GemmaTokenizer", **(template.variables if template
                                                     else _SPECIAL_TOKEN_NAMES),
              "add_bos_token": True, "add_eos_token": False,
              "clean_up_tokenization_spaces": False}
    if template is not None:
        config["chat_template"] = template.source
    (path / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                         encoding="utf-8")
    eos = tuple(eos_ids or getattr(tok, "eos_ids", None) or (tok.eos_id, tok.end_of_turn_id))
    (path / GENERATION_CONFIG).write_text(json.dumps(
        {"bos_token_id": tok.bos_id, "pad_token_id": tok.pad_id, "eos_token_id": list(eos),
         **getattr(tok, "sampling_defaults", {}),
         **({"suppress_tokens": list(tok.suppress_ids)} if getattr(tok, "suppress_ids", ())
            else {})},
        indent=2))
