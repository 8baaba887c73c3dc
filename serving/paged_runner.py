"""The paged engine's model runner: one ragged model step over a paged KV cache, plus on-device
sampling. `paged_steps.step_inputs` turns a scheduler plan into numpy arrays padded to a few
`StepShape`s (bounding the compiled programs); `run_step` runs them and returns the sampled
tokens. It knows nothing of requests or HTTP. See docs/engine.md, "The paged engine"."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Callable

import numpy as np

from serving import dispatch_window
from serving.runner import RunnerInfo, PendingStep, StepOutputs, feed_tokens
from serving.kv_pages import KVPages
from serving.paged_steps import (MIN_TOKENS, STEP_BUDGET, Split, StepInputs,
                                 decode_buckets, deterministic_parts, later_buckets,
                                 local_pages_for, step_inputs)
from models.gemma3.tokenizer import never_generate_ids
from models.shapes import StepShape, pow2
from serving.sampling import IDLE

log = logging.getLogger(__name__)

# The warm-up runs a lone prompt in every token bucket up to this many tokens, and its decode:
# a first chat request (its template adds ~10 tokens) or a short completion then waits for no
# compile (each took ~3 s for the 270M on a CPU, more on a TPU host); longer prompts are rarer
# first requests and their pieces compile on first use.
SHORT_PROMPT_TOKENS = 64
# The default `long_prefill_token_threshold` (C: the longest prompt piece while others run or
# wait). Outside deterministic mode a piece of C tokens while others run keeps their
# inter-token latency to one small step, and a lone prompt takes the whole budget anyway. In
# deterministic mode every piece is C tokens in a one-row program of its own, one a step,
# whether or not the prompt is alone: at 16 a long prompt takes 4x the steps of 64, each about
# half as long (docs/engine.md, deterministic mode).
DEFAULT_THRESHOLD = 16
DETERMINISTIC_THRESHOLD = 64


class PagedRunner:
    """The paged engine's runner over a `models.gemma3` model (see the module docstring).

    max_num_seqs: sequences running at once; kv_cache_tokens: the global layers' pool in tokens
    (the sum of the contexts the running sequences may hold; default max_num_seqs x
    max_seq_len); the local (sliding-window) pool holds every running sequence's window plus a
    quarter more, which keeps the windows of recent prompts for prefix-cache hits.
    long_prefill_token_threshold: the most prompt tokens one sequence computes in a step while
    others run (a multiple of page_size; 0 or None: `default_long_prefill_token_threshold`);
    max_num_batched_tokens: the step's token budget, which a lone sequence's prompt takes whole
    (default `STEP_BUDGET`; in deterministic mode, where every step has the budget's shape,
    max_num_seqs + long_prefill_token_threshold: every decode plus one prompt piece)."""

    def __init__(self, model, *, max_num_seqs: int, max_seq_len: int, page_size: int = 16,
                 kv_cache_tokens: int | None = None, long_prefill_token_threshold: int | None = None,
                 max_num_batched_tokens: int | None = None, prefix_caching: bool = True,
                 deterministic: bool = False, model_name: str = "gemma3-270m"):
        import jax

        from serving import sampling

        self.model = model
        self.tokenizer = model.tokenizer
        self.info = paged_runner_info(model, max_num_seqs, max_seq_len, page_size, kv_cache_tokens,
                                      long_prefill_token_threshold, max_num_batched_tokens,
                                      prefix_caching, deterministic, model_name)
        self._jax = jax
        self.pages = model.init_pages(self.info.num_global_pages, self.info.num_local_pages,
                                      page_size)
        self._sample_device = next(d for d in model.mesh.devices.flat
                                   if d.process_index == jax.process_index())
        self._sample = sampling.make_sampler(
            self.info.token_ids if self.info.token_ids < self.info.vocab_size else None,
            self.info.never_generate)
        self._token_logprobs = jax.jit(sampling.token_logprobs)
        self._feed = jax.jit(feed_tokens)
        # Deterministic mode: the rows of a step's programs' outputs in the step's order.
        self._rows = jax.jit(lambda parts, rows: jax.numpy.concatenate(parts)[rows])
        # In a multi-process group the logits are split over the processes: each one gathers
        # them (one collective program, the same on all of them) and samples on its own device.
        self._replicated = jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec())
        self._replicate = jax.jit(lambda x: x, out_shardings=self._replicated)
        local = [d for d in model.mesh.devices.flat if d.process_index == jax.process_index()]
        self.window = dispatch_window.DispatchWindow(
            lambda: self.pages,
            dispatch_window.DEFAULT_LIMIT if dispatch_window.needed(local) else 0)
        self.programs_run: set[StepShape] = set()
        self._compiled: list[StepShape] = []  # every step shape, compiled ahead (compile_warmup)
        self._encoder = None  # serving.image_encoder.ImageEncoder, made on first use
        self.encoder_budget_flops = None  # encoder work a step; None: one prompt piece's FLOPs
        self._spans = None  # serving.image_spans.SpanWriter, made on first use
        # key -> features, where they come from elsewhere: a group's other processes take
        # process 0's (serving/group_images.py). None: this process's own encoder.
        self.features_from: Callable[[str], object] | None = None

    @property
    def encoder(self):
        """The features cache and staged encoder (serving/image_encoder.py), for a model with a
        tower."""
        if self._encoder is None:
            from serving.image_encoder import ImageEncoder
            self._encoder = ImageEncoder(self.model, self.info.long_prefill_token_threshold,
                                         self.info.deterministic, self.encoder_budget_flops)
        return self._encoder

    @property
    def images_encoded(self) -> int:
        return self._encoder.images_encoded if self._encoder is not None else 0

    def image_ready(self, key: str) -> bool:
        """Whether the features of the image with content hash `key` are ready (the scheduler
        keeps a prompt's piece short of an image until they are)."""
        return self.encoder.ready(key)

    def advance_images(self, wanted, bounded: bool = True, spent: float = 0.0) -> float:
        """Runs a bounded piece of the encoder for the images the scheduler waits for
        (StepPlan.encode), a larger one where nothing else runs (bounded=False,
        `ImageEncoder.whole_call_flops`); returns its FLOPs. spent: FLOPs the step's span work
        already took of the same budget."""
        return self.encoder.advance(wanted, bounded, spent)

    @property
    def spans(self):
        """The image spans written a layer at a time between steps (serving/image_spans.py)."""
        if self._spans is None:
            from serving.image_spans import SpanWriter
            self._spans = SpanWriter(self, self.encoder_budget_flops)
        return self._spans

    def span_written(self, job) -> bool:
        """Whether the keys of a paged_scheduler.SpanJob are all stored (its sequence may go on)."""
        return self.spans.written(job)

    def advance_spans(self, jobs, kv: KVPages, bounded: bool = True) -> float:
        """Runs a bounded piece of the image spans being written (StepPlan.spans), or all of
        it where nothing else runs (bounded=False); returns its FLOPs."""
        return self.spans.advance(jobs, kv, bounded)

    def image_features(self, image):
        """Features [n * tokens_per_image, D] (on the device) of a sequence.SeqImage, from the
        cache, or the whole encoder at once for a caller that did not wait for them."""
        if self.features_from is not None:
            return self.features_from(image.key)
        return self.encoder.features(image)

    def _image_rows(self, inputs: StepInputs):
        from models.gemma3.ragged import ImageRows

        if not inputs.images:
            return None
        jnp = self._jax.numpy
        rows = [self.image_features(im) for im in inputs.images]
        pad = inputs.buckets.features - sum(r.shape[0] for r in rows)
        if pad:
            rows.append(jnp.zeros((pad, rows[0].shape[1]), rows[0].dtype))
        feats = rows[0] if len(rows) == 1 else jnp.concatenate(rows)
        return ImageRows(features=self.on_every_process(feats), index=inputs.image_index)

    def run_step(self, inputs: StepInputs) -> StepOutputs | None:
        """Runs one ragged step; returns the sampled tokens of its S rows (rows that do not
        sample hold junk), or None for a step that samples nothing (no device-to-host wait)."""
        return self.dispatch_step(inputs).result()

    def dispatch_step(self, inputs: StepInputs, prev: PendingStep | None = None
                      ) -> PendingStep:
        """Dispatches one ragged step and returns at once (JAX's asynchronous dispatch); its
        outputs stay on the device until `result()`. prev: the step in flight whose sampled
        tokens feed this one's (`StepInputs.feed`). In deterministic mode a step's decode rows
        and its prompt piece run in programs of their own (`paged_steps.deterministic_parts`)."""
        split = self._split(inputs)
        outs = [self._logits(part, prev) for part in split.parts]
        if not inputs.buckets.logits:
            return PendingStep(self._jax, None)
        logits = outs[0][0] if split.rows is None else self._rows([o[0] for o in outs], split.rows)
        out = tuple(self._sample(logits, inputs.sampling.resolve(), inputs.sample_positions))
        every = outs[-1][1]
        if every is not None:  # [T] logprobs of each token's next token, [T, K] top ones
            lps = tuple(self._token_logprobs(every, split.parts[-1].targets))
            out += lps if split.tokens is None else tuple(self._rows([x], split.tokens) for x in lps)
        ticket = self.window.dispatched(out)
        return PendingStep(self._jax, out, on_result=lambda: self.window.retired(ticket))

    def _split(self, inputs: StepInputs) -> Split:
        """The programs a step runs as: itself, or in deterministic mode its parts."""
        if self.info.deterministic:
            return deterministic_parts(inputs, self.info)
        return Split([inputs], None, None)

    def _logits(self, inputs: StepInputs, prev: PendingStep | None):
        """Dispatches one ragged program: (its row logits, its every-token logits or None) on
        the sampling device; (None, None) for a program that returns no logits."""
        from models.gemma3.ragged import RaggedBatch

        self.programs_run.add(inputs.buckets)
        fields = dict(inputs.batch)
        if inputs.feed is not None:
            if prev is None or prev.tokens is None:
                raise ValueError("a step fed from the step in flight needs that step")
            fields["tokens"] = self._feed(prev.tokens, np.stack([fields["tokens"], inputs.feed]))
            self.window.dispatched(fields["tokens"])
            fields["tokens"] = self.on_every_process(fields["tokens"])
        batch = RaggedBatch(**fields)
        images = self._image_rows(inputs)  # ready features (the encoder ran in earlier steps)
        every = None
        if inputs.buckets.every_token:
            if images is not None:
                raise ValueError("prompt logprobs of a prompt with images are not served")
            logits, every, self.pages = self.model.ragged_step(self.pages, batch,
                                                               every_token=True)
        else:
            logits, self.pages = self.model.ragged_step(
                self.pages, batch, logits=inputs.buckets.logits, images=images)
        self.window.dispatched(logits)
        if not inputs.buckets.logits:
            return None, None
        if not getattr(logits, "is_fully_addressable", True):
            logits = self._replicate(logits).addressable_data(0)
            self.window.dispatched(logits)
            if every is not None:
                every = self._replicate(every).addressable_data(0)
        logits = self._jax.device_put(logits, self._sample_device)
        self.window.dispatched(logits)
        if every is not None:
            every = self._jax.device_put(every, self._sample_device)
        return logits, every

    def on_every_process(self, x):
        """x, on this process's device, as the mesh's replicated array in a multi-process
        group (else x as it is), without a transfer between processes (which `device_put`
        cannot make of a one-device array in a group): each process places its own copy on its
        own devices. Right only where every process holds the same values, as it does for the
        fed tokens (`distributed.Follower` says why) and for image features and spans
        (serving/group_images.py)."""
        jax = self._jax
        if self._replicated.is_fully_addressable:
            return x
        shards = [jax.device_put(x, d)
                  for d in sorted(self._replicated.addressable_devices, key=lambda d: d.id)]
        return jax.make_array_from_single_device_arrays(x.shape, self._replicated, shards)

    def reset(self) -> None:
        """Fresh pages (after a failed step, whose donated pages may be gone)."""
        self.window.reset()
        self.pages = self.model.init_pages(self.info.num_global_pages, self.info.num_local_pages,
                                           self.info.page_size)

    def warmup(self, progress: Callable[[str], None] = log.info) -> float:
        """Runs the steps every server meets first, so that they do not wait for a compile: a
        lone short prompt in each token bucket up to SHORT_PROMPT_TOKENS (a first chat or
        completion request) and its decode, a lone prompt of the
        whole budget, a full batch's prompts and decode. `compile_warmup` compiles these and
        the decodes (`decode_buckets`) beforehand; other programs (pieces beside other work,
        longer prompts' pieces, other batch sizes) compile on first use. Returns seconds."""
        t0 = time.perf_counter()
        self._warmup_steps(self.run_step, progress)
        self._warm_small_programs(self._compiled or list(self.programs_run))
        self.reset()
        return time.perf_counter() - t0

    def _warm_small_programs(self, buckets: list[StepShape]) -> None:
        """Runs the programs a step runs beside the model's once at each of their shapes: the
        samplers (greedy and full) at each row count, the feed of a step's tokens from the
        step before at each pair of row and token counts. So that, after a compile of every
        step shape, no step compiles anything while serving."""
        from serving.sampling import SamplingMetadata

        jnp = self._jax.numpy
        rows = sorted({b.seqs for b in buckets if b.logits})
        tokens = sorted({b.tokens for b in buckets})
        out = None
        for s in rows:
            logits = self._jax.device_put(jnp.zeros((s, self.info.vocab_size), jnp.float32),
                                          self._sample_device)
            greedy, pos = SamplingMetadata.greedy(s), np.zeros(s, np.int32)
            out = self._sample(logits, greedy, pos)
            self._sample(logits, greedy._replace(temperature=np.ones(s, np.float32)), pos)
            for t in tokens:
                self._feed(out.tokens, np.zeros((2, t), np.int32))
        self._jax.block_until_ready(out)

    def compile_warmup(self, progress: Callable[[str], None] = log.info,
                       everything: bool = False) -> None:
        """Compiles, without running, the ragged programs `warmup` runs and the decode steps
        of a lone sequence and of a full batch (`decode_buckets`), or with everything=True
        every text step shape these settings allow (`later_buckets`), several at a time
        (`compile_workers`). The server calls it before the warm-up; a multi-process group
        also meets at a barrier after it (serving/runtime.py), so that the warm-up's first
        collective starts in every process at once however long each compiled."""
        seen: list[StepShape] = []

        def plan_only(inputs: StepInputs):
            seen.extend(p.buckets for p in self._split(inputs).parts if p.buckets not in seen)
            return StepOutputs(*(np.full(inputs.buckets.seqs, self.tokenizer.bos_id, np.int32),) * 4)

        self._warmup_steps(plan_only, lambda msg: None)
        seen += [b for b in decode_buckets(self.info) if b not in seen]
        if everything:
            seen += [b for b in later_buckets(self.info) if b not in seen]
            self._compiled = seen
        self.model.compile_ragged([self._key(b) for b in seen], workers=compile_workers(),
                                  progress=progress)

    def later_programs(self) -> list:
        """The program keys of the step shapes the warm-up did not compile
        (`paged_steps.later_buckets`), smallest contexts first: for a background compiler."""
        kept = self.model.programs.kept()
        return [k for k in map(self._key, later_buckets(self.info)) if k not in kept]

    def _key(self, b: StepShape):
        """The model's program key of a step of shape `b` over this runner's pages."""
        return self.model.ragged_key(b, self.pages)

    def _warmup_steps(self, run: Callable[[StepInputs], StepOutputs | None],
                      progress: Callable[[str], None]) -> None:
        """The warm-up's steps, each given to `run`: a lone prompt, then a full batch, each
        sequence until it has two tokens (a prompt piece's and a decode's)."""
        from serving.paged_scheduler import PagedScheduler
        from serving.sequence import Sequence

        info = self.info
        # (rows, prompt length) of each warm-up round: short lone prompts of MIN_TOKENS,
        # 2 MIN_TOKENS, ... tokens (one per token bucket; a lone decode at the smallest page
        # bucket after them), a lone prompt of the whole budget, a full batch of chunks.
        short = [] if info.deterministic else [
            n for n in (MIN_TOKENS << i for i in range(8))
            if n <= min(SHORT_PROMPT_TOKENS, info.max_num_batched_tokens, info.max_seq_len - 3)]
        rounds = [(1, n) for n in short] + [(1, info.max_num_batched_tokens + 1)]
        if info.max_num_seqs > 1:
            rounds.append((info.max_num_seqs, info.long_prefill_token_threshold + 1))
        for n_seqs, length in rounds:
            sched = PagedScheduler(dataclasses.replace(info, prefix_caching=False))
            prompt = [self.tokenizer.bos_id] * min(length, info.max_seq_len - 1)
            sched.add([Sequence(id=i, prompt=list(prompt), params=IDLE, seed=0)
                       for i in range(n_seqs)])
            for _ in range(64):
                plan = sched.schedule()
                if not plan.pieces:
                    break
                out = run(step_inputs(plan, sched.kv, info))
                progress(f"warm-up step {plan.num_tokens} token(s), {len(plan.pieces)} row(s)")
                for row, p in enumerate(plan.pieces):
                    if p.sample:
                        p.seq.generated.append(int(out.tokens[row]))
                # A sequence with its two tokens ends, as a request of max_tokens=2 would:
                # kept running, it would decode past --max-seq-len and hold pages the waiting
                # ones need.
                for s in sched.running:
                    if len(s.generated) >= 2:
                        sched.finish(s)


def compile_workers() -> int:
    """Programs compiled at once before serving: XLA compiles with the GIL released, each
    compile mostly on one core; the tracing before it holds the GIL."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def default_long_prefill_token_threshold(deterministic: bool, page_size: int, max_seq_len: int,
                                         max_num_batched_tokens: int | None = None) -> int:
    """The longest prompt piece when none is given: `DETERMINISTIC_THRESHOLD` tokens in
    deterministic mode, `DEFAULT_THRESHOLD` otherwise, no longer than the context or a given step
    budget, in whole pages (one at least)."""
    c = min(DETERMINISTIC_THRESHOLD if deterministic else DEFAULT_THRESHOLD, max_seq_len,
            max_num_batched_tokens or max_seq_len)
    return max(page_size, c - c % page_size)


def paged_runner_info(model, max_num_seqs: int, max_seq_len: int, page_size: int,
                      kv_cache_tokens: int | None, long_prefill_token_threshold: int | None,
                      max_num_batched_tokens: int | None, prefix_caching: bool,
                      deterministic: bool, model_name: str) -> RunnerInfo:
    """The facts a PagedRunner over `model` serves with (no device work)."""
    c = model.config
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if not 2 <= max_seq_len <= c.max_seq_len:
        raise ValueError(f"max_seq_len must lie in 2..{c.max_seq_len}, got {max_seq_len}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    threshold = long_prefill_token_threshold or default_long_prefill_token_threshold(
        deterministic, page_size, max_seq_len, max_num_batched_tokens)
    if threshold < page_size or threshold % page_size:
        raise ValueError(f"long_prefill_token_threshold ({threshold}) must be a positive multiple "
                         f"of page_size ({page_size})")
    budget = max_num_batched_tokens or (max_num_seqs + threshold if deterministic
                                        else max(STEP_BUDGET, max_num_seqs + threshold))
    if budget < threshold:
        raise ValueError(f"max_num_batched_tokens ({budget}) must be >= long_prefill_token_threshold "
                         f"({threshold}): a prompt piece must fit one step")
    tokens = kv_cache_tokens or max_num_seqs * max_seq_len
    if tokens < max_seq_len:
        raise ValueError(f"kv_cache_tokens ({tokens}) must hold at least one sequence of "
                         f"max_seq_len ({max_seq_len}) tokens")
    has_local = any(not c.is_global(i) for i in range(c.num_layers))
    has_global = any(c.is_global(i) for i in range(c.num_layers))
    window = c.sliding_window if has_local else None
    per_seq_local = local_pages_for(pow2(threshold), window, page_size)
    # ... and room for a lone prompt's whole-budget piece, whose window reaches further back,
    # run on to the end of an image's soft tokens it ends inside (`PagedScheduler._past_images`):
    # a piece that no pool can hold would preempt its sequence at the same place for ever.
    vision = getattr(model, "vision", None)
    image = vision.config.tokens_per_image if vision is not None else 0
    local_pages = max(max_num_seqs * per_seq_local * 5 // 4,
                      local_pages_for(pow2(budget) + image, window, page_size))
    tokenizer = model.tokenizer
    never = set(never_generate_ids(tokenizer))
    if vision is not None:  # the ids the checkpoint's config gives its image tokens
        never.update((vision.tokens.start, vision.tokens.end, vision.tokens.soft))
    token_ids = min(c.vocab_size, tokenizer.vocab_size)
    num_global = math.ceil(tokens / page_size) + 1 if has_global else 2
    num_local = local_pages + 1 if has_local else 2
    # The pools' real bytes (codes and scales), from their shapes (the fake model has none).
    shapes = getattr(model, "pages_shapes", None)
    kv_bytes = shapes(num_global, num_local, page_size).nbytes if shapes else 0
    return RunnerInfo(
        model_name=model_name,
        max_num_seqs=max_num_seqs,
        max_seq_len=max_seq_len,
        vocab_size=c.vocab_size,
        tokenizer_vocab_size=tokenizer.vocab_size,
        never_generate=tuple(sorted(i for i in never if 0 <= i < token_ids)),
        eos_ids=tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id, tokenizer.end_of_turn_id))),
        tp=int(model.tp),
        dtype=str(np.dtype(model.dtype).name) if not isinstance(model.dtype, str) else model.dtype,
        allreduce=model.allreduce.to_dict(),
        allreduce_label=model.allreduce.label,
        weights=model.weights_summary() if hasattr(model, "weights_summary") else {},
        long_prefill_token_threshold=threshold,
        deterministic=bool(deterministic),
        prefix_caching=bool(prefix_caching),
        page_size=page_size,
        num_global_pages=num_global,
        num_local_pages=num_local,
        kv_cache_dtype=getattr(model, "kv_cache_dtype", "auto"),
        kv_cache_bytes=kv_bytes,
        max_num_batched_tokens=budget,
        sliding_window=window,
        has_global_layers=has_global,
        attention=model.paged_attention,
    )
