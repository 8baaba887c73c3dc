"""A small deterministic engine with the real engine's interface, for testing the engine core and
the HTTP layer without a model (JetStream's fake engine idea).

Its "model" repeats the prompt: the greedy token at position p is prompt[1 + (p - 1) % (n - 1)]
(position 0 holds BOS), so a test knows the exact expected text, including multi-byte characters
split over byte tokens, stop strings and stop tokens placed in a prompt of token ids. A sampled
token (temperature > 0) is a letter drawn from (seed, position). The engine checks that every decode
step continues exactly the sequence it holds in that slot, so a scheduler bug that mixes slots or
positions raises instead of passing silently.
"""
from __future__ import annotations

import time

import numpy as np

from serving.engine import DecodeInputs, EngineInfo, PrefillInputs, StepOutputs, decode_batch_sizes_for

_BYTE0 = 300  # token id of byte 0
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)


class ByteTokenizer:
    """Byte-level tokenizer with Gemma's special ids: byte b is token 300 + b."""

    pad_id, eos_id, bos_id, unk_id = 0, 1, 2, 3
    start_of_turn_id, end_of_turn_id = 105, 106
    vocab_size = _BYTE0 + 256

    def encode(self, text: str) -> list[int]:
        return [_BYTE0 + b for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) - _BYTE0 for i in ids if int(i) >= _BYTE0).decode("utf-8", errors="replace")

    def id_to_piece(self, i: int) -> str:
        i = int(i)
        if i >= _BYTE0:
            return f"<0x{i - _BYTE0:02X}>"
        return {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<start_of_turn>",
                106: "<end_of_turn>"}.get(i, f"<unused{i}>")


class FakeEngine:
    def __init__(self, num_slots: int = 4, max_seq_len: int = 64, step_delay: float = 0.0,
                 prefill_buckets: tuple[int, ...] = (8, 16, 32, 64), prefill_batch_sizes=(1, 4),
                 batched_prefill_max_bucket: int = 32, decode_batch_sizes: tuple[int, ...] = ()):
        self.tokenizer = ByteTokenizer()
        buckets = tuple(b for b in prefill_buckets if b < max_seq_len)
        if not buckets or buckets[-1] < max_seq_len - 1:
            buckets += (max_seq_len,)
        self.info = EngineInfo(
            model_name="fake", num_slots=num_slots, max_seq_len=max_seq_len, prefill_buckets=buckets,
            prefill_batch_sizes=tuple(prefill_batch_sizes), vocab_size=self.tokenizer.vocab_size,
            eos_ids=(1, 106), tp=1, dtype="float32", allreduce={"method": "bf16"}, allreduce_label="bf16",
            batched_prefill_max_bucket=batched_prefill_max_bucket,
            decode_batch_sizes=decode_batch_sizes_for(num_slots, decode_batch_sizes) if decode_batch_sizes else ())
        self.step_delay = step_delay
        self.slots: list[list[int]] = [[] for _ in range(num_slots)]
        self.prompt_len = [0] * num_slots
        self.steps: list[tuple[str, int]] = []  # (kind, rows) of every step, for tests
        self.decode_rows: list[int] = []  # leading slots each decode step was asked to run
        self.moves: list[tuple[int, int]] = []  # (src, dst) of every slot move
        self.prefill_buckets_used: list[int] = []

    def bucket_for(self, length: int) -> int:
        return self.info.bucket_for(length)

    def run_prefill(self, inputs: PrefillInputs) -> StepOutputs:
        time.sleep(self.step_delay)
        b, bucket = inputs.tokens.shape
        assert bucket in self.info.prefill_buckets and b in self.info.batch_sizes_for(bucket), (b, bucket)
        self.steps.append(("prefill", b))
        self.prefill_buckets_used.append(bucket)
        for row in range(b):
            n = int(inputs.lengths[row])
            self.slots[int(inputs.slots[row])] = [int(t) for t in inputs.tokens[row, :n]]
            self.prompt_len[int(inputs.slots[row])] = n
        out = self._next(list(inputs.slots), inputs.lengths, inputs.sampling)
        if inputs.prompt_logprobs:
            k = out.top_ids.shape[1]
            chosen = -np.arange(1, bucket, dtype=np.float32)[None].repeat(b, 0) / 10
            top_ids = np.concatenate([inputs.tokens[:, 1:, None], np.zeros((b, bucket - 1, k - 1), np.int32)], -1)
            top_lps = np.concatenate([chosen[..., None], np.full((b, bucket - 1, k - 1), -50.0, np.float32)], -1)
            out = out._replace(prompt_logprobs=chosen, prompt_top_ids=top_ids, prompt_top_logprobs=top_lps)
        return out

    def run_decode(self, inputs: DecodeInputs) -> StepOutputs:
        time.sleep(self.step_delay)
        s = len(inputs.tokens)
        if not 1 <= s <= self.info.num_slots:
            raise AssertionError(f"decode over {s} rows with {self.info.num_slots} slots")
        active = [i for i in range(s) if inputs.positions[i] > 0]
        self.steps.append(("decode", len(active)))
        self.decode_rows.append(s)
        for i in active:
            seq, pos = self.slots[i], int(inputs.positions[i])
            if pos != len(seq):
                raise AssertionError(f"slot {i}: decode at position {pos} but it holds {len(seq)} tokens")
            if pos >= self.info.max_seq_len:
                raise AssertionError(f"slot {i}: position {pos} beyond max_seq_len")
            seq.append(int(inputs.tokens[i]))
        return self._next(list(range(s)), inputs.positions + 1, inputs.sampling)

    def move_slot(self, src: int, dst: int) -> None:
        self.moves.append((src, dst))
        self.slots[dst], self.prompt_len[dst] = list(self.slots[src]), self.prompt_len[src]

    def _next(self, slots, positions, sampling) -> StepOutputs:
        toks = []
        for row, slot in enumerate(slots):
            prompt, pos = self.slots[int(slot)][:self.prompt_len[int(slot)]], int(positions[row])
            if sampling.temperature[row] > 0:
                rng = np.random.default_rng([int(sampling.seed[row]), pos])
                toks.append(_BYTE0 + int(rng.choice(_LETTERS)))
            elif len(prompt) >= 2:
                toks.append(prompt[1 + (pos - 1) % (len(prompt) - 1)])
            else:
                toks.append(_BYTE0 + ord("x"))
        toks = np.array(toks, np.int32)
        n = len(toks)
        top_ids = np.stack([toks] + [np.full(n, self.tokenizer.unk_id, np.int32)] * 19, axis=1)
        top_lps = np.concatenate([np.full((n, 1), -0.25, np.float32), np.full((n, 19), -50.0, np.float32)], 1)
        return StepOutputs(toks, np.full(n, -0.25, np.float32), top_ids, top_lps)
