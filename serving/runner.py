"""The engine: the model's prefill and decode programs plus on-device sampling, over a fixed set of
cache slots. It knows nothing about requests, queues or HTTP (`scheduler.py` plans its steps,
`engine_core.py` runs them).

Every step takes one small plain structure of numpy arrays (`PrefillInputs`, `ChunkInputs`,
`DecodeInputs`) and returns numpy arrays (`StepOutputs`): the chosen tokens and their logprobs,
never full logits. A step is a pure function of its inputs and the cache (and the prefix cache's
blocks, which steps alone fill), so several processes that receive the same inputs in the same
order run the same programs (process 0 would broadcast them); `run_prefill`, `run_chunk` and
`run_decode` are the entry points.

Chunked prefill and determinism (docs/engine.md): with `chunk_size` C a prompt may be prefilled in
chunks of C tokens at positions 0, C, 2C, ... (`run_chunk`, one row, each chunk attending to the
cache written so far), interleaved with decode steps. Deterministic (batch-invariant) mode
prefills every prompt that way and decodes every step over all slots with one program, so every
program a request runs has shapes that depend on that request alone: its tokens do not depend on
what else is batched. Full chunks can be kept as prefix-cache blocks (`ChunkInputs.save_block`)
and copied into another slot for a prompt that starts with the same blocks (`restore`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, NamedTuple, Protocol

import numpy as np

from serving import dispatch_window, wire
from serving.sampling import SlotSampling

log = logging.getLogger(__name__)


class PrefillInputs(NamedTuple):
    tokens: np.ndarray  # int32 [B, Tb], right-padded to a prefill bucket Tb
    lengths: np.ndarray  # int32 [B], real prompt lengths (>= 1)
    slots: np.ndarray  # int32 [B], cache row of each prompt
    sampling: SlotSampling  # [B]
    prompt_logprobs: bool = False  # also return the logprobs of the prompt's own tokens

    # How each field travels to a group's other processes (serving/wire.py).
    WIRE = dict(tokens=wire.Array(np.int32), lengths=wire.Array(np.int32),
                slots=wire.Array(np.int32), sampling=wire.Record(SlotSampling),
                prompt_logprobs=wire.Bool())

    @staticmethod
    def wire_examples(info: "RunnerInfo") -> list["PrefillInputs"]:
        """The largest prefills an engine with `info` runs (sizing the group's broadcast)."""
        batch = lambda b, t: PrefillInputs(np.zeros((b, t), np.int32), np.zeros(b, np.int32),  # noqa: E731
                                           np.zeros(b, np.int32), SlotSampling.greedy(b), True)
        return [batch(max(info.batch_sizes_for(t)), t) for t in info.prefill_buckets]


class ChunkInputs(NamedTuple):
    """One chunk of one prompt: `length` real tokens at positions start..start+length-1 of the
    sequence in cache row `slot` (positions before `start` are in the cache)."""

    tokens: np.ndarray  # int32 [T], right-padded to a chunk bucket T
    start: int
    length: int
    slot: int
    sampling: SlotSampling  # [1]
    final: bool  # the prompt's last chunk: sample its first token (else no outputs)
    # Prefix-cache blocks copied into the slot first, at positions 0, C, 2C, ... (start is then
    # len(restore) * C), and the block this chunk's keys/values are kept as (-1: none).
    restore: tuple[int, ...] = ()
    save_block: int = -1

    WIRE = dict(tokens=wire.Array(np.int32), start=wire.Int(), length=wire.Int(), slot=wire.Int(),
                sampling=wire.Record(SlotSampling), final=wire.Bool(), restore=wire.Ints(),
                save_block=wire.Int())

    @staticmethod
    def wire_examples(info: "RunnerInfo") -> list["ChunkInputs"]:
        """A full chunk restoring every block a prompt can have (none without chunks)."""
        if not info.chunk_size:
            return []
        c = info.chunk_size
        return [ChunkInputs(np.zeros(c, np.int32), 0, c, 0, SlotSampling.greedy(1), True,
                            tuple(range(info.max_seq_len // c)), 0)]


class DecodeInputs(NamedTuple):
    """One token for each of the first R slots (R <= num_slots; slots from R on are idle and
    not decoded: the engine core sends R = last busy slot + 1)."""

    tokens: np.ndarray  # int32 [R], the last token of each slot (anything for an idle slot)
    positions: np.ndarray  # int32 [R], tokens already in the slot = position of `tokens`
    sampling: SlotSampling  # [R]

    WIRE = dict(tokens=wire.Array(np.int32), positions=wire.Array(np.int32),
                sampling=wire.Record(SlotSampling))

    @staticmethod
    def wire_examples(info: "RunnerInfo") -> list["DecodeInputs"]:
        n = info.num_slots
        return [DecodeInputs(np.zeros(n, np.int32), np.zeros(n, np.int32), SlotSampling.greedy(n))]


class SlotMove(NamedTuple):
    """A slot move (`move_slot`) as a group's other processes receive it."""

    src: int
    dst: int

    WIRE = dict(src=wire.Int(), dst=wire.Int())

    @staticmethod
    def wire_examples(info: "RunnerInfo") -> list["SlotMove"]:
        return [SlotMove(0, 0)]


class StepOutputs(NamedTuple):
    tokens: np.ndarray  # int32 [B]
    logprobs: np.ndarray  # float32 [B]
    top_ids: np.ndarray  # int32 [B, K]
    top_logprobs: np.ndarray  # float32 [B, K]
    # With prompt_logprobs: logprob of prompt token t+1 given tokens <= t, and the top alternatives.
    # Slot engine: [B, Tb-1] per prompt row; paged engine: [T] per token of the step.
    prompt_logprobs: np.ndarray | None = None  # float32 [B, Tb-1]
    prompt_top_ids: np.ndarray | None = None  # int32 [B, Tb-1, K]
    prompt_top_logprobs: np.ndarray | None = None  # float32 [B, Tb-1, K]


@dataclasses.dataclass(frozen=True)
class RunnerInfo:
    """What the scheduler and the HTTP layer need to know about an engine."""

    model_name: str
    num_slots: int
    max_seq_len: int
    prefill_buckets: tuple[int, ...]
    prefill_batch_sizes: tuple[int, ...]
    vocab_size: int
    eos_ids: tuple[int, ...]  # tokens that end a sequence (EOS, <end_of_turn>)
    tp: int = 1
    dtype: str = "bfloat16"
    allreduce: dict = dataclasses.field(default_factory=dict)
    allreduce_label: str = "bf16"
    # Prompts in buckets up to this length are prefilled several at a time; longer ones one by one
    # (a long prompt already fills the machine, and each (batch, bucket) pair is one more compile).
    batched_prefill_max_bucket: int = 256
    # Decode runs over the first R slots padded up to one of these counts (one program each), so
    # a lone sequence's step does not cost a full batch's. Empty: always all slots.
    decode_batch_sizes: tuple[int, ...] = ()
    # Chunked prefill (0: off): chunks of chunk_size tokens, the last one padded to one of
    # chunk_buckets. Prompts longer than chunk_size are chunked (every prompt when deterministic).
    chunk_size: int = 0
    chunk_buckets: tuple[int, ...] = ()
    deterministic: bool = False
    prefix_blocks: int = 0  # prefix-cache blocks (of chunk_size tokens) kept; 0: no prefix cache
    # The paged engine (serving/paged_runner.py; page_size 0: the slot engine above). num_slots
    # is then its --max-num-seqs, prefix_blocks > 0 turns prefix caching on, chunk_size is the
    # most prompt tokens a sequence computes in one step.
    page_size: int = 0
    num_global_pages: int = 0  # in each pool, the scratch page included
    num_local_pages: int = 0
    max_num_batched_tokens: int = 0  # the token budget of one step
    sliding_window: int | None = None  # the local layers' window (None: no local layers)
    has_global_layers: bool = True

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    def chunked(self, prompt_len: int, prompt_logprobs: bool = False) -> bool:
        """Whether a prompt is prefilled in chunks (prompts whose own logprobs are wanted need
        every position's logits: one-shot prefill)."""
        return bool(self.chunk_size) and not prompt_logprobs and (
            self.deterministic or prompt_len > self.chunk_size)

    def chunk_bucket_for(self, length: int) -> int:
        return next(b for b in self.chunk_buckets if b >= length)

    @property
    def warm_buckets(self) -> tuple[int, ...]:
        """The one-shot prefill buckets compiled ahead (longer ones compile on first use: only
        prompts that want their own logprobs reach them when prompts are chunked)."""
        if self.deterministic:
            return ()
        if self.chunk_size:
            return tuple(b for b in self.prefill_buckets if b <= self.chunk_size)
        return self.prefill_buckets

    def decode_rows_for(self, rows: int) -> int:
        if not 1 <= rows <= self.num_slots:
            raise ValueError(f"decode needs 1..{self.num_slots} rows, got {rows}")
        return next((n for n in self.decode_batch_sizes if n >= rows), self.num_slots)

    def batch_sizes_for(self, bucket: int) -> tuple[int, ...]:
        return self.prefill_batch_sizes if bucket <= self.batched_prefill_max_bucket else (1,)

    def bucket_for(self, length: int) -> int:
        """The smallest prefill bucket that holds a prompt of `length` tokens."""
        if length > self.prefill_buckets[-1]:
            raise ValueError(f"prompt of {length} tokens exceeds the largest bucket {self.prefill_buckets[-1]}")
        return next(b for b in self.prefill_buckets if b >= length)

    @property
    def decode_row_counts(self) -> tuple[int, ...]:
        """The row counts the decode step is compiled for (all slots when not packed)."""
        return self.decode_batch_sizes or (self.num_slots,)


class Runner(Protocol):
    """What the engine core drives (JetStream's split: a fake engine implements this in tests)."""

    info: RunnerInfo
    tokenizer: object

    def bucket_for(self, length: int) -> int: ...

    def run_prefill(self, inputs: PrefillInputs) -> StepOutputs: ...

    def run_decode(self, inputs: DecodeInputs) -> StepOutputs: ...

    def run_chunk(self, inputs: ChunkInputs) -> StepOutputs | None: ...

    def move_slot(self, src: int, dst: int) -> None: ...


def pad_prefill_batch(rows: list[tuple[list[int], int, SlotSampling]], bucket: int,
                      batch: int) -> PrefillInputs:
    """Builds prefill inputs from (prompt ids, slot, one-row sampling) with `batch` rows. Missing rows
    repeat the last real one: it writes the same values into the same cache row, so padding needs no
    spare slot and cannot touch another sequence."""
    if not rows or len(rows) > batch:
        raise ValueError(f"need 1..{batch} rows, got {len(rows)}")
    rows = rows + [rows[-1]] * (batch - len(rows))
    tokens = np.zeros((batch, bucket), np.int32)
    for i, (ids, _, _) in enumerate(rows):
        if not 1 <= len(ids) <= bucket:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit bucket {bucket}")
        tokens[i, :len(ids)] = ids
    sampling = SlotSampling.concat([r[2] for r in rows])
    return PrefillInputs(tokens=tokens,
                         lengths=np.array([len(r[0]) for r in rows], np.int32),
                         slots=np.array([r[1] for r in rows], np.int32),
                         sampling=sampling)


class SlotRunner:
    """Engine over a `models.gemma3` model: a KV cache of `num_slots` rows, the model's jitted
    prefill/decode programs, and the jitted sampler applied to their logits on device."""

    def __init__(self, model, num_slots: int, max_seq_len: int,
                 prefill_batch_sizes: tuple[int, ...] = (1,), model_name: str = "gemma3-270m",
                 decode_batch_sizes: tuple[int, ...] | None = None, chunk_size: int = 0,
                 deterministic: bool = False, prefix_blocks: int = 0):
        import jax

        from serving import sampling

        self.model = model
        self.tokenizer = model.tokenizer
        self.info = runner_info(model, num_slots, max_seq_len, prefill_batch_sizes, model_name,
                                decode_batch_sizes, chunk_size, deterministic, prefix_blocks)
        # Prefix-cache blocks: id -> one full chunk's keys/values (device arrays, every layer),
        # at most info.prefix_blocks of them (the scheduler picks the ids and evicts).
        self._blocks: dict[int, object] = {}
        self._jax = jax
        self.cache = model.init_cache(num_slots, max_seq_len)
        # Sampling runs on one device: with tp > 1 the logits arrive split over the vocabulary, and
        # XLA's CPU top-k on a partitioned operand fails to compile (and would gather it anyway).
        # With several processes (multi-host) each one samples on its own first device, from
        # logits gathered to every process, so that all of them run the same programs.
        self._sample_device = next(d for d in model.mesh.devices.flat if d.process_index == jax.process_index())
        self._replicate = jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(
            model.mesh, jax.sharding.PartitionSpec()))
        self._sample = sampling.make_sampler()
        self._prompt_logprobs = jax.jit(sampling.prompt_logprobs)
        self._last_logits = jax.jit(_last_logits)
        self._feed = jax.jit(feed_tokens)
        # Every program below is counted here: dispatches must not run too far ahead of the
        # devices (serving/dispatch_window.py: XLA:CPU wedges otherwise at tp >= 2).
        local = [d for d in model.mesh.devices.flat if d.process_index == jax.process_index()]
        self.window = dispatch_window.DispatchWindow(
            lambda: self.cache, dispatch_window.DEFAULT_LIMIT if dispatch_window.needed(local) else 0)

    def bucket_for(self, length: int) -> int:
        return self.info.bucket_for(length)

    def run_prefill(self, inputs: PrefillInputs) -> StepOutputs:
        # The model places host arrays on its mesh itself (replicated).
        logits, self.cache = self.model.prefill(self.cache, inputs.tokens, inputs.lengths, inputs.slots,
                                                return_all_logits=inputs.prompt_logprobs)
        self.window.dispatched(logits)
        logits = self._to_sample_device(logits)
        extra = ()
        if inputs.prompt_logprobs:
            extra = self._prompt_logprobs(logits, inputs.tokens)
            logits = self._last_logits(logits, inputs.lengths)
            self.window.dispatched((extra, logits), 2)
        out = self._sample(logits, inputs.sampling.resolve(), inputs.lengths)
        ticket = self.window.dispatched(out)
        host = _to_host(self._jax, out, extra)
        self.window.retired(ticket)
        return host

    def run_decode(self, inputs: DecodeInputs) -> StepOutputs:
        return self.dispatch_decode(inputs).result()

    def dispatch_decode(self, inputs: DecodeInputs, feed: tuple["PendingStep", np.ndarray] | None = None
                        ) -> "PendingStep":
        """Dispatches a decode step and returns at once (JAX's asynchronous dispatch): its outputs
        stay on the device until `result()`. feed = (an earlier step still pending, src int32 [R]):
        row i takes as its input token row src[i]'s sampled token of that step (-1: the host's
        `inputs.tokens[i]`), so that the next step can be dispatched before the earlier one's
        tokens reached the host (the engine core's overlapped loop; vLLM's async scheduling)."""
        rows = len(inputs.tokens)
        pad = self.info.decode_rows_for(rows) - rows
        # Padding rows are idle slots (all slots from R on are): decoding them writes position 0
        # of a free row, which the next prefill into it overwrites.
        tokens = np.pad(np.asarray(inputs.tokens, np.int32), (0, pad))
        positions = np.pad(np.asarray(inputs.positions, np.int32), (0, pad))
        if feed is not None:
            prev, src = feed
            src = np.pad(np.asarray(src, np.int32), (0, pad), constant_values=-1)
            tokens = self._feed(prev.tokens, tokens, src)
            self.window.dispatched(tokens)
        logits, self.cache = self.model.decode_step(self.cache, tokens, positions)
        self.window.dispatched(logits, programs=2)  # the step and its cache write
        logits = self._to_sample_device(logits)
        # After the dispatch: waiting for a grammar's masks overlaps the device's step.
        sampling = inputs.sampling.padded(rows + pad).resolve()
        out = self._sample(logits, sampling, positions + 1)
        ticket = self.window.dispatched(out)
        return PendingStep(self._jax, out, rows, lambda: self.window.retired(ticket))

    def run_chunk(self, inputs: ChunkInputs) -> StepOutputs | None:
        """Copies the prefix blocks to restore into the slot, runs the chunk and stores its keys
        and values (kept as a prefix block too when asked). Returns the first generated token's
        outputs for the prompt's last chunk, else None (no device-to-host wait)."""
        c = self.info.chunk_size
        for i, block in enumerate(inputs.restore):
            self.cache = self.model.write_chunk(self.cache, self._blocks[block], i * c, c, inputs.slot)
            self.window.dispatched()
        tokens = np.asarray(inputs.tokens, np.int32)[None]
        logits, kv = self.model.prefill_chunk(self.cache, tokens, inputs.start, inputs.length,
                                              inputs.slot, logits=inputs.final)
        self.window.dispatched((logits, kv))
        self.cache = self.model.write_chunk(self.cache, kv, inputs.start, inputs.length, inputs.slot)
        self.window.dispatched()
        if inputs.save_block >= 0:
            if inputs.length != c or tokens.shape[1] != c:
                raise ValueError("only a full chunk can be kept as a prefix block")
            self._blocks[inputs.save_block] = kv
        if not inputs.final:
            return None
        logits = self._to_sample_device(logits)
        out = self._sample(logits, inputs.sampling.resolve(), np.array([inputs.start + inputs.length], np.int32))
        ticket = self.window.dispatched(out)
        host = _to_host(self._jax, out, ())
        self.window.retired(ticket)
        return host

    def move_slot(self, src: int, dst: int) -> None:
        """Copy slot src's KV cache rows into slot dst (the scheduler then treats src as free)."""
        self.cache = self.model.move_slot(self.cache, src, dst)
        self.window.dispatched()

    def _to_sample_device(self, logits):
        if not logits.is_fully_addressable:  # spread over processes: gather to all of them first
            logits = self._replicate(logits).addressable_data(0)
        logits = self._jax.device_put(logits, self._sample_device)
        self.window.dispatched(logits)  # a copy (and a gather): counted as a program
        return logits

    def reset(self) -> None:
        """A fresh cache (after a failed step, whose donated cache may be gone), no prefix blocks."""
        self.window.reset()
        self.cache = self.model.init_cache(self.info.num_slots, self.info.max_seq_len)
        self._blocks.clear()

    def warmup(self, progress: Callable[[str], None] = log.info) -> float:
        """Compiles (or loads from the persistent caches) every prefill bucket at every prefill
        batch size, and runs the decode step at every decode row count, so that no request
        waits for a compile. The prompt-logprobs variant (echo with logprobs) compiles on first
        use. Returns seconds."""
        t0 = time.perf_counter()
        greedy1 = SlotSampling.greedy(1)
        # Every program is compiled ahead of time (compile_programs; a no-op for the ones the
        # model already keeps). One run per batch size, at the smallest bucket, and a greedy and a
        # sampled decode step at every row count, then warm the sampler's programs and check the
        # kept executables end to end.
        compile_programs(self.model, self.info, progress)
        for batch in self.info.prefill_batch_sizes if self.info.warm_buckets else ():
            bucket = next(b for b in self.info.warm_buckets if batch in self.info.batch_sizes_for(b))
            self.run_prefill(pad_prefill_batch([([self.tokenizer.bos_id], 0, greedy1)], bucket, batch))
        for t in self.info.chunk_buckets:
            tokens = np.zeros(t, np.int32)
            tokens[0] = self.tokenizer.bos_id
            self.run_chunk(ChunkInputs(tokens, 0, 1, 0, greedy1, final=True))
        if self.info.chunk_buckets:  # the full chunk without logits (every chunk but a last)
            self.run_chunk(ChunkInputs(tokens, 0, len(tokens), 0, greedy1, final=False))
        for s in self.info.decode_row_counts:
            self.run_decode(DecodeInputs(np.zeros(s, np.int32), np.zeros(s, np.int32), SlotSampling.greedy(s)))
            # The sampler's random branch is part of the same program, but run it once so that
            # its first use is not slower than the others.
            sampled = SlotSampling(np.ones(s, np.float32), np.zeros(s, np.int32), np.ones(s, np.float32),
                                   np.zeros(s, np.uint32))
            self.run_decode(DecodeInputs(np.zeros(s, np.int32), np.zeros(s, np.int32), sampled))
        if len(self.info.decode_batch_sizes) > 1:  # the scheduler packs slots only then
            self.move_slot(0, 0)
        return time.perf_counter() - t0


def runner_info(model, num_slots: int, max_seq_len: int, prefill_batch_sizes: tuple[int, ...] = (1,),
                model_name: str = "gemma3-270m",
                decode_batch_sizes: tuple[int, ...] | None = None, chunk_size: int = 0,
                deterministic: bool = False, prefix_blocks: int = 0) -> RunnerInfo:
    """The shapes and facts a SlotRunner over `model` serves with (no device work: it can be
    computed, and its programs compiled, before the weights are loaded).

    chunk_size: prefill chunk length C (0: no chunked prefill), at most max_seq_len; the last
    chunk of a prompt is padded to the smallest prefill bucket below C that holds it, or C.
    deterministic: batch-invariant mode (needs chunks): every prompt chunked, prompts one at a
    time, decode always over all slots. prefix_blocks: prefix-cache capacity (needs chunks)."""
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    buckets = tuple(b for b in model.prefill_buckets if b < max_seq_len)
    # The largest bucket must hold the longest admissible prompt (max_seq_len - 1 tokens).
    top = model.bucket_for(max_seq_len - 1)
    buckets = tuple(sorted(set(buckets) | {top}))
    chunk_size = min(int(chunk_size), max_seq_len)
    if chunk_size < 0 or prefix_blocks < 0:
        raise ValueError("chunk_size and prefix_blocks must be >= 0")
    if (deterministic or prefix_blocks) and not chunk_size:
        raise ValueError("deterministic mode and the prefix cache need chunked prefill (chunk_size > 0)")
    chunk_buckets = ()
    if chunk_size:
        chunk_buckets = tuple(b for b in model.prefill_buckets if b < chunk_size) + (chunk_size,)
        buckets = tuple(sorted(set(buckets) | {chunk_size}))
    if deterministic:
        # One program per step kind whatever the batch: prompts one at a time, all slots decode.
        prefill_batch_sizes, decode_batch_sizes = (1,), (num_slots,)
    tokenizer = model.tokenizer
    return RunnerInfo(
        model_name=model_name,
        num_slots=num_slots,
        max_seq_len=max_seq_len,
        prefill_buckets=buckets,
        prefill_batch_sizes=tuple(sorted(set(prefill_batch_sizes))),
        vocab_size=model.config.vocab_size,
        eos_ids=tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id, tokenizer.end_of_turn_id))),
        tp=int(model.tp),
        dtype=str(np.dtype(model.dtype).name) if not isinstance(model.dtype, str) else model.dtype,
        allreduce=model.allreduce.to_dict(),
        allreduce_label=model.allreduce.label,
        decode_batch_sizes=decode_batch_sizes_for(num_slots, decode_batch_sizes),
        chunk_size=chunk_size,
        chunk_buckets=chunk_buckets,
        deterministic=bool(deterministic),
        prefix_blocks=int(prefix_blocks),
    )


def compile_programs(model, info: RunnerInfo, progress: Callable[[str], None] = log.info) -> None:
    """Compile, and keep in the model, every program an engine with `info` runs: prefill at
    every (batch, bucket) it uses and the decode step at every row count. Needs only the
    model's shapes, so it may run while the weights load."""
    model.warm_up(info.num_slots, info.max_seq_len,
                  prefill_shapes=[(batch, bucket) for bucket in info.warm_buckets
                                  for batch in info.batch_sizes_for(bucket)],
                  decode_rows=info.decode_row_counts, progress=progress,
                  chunk_sizes=info.chunk_buckets)


def decode_batch_sizes_for(num_slots: int, sizes) -> tuple[int, ...]:
    """Default: powers of two below num_slots, then num_slots (vLLM's CUDA-graph batch sizes
    play the same role). Always ends with num_slots."""
    if sizes is None:
        sizes = [1 << i for i in range(num_slots.bit_length()) if 1 << i < num_slots]
    sizes = sorted(set(int(n) for n in sizes) | {num_slots})
    if sizes[0] < 1 or sizes[-1] > num_slots:
        raise ValueError(f"decode batch sizes must lie in 1..{num_slots}, got {sizes}")
    return tuple(sizes)


def _last_logits(logits, lengths):
    """[B, T, V] logits at every position -> [B, V] at each prompt's last real token."""
    return logits[np.arange(logits.shape[0]), lengths - 1]


class PendingStep:
    """A dispatched step (a slot engine's decode, a paged engine's ragged step): its sampled
    tokens as a device array (`tokens`, padded rows, to feed a later step; None for a step that
    samples nothing) and, on `result()`, its outputs on the host (waits for the device): the
    first `rows` rows of the sampled token's outputs, or with rows None every output whole."""

    def __init__(self, jax, out, rows: int | None = None,
                 on_result: Callable[[], None] = lambda: None):
        self._jax, self._out, self.rows = jax, out, rows
        self.tokens = None if out is None else out[0]
        self._host: StepOutputs | None = None
        self._on_result = on_result  # told once the outputs are on the host

    def result(self) -> StepOutputs | None:
        if self._out is not None:
            host = StepOutputs(*self._jax.device_get(tuple(self._out)))
            if self.rows is not None:
                host = StepOutputs(*(a[:self.rows] for a in host[:4]))
            self._host, self._out = host, None
            self._on_result()
        return self._host


def feed_tokens(prev, host, src):
    """Input tokens of a step: row i is prev[src[i]] (a token still on the device) where
    src[i] >= 0, else host[i]."""
    import jax.numpy as jnp

    return jnp.where(src >= 0, prev[jnp.clip(src, 0, prev.shape[0] - 1)], host)


def _to_host(jax, out, extra) -> StepOutputs:
    host = jax.device_get((tuple(out), tuple(extra)))
    (tokens, logprobs, top_ids, top_lps), extra = host
    if extra:
        return StepOutputs(tokens, logprobs, top_ids, top_lps, *extra)
    return StepOutputs(tokens, logprobs, top_ids, top_lps)

