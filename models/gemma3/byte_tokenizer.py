"""A byte-level tokenizer with the `Tokenizer` interface, for random models with small vocabularies.

Ids 0..106 keep Gemma 3's special-token ids (pad 0, eos 1, bos 2, unk 3, <start_of_turn> 105,
<end_of_turn> 106); byte b is id 107 + b.
"""
from __future__ import annotations

from typing import Iterable

from models.gemma3.tokenizer import SPECIAL_PIECES, SpecialIds

BYTE_OFFSET = 107


class ByteTokenizer(SpecialIds):
    def __init__(self, vocab_size: int):
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {BYTE_OFFSET + 256}, "
                             f"got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of text as ids (no BOS)."""
        return [BYTE_OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; special and unused ids are skipped, bad UTF-8 replaced."""
        data = bytes(int(i) - BYTE_OFFSET for i in ids if BYTE_OFFSET <= int(i) < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")

    def id_to_piece(self, i: int) -> str:
        i = int(i)
        if not 0 <= i < self.vocab_size:
            raise IndexError(f"id {i} out of range [0, {self.vocab_size})")
        if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
            return f"<0x{i - BYTE_OFFSET:02X}>"
        return SPECIAL_PIECES.get(i, f"<unused{i}>")
