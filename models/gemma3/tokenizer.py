"""Gemma 3's SentencePiece tokenizer, from a `tokenizer.model` or rebuilt from GGUF metadata
(`build_model_proto` undoes llama.cpp's conventions; cached on disk by the GGUF's and the
vocabulary's hashes, a damaged or stale file rebuilt). Tokens added beside the model file
(tokenizer.json's, e.g. `<image_soft_token>`) extend it (`AddedToken`); `never_generate_ids`:
the ids a model is not meant to emit."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import time
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import numpy as np
import sentencepiece as spm

from models.gemma3.multimodal import END_OF_IMAGE, IMAGE_SOFT_TOKEN, START_OF_IMAGE

log = logging.getLogger(__name__)

# The Gemma 3 special token ids the rest of the project relies on.
SPECIAL_PIECES = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<start_of_turn>", 106: "<end_of_turn>"}

_UNKNOWN_TYPE = 2  # SentencePiece ModelProto.SentencePiece.Type.UNKNOWN (same code in GGUF)
_CONTROL_TYPE = 3
_USER_DEFINED_TYPE = 4
# Part of the on-disk cache key: bump when build_model_proto builds a different proto.
_PROTO_VERSION = b"2: user-defined pieces with U+2581"
_VALID_TYPES = {1, 2, 3, 4, 5, 6}  # NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE


class TokenizerError(ValueError):
    """A tokenizer file or vocabulary that is not a usable Gemma 3 SentencePiece model."""


class AddedToken(NamedTuple):
    """A token a checkpoint adds beside its model file (tokenizer.json's `added_tokens`).
    special: a control token (a chat template writes it; text never encodes to it, decoding
    skips it); otherwise text containing it encodes to it."""

    id: int
    content: str
    special: bool = True


# Gemma 3's image tokens: no model writes them (the official gemma sampler forbids
# <start_of_image> and <end_of_image>; the soft token only holds an image's place).
IMAGE_PIECES = (START_OF_IMAGE, END_OF_IMAGE, IMAGE_SOFT_TOKEN)


def never_generate_ids(tok) -> tuple[int, ...]:
    """The ids of `tok` a model is not meant to emit: its image tokens (`IMAGE_PIECES`, and the
    names a checkpoint gives them: `image_pieces`) and the ids the checkpoint suppresses
    (`suppress_ids`, from generation_config.json). Tokenizers without pieces (a byte-level
    one) have no image tokens."""
    ids = {int(i) for i in getattr(tok, "suppress_ids", ())}
    lookup = getattr(tok, "piece_to_id", None)
    if lookup is not None:
        for piece in IMAGE_PIECES + tuple(getattr(tok, "image_pieces", ())):
            i = lookup(piece)
            if i != tok.unk_id:
                ids.add(int(i))
    return tuple(sorted(i for i in ids if 0 <= i < tok.vocab_size))


class SpecialIds:
    """Gemma 3's special-token ids (`SPECIAL_PIECES`), the same in every tokenizer here."""

    pad_id = 0
    eos_id = 1
    bos_id = 2
    unk_id = 3
    start_of_turn_id = 105
    end_of_turn_id = 106


class Tokenizer(SpecialIds):
    """Text <-> token ids. `encode` adds no BOS; callers prepend `bos_id` themselves."""

    # What ends a generation, and the model's own chat template (`hf_tokenizer.ChatTemplate`;
    # None: serving's built-in Gemma format). A checkpoint's files may set both per instance.
    eos_ids: tuple[int, ...] = (SpecialIds.eos_id, SpecialIds.end_of_turn_id)
    chat_template = None

    def __init__(self, model_proto: bytes, added_tokens: Iterable[AddedToken] = ()):
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_proto)
        except (RuntimeError, OSError) as e:
            raise TokenizerError(f"not a valid SentencePiece model: {e}") from e
        self._model_proto = bytes(model_proto)
        self._control: dict[str, int] | None = None
        self.vocab_size: int = self._sp.GetPieceSize()
        for i, piece in SPECIAL_PIECES.items():
            if i >= self.vocab_size or self._sp.IdToPiece(i) != piece:
                raise TokenizerError(f"not a Gemma 3 vocabulary: id {i} should be {piece!r}")
        self._add(added_tokens)

    def _add(self, tokens: Iterable[AddedToken]) -> None:
        """Added tokens the model file lacks (ids past it) or names otherwise; those it has as
        they are only count among the control tokens when special. The ids past the model file
        must follow it without a gap."""
        self._added: dict[int, AddedToken] = {}
        self._special_added: dict[str, int] = {}
        n = self.vocab_size
        for t in tokens:
            t = AddedToken(int(t.id), str(t.content), bool(t.special))
            if t.id < 0 or not t.content:
                raise TokenizerError(f"added token {t.content!r}: bad id {t.id} or empty text")
            if t.special:
                self._special_added[t.content] = t.id
            if t.id < n and self._sp.IdToPiece(t.id) == t.content:
                continue
            if t.id in SPECIAL_PIECES:
                raise TokenizerError(f"added token {t.content!r} takes id {t.id}, Gemma's "
                                     f"{SPECIAL_PIECES[t.id]!r}")
            self._added[t.id] = t
        past = sorted(i for i in self._added if i >= n)
        if past != list(range(n, n + len(past))):
            raise TokenizerError(f"added token ids past the vocabulary ({n}) must follow it "
                                 f"without a gap, got {past[:5]}...")
        self.vocab_size = n + len(past)
        self._by_text = {t.content: i for i, t in self._added.items()}
        # Text encodes to the non-special ones (longest first), as transformers does.
        plain = sorted((t.content for t in self._added.values() if not t.special), key=len,
                       reverse=True)
        self._plain_re = re.compile("|".join(map(re.escape, plain))) if plain else None

    def added_tokens(self) -> tuple[AddedToken, ...]:
        """The added tokens the model file lacks or names otherwise, by id."""
        return tuple(self._added[i] for i in sorted(self._added))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """SentencePiece model rebuilt from a GGUF file's tokenizer metadata."""
        return cls(_gguf_model_proto(os.fspath(path)))

    @classmethod
    def from_file(cls, tokenizer_model_path: str | os.PathLike,
                  added_tokens: Iterable[AddedToken] = ()) -> "Tokenizer":
        """Load a SentencePiece `tokenizer.model` file (and the tokens added beside it)."""
        path = Path(tokenizer_model_path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {path}")
        return cls(path.read_bytes(), added_tokens)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        if self._plain_re is None:
            return list(self._sp.EncodeAsIds(text))
        ids, at = [], 0
        for m in self._plain_re.finditer(text):
            ids += self._sp.EncodeAsIds(text[at:m.start()]) if m.start() > at else []
            ids.append(self._by_text[m.group()])
            at = m.end()
        return ids + (list(self._sp.EncodeAsIds(text[at:])) if at < len(text) else [])

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in np.asarray(list(ids)).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if not self._added:
            return self._sp.DecodeIds(ids)
        # Runs of the model file's ids decode together; an added token is its text (a special
        # one none, as a control piece).
        out, run = [], []
        for i in ids:
            t = self._added.get(i)
            if t is None:
                run.append(i)
                continue
            if run:
                out.append(self._sp.DecodeIds(run))
                run = []
            out.append("" if t.special else t.content)
        if run:
            out.append(self._sp.DecodeIds(run))
        return "".join(out)

    def id_to_piece(self, i: int) -> str:
        if not 0 <= int(i) < self.vocab_size:
            raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        t = self._added.get(int(i))
        return t.content if t is not None else self._sp.IdToPiece(int(i))

    def piece_to_id(self, piece: str) -> int:
        """The id of a piece; `unk_id` when the vocabulary does not have it."""
        i = self._by_text.get(piece)
        return i if i is not None else self._sp.PieceToId(piece)

    def control_tokens(self) -> dict[str, int]:
        """Control pieces and special added tokens (text -> id), which `encode` never produces
        from text: what a chat template writes as special tokens."""
        from sentencepiece import sentencepiece_model_pb2 as pb

        if self._control is None:
            m = pb.ModelProto()
            m.ParseFromString(self._model_proto)
            control = {p.piece: i for i, p in enumerate(m.pieces)
                       if p.type in (_UNKNOWN_TYPE, _CONTROL_TYPE) and i not in self._added}
            self._control = {**control, **self._special_added}
        return self._control

    def serialized_model(self) -> bytes:
        """The SentencePiece model proto, e.g. to save as a `tokenizer.model`."""
        return self._model_proto

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


def build_model_proto(pieces: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> bytes:
    """Serialized SentencePiece ModelProto for a Gemma-style (llama.cpp "llama") vocabulary:
    BPE, byte fallback, identity normalizer, no dummy prefix. llama.cpp stores `<unk>` as
    CONTROL, which SentencePiece refuses (a model needs one UNKNOWN piece): it is retyped."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    if not len(pieces) == len(scores) == len(types):
        raise TokenizerError(f"vocabulary arrays differ in length: {len(pieces)}, {len(scores)}, {len(types)}")
    types = np.asarray(types, dtype=np.int64).copy()
    if len(types) > 3 and pieces[3] == "<unk>":
        types[3] = _UNKNOWN_TYPE
    unknown = set(np.unique(types).tolist()) - _VALID_TYPES
    if unknown:
        raise TokenizerError(f"unknown token types {sorted(unknown)} in vocabulary")
    model = pb.ModelProto()
    scores = np.asarray(scores, dtype=np.float32).tolist()
    for piece, score, ptype in zip(pieces, scores, types.tolist()):
        if ptype == _USER_DEFINED_TYPE:
            # llama.cpp writes user-defined pieces with U+2581 turned into spaces (Gemma's
            # whitespace runs "▁▁", ... become "  ", ...). SentencePiece matches them in
            # the escaped text, where they would never match again: 4 spaces would split into
            # 4 pieces where Gemma's own tokenizer (and transformers) use one.
            piece = piece.replace(" ", "\u2581")
        model.pieces.add(piece=piece, score=score, type=ptype)
    ts = model.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(pieces)
    ts.byte_fallback = True
    ts.pad_id, ts.eos_id, ts.bos_id, ts.unk_id = 0, 1, 2, 3
    ts.pad_piece, ts.eos_piece, ts.bos_piece, ts.unk_piece = "<pad>", "<eos>", "<bos>", "<unk>"
    ns = model.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = False
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    return model.SerializeToString()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemma3-equarx" / "tokenizers"


@functools.lru_cache(maxsize=4)
def _gguf_model_proto_cached(path: str, stamp: tuple[int, int, int, int]) -> bytes:
    """The model proto of a GGUF file's vocabulary (`stamp`: its `gguf.file_stamp`, the
    in-process key)."""
    from models.gemma3.gguf import StringArray, open_gguf

    md = open_gguf(path).metadata
    if md.get("tokenizer.ggml.model") != "llama":
        raise TokenizerError(f"{path}: tokenizer model is {md.get('tokenizer.ggml.model')!r}, "
                             "expected a SentencePiece ('llama') vocabulary")
    try:
        pieces = md["tokenizer.ggml.tokens"]
        scores = md["tokenizer.ggml.scores"]
        types = md["tokenizer.ggml.token_type"]
    except KeyError as e:
        raise TokenizerError(f"{path}: GGUF has no tokenizer metadata {e}") from None
    if not isinstance(pieces, StringArray):
        raise TokenizerError(f"{path}: tokenizer.ggml.tokens is not an array of strings")
    # The vocabulary's own hash names the cache entry, so an edited file never hits a stale one.
    digest = hashlib.sha256(_PROTO_VERSION)
    # The pieces as stored (a gguf.StringArray: length-prefixed UTF-8), hashed undecoded.
    digest.update(pieces.raw)
    digest.update(np.ascontiguousarray(scores, np.float32).tobytes())
    digest.update(np.ascontiguousarray(types, np.int32).tobytes())
    # Entries are named <file>-<vocabulary>-<checksum>.model, <file> the GGUF path's hash: a
    # new entry of a file replaces the file's older ones (an earlier vocabulary, or one built
    # by an earlier _PROTO_VERSION).
    key = f"{hashlib.sha256(path.encode()).hexdigest()[:16]}-{digest.hexdigest()[:32]}"
    proto = _read_cached(key, path)
    if proto is not None:
        return proto
    proto = build_model_proto(pieces, scores, types)
    cached = _cache_dir() / f"{key}-{_checksum(proto)}.model"
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(proto)
            f.flush()
            os.fsync(f.fileno())  # on disk before the name: a crash leaves no short file
        os.replace(tmp, cached)  # atomic: concurrent builders never expose a partial file
        _remove_stale(cached)
    except OSError:  # a read-only or full cache only costs the rebuild next time
        with contextlib.suppress(OSError):
            tmp.unlink()
    return proto


_LEGACY_ENTRY = re.compile(r"[0-9a-f]{32}-[0-9a-f]{16}\.model")  # <vocabulary>-<checksum>
_STALE_TMP_SECONDS = 3600


def _remove_stale(kept: Path) -> None:
    """Cache files `kept` (an entry just written) makes stale: the same GGUF file's other
    entries, entries named as before entries carried their file's hash (never read now), and
    temporary files of writers that died over an hour ago."""
    file = kept.name.split("-", 1)[0]
    now = time.time()
    for f in kept.parent.iterdir():
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
            if (f != kept and f.name.endswith(".model")
                    and (f.name.startswith(f"{file}-") or _LEGACY_ENTRY.fullmatch(f.name))
                    or f.name.endswith(".tmp") and now - f.stat().st_mtime > _STALE_TMP_SECONDS):
                f.unlink()


def _checksum(proto: bytes) -> str:
    return hashlib.sha256(proto).hexdigest()[:16]


def _read_cached(key: str, gguf_path: str) -> bytes | None:
    """The cached proto of the vocabulary `key`, or None. The file is named `<key>-<checksum of
    its bytes>.model`: one whose bytes no longer match (cut short by a crash or power loss, or
    damaged on disk) would fail every later start with an error that blames the GGUF file, or
    load another vocabulary; it is removed, said, and rebuilt by the caller."""
    for cached in _cache_dir().glob(f"{key}-*.model"):
        try:
            proto = cached.read_bytes()
        except OSError:
            continue
        if cached.stem == f"{key}-{_checksum(proto)}":
            return proto
        log.warning("tokenizer cache: %s is damaged (its bytes do not match its checksum); "
                    "removing it and rebuilding the vocabulary of %s", cached, gguf_path)
        with contextlib.suppress(OSError):  # read-only: rebuilt each time, as if uncached
            cached.unlink()
    return None


def _gguf_model_proto(path: str) -> bytes:
    from models.gemma3.gguf import file_stamp

    real = os.path.realpath(path)
    if not os.path.isfile(real):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return _gguf_model_proto_cached(real, file_stamp(real))
