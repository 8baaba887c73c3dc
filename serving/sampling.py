"""Per-request sampling: host-side parameters (`SamplingParams`, validated) and the project's one
on-device sampler, for the server and offline generation (`serving.LLM`). One jitted function
samples every row of a step, each with its own temperature, top-k, top-p and seed; a token is
drawn with `fold_in(key(seed), position)`, so batching never changes a seeded answer. See
docs/engine.md, "The sampler", for why it samples among each row's top 256 logits."""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serving import wire

NUM_CANDIDATES = 256
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # OpenAI's limit
# A token id no vocabulary reaches: padding entries of LogitsExtras, dropped by the scatters.
UNUSED_ID = 2**30
_BLOCK = 512
_BISECT_STEPS = 40
# Seeds are accepted as signed 64-bit integers and reduced to 32 bits on device.
_MAX_SEED = 2**63
_MAX_INT32 = 2**31 - 1
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): divided by ~1e-9 the logits reach
# ~1e10, where float32 rounds every candidate's probability to 0 and the draw is meaningless.
GREEDY_BELOW = 1e-5


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one sequence is generated (host side, validated on construction).

    temperature 0 means greedy (one below GREEDY_BELOW is made 0). top_k <= 0 and top_p == 1
    disable those filters. logprobs: None for none, else the number of alternatives (0..20)
    reported beside each chosen token's logprob. seed None draws a fresh seed per request.

    Logits processing (vLLM's meaning, applied in this order before temperature): penalties over
    the tokens seen so far (repetition_penalty over prompt and output, presence and frequency over
    the output), logit_bias ({token id: bias}, -100..100; -100 bans a token in effect), tokens
    banned while fewer than min_tokens were generated (EOS and stop_token_ids), the grammar's
    allowed tokens (`grammar`, see serving.structured_output); after temperature, min_p drops the
    tokens less likely than min_p times the most likely one.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # A compiled grammar (serving.structured_output.Grammar) the output must match, or None.
    grammar: object | None = None

    def __post_init__(self):
        _check_int("max_tokens", self.max_tokens, low=1, high=_MAX_INT32)
        # Any temperature a float32 row can divide by (1e308 would overflow to inf there).
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.temperature < GREEDY_BELOW:  # here, so that every reader sees the greedy row
            object.__setattr__(self, "temperature", 0.0)
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or not (0.0 < self.top_p <= 1.0):
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, low=-1, high=_MAX_INT32)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-_MAX_SEED, high=_MAX_SEED - 1)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameter("stop", "stop must be non-empty strings")
        if len(self.stop) > 16:
            raise InvalidParameter("stop", "at most 16 stop strings are supported")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0, high=_MAX_INT32)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_TOP_LOGPROBS)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParameter("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        for t, b in self.logit_bias:
            _check_int("logit_bias", t, low=0, high=_MAX_INT32)
            _check_float("logit_bias", b, -100.0, 100.0)
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidParameter("logit_bias", "logit_bias names a token twice")
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)

    def seed32(self, fallback: int) -> int:
        """The 32-bit seed used on device; `fallback` (random) when the request gave none."""
        return (fallback if self.seed is None else self.seed) % (2**32)

    @staticmethod
    def choice_seed(seed: int | None, j: int) -> int | None:
        """The seed of a request's choice j (n > 1 draws with seed, seed + 1, ...): `seed` is
        checked as the client sent it, then seed + j wraps into the signed 64-bit range, so that
        every valid seed takes n choices (the device seeds, mod 2**32, run on unchanged)."""
        if seed is None:
            return None
        _check_int("seed", seed, low=-_MAX_SEED, high=_MAX_SEED - 1)
        return (seed + j + _MAX_SEED) % (2 * _MAX_SEED) - _MAX_SEED

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_extras(self) -> bool:
        """Whether this sequence's rows need the logits-processing inputs (`LogitsExtras`)."""
        return bool(self.has_penalties or self.logit_bias or self.min_tokens or self.min_p > 0
                    or self.grammar is not None)


def check_generable(params: SamplingParams, never_generate: tuple[int, ...]) -> None:
    """InvalidParameter when `params` raise the odds of an id the model never generates (a
    positive logit_bias on one of `never_generate`): the sampler would silently ignore it."""
    never = set(never_generate)
    bad = sorted(t for t, b in params.logit_bias if b > 0 and t in never)
    if bad:
        raise InvalidParameter("logit_bias", "logit_bias raises token ids this model never "
                               f"generates (image tokens, tokens its checkpoint suppresses): {bad[:5]}")


def checked_defaults(values: dict, source: str) -> dict:
    """Sampling defaults (SamplingParams fields by name) checked as a request's values are, so
    that a bad one fails at start-up, naming `source`, rather than every request."""
    try:
        SamplingParams(**values)
    except InvalidParameter as e:
        raise ValueError(f"{source}: {e}") from None
    except TypeError as e:
        raise ValueError(f"{source}: not sampling parameters: {e}") from None
    return dict(values)


MAX_TEMPERATURE = 1e4


def _check_float(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not np.isfinite(value) \
            or value > high or value < low or (low_open and value == low):
        raise InvalidParameter(name, f"{name} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], "
                               f"got {value!r}")


def _check_int(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidParameter(name, f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidParameter(name, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidParameter(name, f"{name} must be <= {high}, got {value}")


class LogitsExtras(NamedTuple):
    """Per-row logits processing of a step, present only when some row of the step needs it (the
    sampler then runs its processing variant; rows that need nothing carry neutral values).

    Shapes are padded to a few sizes so that the variants stay few: K (bias entries) and L (tokens
    seen, for penalties; 0 when no row has a penalty) to powers of two."""

    mask: np.ndarray | None  # int32 [B, ceil(V/32)] allowed-token bits (grammar), or None: no grammar row
    bias_ids: np.ndarray  # int32 [B, K]; UNUSED_ID marks an unused entry
    bias_vals: np.ndarray  # float32 [B, K] added to the logits (-inf: banned)
    min_p: np.ndarray | None  # float32 [B], or None: no row uses min_p
    presence: np.ndarray  # float32 [B]
    frequency: np.ndarray  # float32 [B]
    repetition: np.ndarray  # float32 [B]
    seen_ids: np.ndarray  # int32 [B, L] prompt and output tokens; UNUSED_ID is padding
    seen_output: np.ndarray  # bool [B, L] whether the entry is an output token

    @staticmethod
    def neutral(n: int, k: int = 0, length: int = 0, mask_words: int | None = None,
                min_p: bool = False) -> "LogitsExtras":
        return LogitsExtras(
            mask=None if mask_words is None else np.full((n, mask_words), -1, np.int32),
            bias_ids=np.full((n, k), UNUSED_ID, np.int32), bias_vals=np.zeros((n, k), np.float32),
            min_p=np.zeros(n, np.float32) if min_p else None, presence=np.zeros(n, np.float32),
            frequency=np.zeros(n, np.float32), repetition=np.ones(n, np.float32),
            seen_ids=np.full((n, length), UNUSED_ID, np.int32), seen_output=np.zeros((n, length), bool))


# The parameters of a row that samples nothing useful (an idle row, a warm-up sequence).
IDLE = SamplingParams(max_tokens=1, temperature=0.0)


class SamplingMetadata(NamedTuple):
    """Sampling parameters of every row of a step, as plain arrays (the device program's input;
    vLLM's name)."""

    temperature: np.ndarray  # float32 [B]; 0 = greedy
    top_k: np.ndarray  # int32 [B]; 0 = off
    top_p: np.ndarray  # float32 [B]
    seed: np.ndarray  # uint32 [B]
    # Logits processing, None when no row needs it. Its mask may still be a pending computation
    # (an object with `result()`): `resolve` waits for it; the engine calls it after dispatching
    # the model's step, so that the grammar's host work overlaps the device's.
    extras: LogitsExtras | None = None
    # int32 [B]: the top alternatives each row reports beside its token (logprobs); None:
    # not known, as many as the sampler gives. Lets a step that needs none skip finding them.
    top_logprobs: np.ndarray | None = None

    # How each field travels to a group's other processes (serving/wire.py). The logits
    # processing stays on process 0: only its sampled tokens are used (the others' samplers run
    # on their own devices, no collective, and their tokens are dropped).
    WIRE = dict(temperature=wire.Array(np.float32), top_k=wire.Array(np.int32),
                top_p=wire.Array(np.float32), seed=wire.Array(np.uint32), extras=wire.Stays(None),
                top_logprobs=wire.Optional(wire.Array(np.int32)))

    @staticmethod
    def of(params: list[SamplingParams], seeds: list[int]) -> "SamplingMetadata":
        return SamplingMetadata(
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array([max(p.top_k, 0) for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            seed=np.array(seeds, np.uint32),
            top_logprobs=np.array([p.logprobs or 0 for p in params], np.int32),
        )

    @staticmethod
    def of_rows(rows) -> "SamplingMetadata":
        """Each row's sequence's parameters and seed (objects with `params` and `seed`), greedy
        for an idle row (None), which then costs the sampler nothing."""
        return SamplingMetadata.of([IDLE if r is None else r.params for r in rows],
                                   [0 if r is None else r.seed for r in rows])

    @staticmethod
    def greedy(n: int) -> "SamplingMetadata":
        return SamplingMetadata(np.zeros(n, np.float32), np.zeros(n, np.int32),
                                np.ones(n, np.float32), np.zeros(n, np.uint32),
                                top_logprobs=np.zeros(n, np.int32))

    @staticmethod
    def concat(parts: list["SamplingMetadata"]) -> "SamplingMetadata":
        """Rows of several samplings, in order (pending masks resolved)."""
        parts = [p.resolve() for p in parts]
        base = [np.concatenate([getattr(p, f) for p in parts])
                for f in SamplingMetadata._fields[:4]]
        top = (None if any(p.top_logprobs is None for p in parts)
               else np.concatenate([p.top_logprobs for p in parts]))
        if all(p.extras is None for p in parts):
            return SamplingMetadata(*base, top_logprobs=top)
        n_rows = [len(p.temperature) for p in parts]
        extras = [p.extras for p in parts]
        extras = [LogitsExtras.neutral(n) if e is None else e for n, e in zip(n_rows, extras)]
        k = max(e.bias_ids.shape[1] for e in extras)
        length = max(e.seen_ids.shape[1] for e in extras)
        words = next((e.mask.shape[1] for e in extras if e.mask is not None), None)
        any_min_p = any(e.min_p is not None for e in extras)
        cat = []
        for name in LogitsExtras._fields:
            arrays = []
            for n, e in zip(n_rows, extras):
                a = getattr(e, name)
                if name == "mask":
                    a = None if words is None else (np.full((n, words), -1, np.int32) if a is None else a)
                elif name == "min_p":
                    a = None if not any_min_p else (np.zeros(n, np.float32) if a is None else a)
                elif name in ("bias_ids", "bias_vals", "seen_ids", "seen_output"):
                    width = k if name.startswith("bias") else length
                    fill = UNUSED_ID if name in ("bias_ids", "seen_ids") else 0
                    a = np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)
                arrays.append(a)
            cat.append(None if arrays[0] is None else np.concatenate(arrays))
        return SamplingMetadata(*base, LogitsExtras(*cat), top)

    def padded(self, n: int) -> "SamplingMetadata":
        """These rows then greedy idle rows up to n in all."""
        pad = n - len(self.temperature)
        if pad <= 0:
            return self
        return SamplingMetadata.concat([self.resolve(), SamplingMetadata.greedy(pad)])

    def resolve(self) -> "SamplingMetadata":
        """The same rows with a pending grammar mask computed (waits for it)."""
        e = self.extras
        if e is None or e.mask is None or isinstance(e.mask, np.ndarray):
            return self
        return self._replace(extras=e._replace(mask=e.mask.result()))


class SampleOutput(NamedTuple):
    tokens: jax.Array  # int32 [B]
    logprobs: jax.Array  # float32 [B]: log p(token) under the model's (untempered) distribution
    top_ids: jax.Array  # int32 [B, MAX_TOP_LOGPROBS]
    top_logprobs: jax.Array  # float32 [B, MAX_TOP_LOGPROBS]


# top_k value meaning "no top-k filter" inside the device program.
_K_OFF = np.iinfo(np.int32).max


def sample(logits: jax.Array, params: SamplingMetadata, positions: jax.Array,
           vocab: int | None = None, never_generate: tuple[int, ...] = ()) -> SampleOutput:
    """Draws one token per row. logits float32 [B, V]; positions int32 [B]: the position the drawn
    token will occupy (with the seed it selects the random stream). With `params.extras`, the
    logits are processed first (`process_logits`); reported logprobs are those of the processed
    distribution before temperature. Ids the model must not emit are never drawn nor counted:
    `vocab` < V, those at or past it (a checkpoint's embedding padded past its tokenizer's
    vocabulary), and `never_generate` (`Bans`)."""
    logits = logits.astype(jnp.float32)
    ex = params.extras
    if ex is not None:
        logits = process_logits(logits, ex)
    b, v = logits.shape
    bans = Bans.of(v, vocab, never_generate)
    logits = bans.mask_all(logits)
    lse = bans.logsumexp(logits)
    cand_vals, cand_ids = bans.top_k(logits, min(NUM_CANDIDATES, v))
    greedy_tok = cand_ids[:, 0]
    do_sample = params.temperature > 0

    def sampled_tokens():
        temp = jnp.where(do_sample, params.temperature, 1.0)[:, None]
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(params.seed, positions)
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
        top_k = jnp.where((params.top_k <= 0) | (params.top_k >= v), _K_OFF, params.top_k)
        z = logits / temp
        zc = cand_vals / temp
        if ex is not None and ex.min_p is not None:  # keep p >= min_p * p_max (log 0 = -inf keeps all)
            floor = zc[:, :1] + jnp.log(ex.min_p)[:, None]
            z = jnp.where(z >= floor, z, -jnp.inf)
            zc = jnp.where(zc >= floor, zc, -jnp.inf)
        lse_z = bans.logsumexp(z)
        fast_ok, fast_tok = _sample_candidates(zc, cand_ids, lse_z, top_k, params.top_p, u)
        full = do_sample & ~fast_ok
        full_tok = jax.lax.cond(
            jnp.any(full),
            lambda: _sample_full(bans.mask(z), lse_z, jnp.where(full, top_k, _K_OFF),
                                 jnp.where(full, params.top_p, 1.0), u),
            lambda: jnp.zeros((b,), jnp.int32),
        )
        return jnp.where(fast_ok, fast_tok, full_tok)

    tokens = jax.lax.cond(jnp.any(do_sample), sampled_tokens, lambda: greedy_tok)
    tokens = jnp.where(do_sample, tokens, greedy_tok).astype(jnp.int32)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    k = min(MAX_TOP_LOGPROBS, cand_vals.shape[1])
    return SampleOutput(tokens, chosen, cand_ids[:, :k].astype(jnp.int32), cand_vals[:, :k] - lse[:, None])


def make_sampler(vocab: int | None = None, never_generate: tuple[int, ...] = ()):
    """`sample` as the engine runs it (never drawing the ids `vocab` and `never_generate` rule
    out, see there): the logits processing, when a step has any, as a program of its own before
    the sampler's (fused into one program, XLA CPU made a sampled step of 8 rows ~10 ms slower;
    apart, the processing costs ~1-2 ms). A step whose rows are all greedy and report no
    alternatives runs `greedy`, which finds no candidates (their top-k is a sort of the
    vocabulary on a GPU, the step's largest kernel)."""
    bans = dict(vocab=vocab, never_generate=tuple(sorted({int(i) for i in never_generate})))
    process = jax.jit(process_logits)
    draw = jax.jit(functools.partial(sample, **bans))
    argmax = jax.jit(functools.partial(greedy, **bans))

    def run(logits, params: SamplingMetadata, positions) -> SampleOutput:
        if params.extras is not None:
            logits = process(logits, params.extras)
            params = params._replace(extras=None)
        elif params.top_logprobs is not None and not np.any(params.top_logprobs) \
                and not np.any(params.temperature):
            return argmax(logits)
        return draw(logits, params, positions)

    return run


def greedy(logits: jax.Array, vocab: int | None = None,
           never_generate: tuple[int, ...] = ()) -> SampleOutput:
    """`sample` of rows that are all greedy, without their top alternatives (zeros): the same
    tokens (the first of equal largest logits, as `lax.top_k` orders them) and logprobs."""
    logits = logits.astype(jnp.float32)
    bans = Bans.of(logits.shape[-1], vocab, never_generate)
    logits = bans.mask_all(logits)
    # (A one-candidate top-k, not argmax: XLA:CPU's argmax over a row is ~4x slower.)
    chosen, tokens = bans.top_k(logits, 1)
    k = min(MAX_TOP_LOGPROBS, logits.shape[1])
    return SampleOutput(tokens[:, 0].astype(jnp.int32),
                        chosen[:, 0] - bans.logsumexp(logits),
                        jnp.zeros((logits.shape[0], k), jnp.int32),
                        jnp.zeros((logits.shape[0], k), jnp.float32))


def process_logits(logits: jax.Array, ex: LogitsExtras) -> jax.Array:
    """Penalties, logit bias and the grammar's mask (float32 [B, V] in and out; a removed token's
    logit is -inf). Each part costs only when its inputs exist: penalties when L > 0 (dense
    per-row counts built by one scatter), the mask when some row has a grammar."""
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    if ex.seen_ids.shape[1]:
        ones = jnp.ones(ex.seen_ids.shape, jnp.float32)
        seen = jnp.zeros((b, v), jnp.float32).at[rows, ex.seen_ids].max(ones, mode="drop") > 0
        out_counts = jnp.zeros((b, v), jnp.float32).at[rows, ex.seen_ids].add(
            ex.seen_output.astype(jnp.float32), mode="drop")
        rep = ex.repetition[:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - ex.frequency[:, None] * out_counts - ex.presence[:, None] * (out_counts > 0)
    if ex.bias_ids.shape[1]:
        logits = logits.at[rows, ex.bias_ids].add(ex.bias_vals, mode="drop")
    if ex.mask is not None:
        bits = (ex.mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
        allowed = bits.reshape(b, -1)[:, :v].astype(bool)
        # A row left with nothing (its bans cover all the grammar allows) keeps its logits: the
        # output processor then ends it with an error instead of sampling from nothing.
        some = jnp.any(allowed & (logits > -jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(allowed | ~some, logits, -jnp.inf)
    return logits


# More banned ids than this (a checkpoint's padded rows: 4B-27B's 63) are masked in the logits
# whole, one more pass over them, rather than stepped over among the candidates: the greedy
# step's top-k of 1 + n stays within XLA:GPU's top-k kernels (k <= 16; larger is a sort).
_MAX_SKIPPED_BANS = 15


@dataclasses.dataclass(frozen=True)
class Bans:
    """The ids a model must never emit. A few (the image tokens) are left out at no cost to a
    step: not by a pass that writes masked [B, V] logits (XLA:CPU runs its reductions apart
    from their producers, so a select before them is a pass of its own, as costly as the greedy
    step's top-k), but by taking n more candidates than needed and dropping the banned among
    them (`top_k`) and by taking their share out of the normaliser (`logsumexp`); more than
    `_MAX_SKIPPED_BANS` are masked whole (`mask_all`). `ids` sorted; `allowed` bool [V]."""

    ids: np.ndarray
    allowed: np.ndarray | None

    @staticmethod
    def of(v: int, vocab: int | None, never_generate: tuple[int, ...]) -> "Bans":
        """Ids at or past `vocab` (rows padding the embedding) and the `never_generate` ones."""
        ids = {int(i) for i in never_generate if 0 <= int(i) < v}
        if vocab is not None and vocab < v:
            ids.update(range(vocab, v))
        if not ids:
            return Bans(np.zeros(0, np.int32), None)
        allowed = np.ones(v, bool)
        allowed[sorted(ids)] = False
        return Bans(np.array(sorted(ids), np.int32), allowed)

    @property
    def whole(self) -> bool:
        return len(self.ids) > _MAX_SKIPPED_BANS

    def mask(self, x: jax.Array) -> jax.Array:
        """x [B, V] (derived from logits past `mask_all`) with the banned ids at -inf, in a
        rarely taken branch: a scatter of the n of them (a select over the row there cost a
        step as much as if the branch were taken)."""
        if self.allowed is None or self.whole:  # none, or masked whole already
            return x
        return x.at[:, self.ids].set(-jnp.inf)

    def logsumexp(self, x: jax.Array) -> jax.Array:
        """logsumexp over the allowed ids of x [B, V]: the whole row's, less the banned ids'
        share (gathered: n values a row); where that share is over half (the rounding of the
        difference would show), the masked row's, a pass only such a step pays."""
        full = jax.nn.logsumexp(x, axis=-1)
        if self.allowed is None or self.whole:  # none, or masked whole already
            return full
        share = jnp.sum(jnp.exp(x[:, self.ids] - full[:, None]), axis=-1)
        share = jnp.where(full > -jnp.inf, share, 0.0)
        less = full + jnp.log1p(-share)
        heavy = share > 0.5  # per row: a row's value never depends on the others'
        return jax.lax.cond(jnp.any(heavy),
                            lambda: jnp.where(heavy, jax.nn.logsumexp(self.mask(x), axis=-1), less),
                            lambda: less)

    def mask_all(self, logits: jax.Array) -> jax.Array:
        """The logits masked whole when the bans are too many to step over (`top_k`)."""
        return jnp.where(self.allowed, logits, -jnp.inf) if self.whole else logits

    def top_k(self, logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """`_top_k` of the allowed ids: k + n candidates, the banned among them set to -inf and
        dropped (a second top-k over k + n values; the order of ties is kept)."""
        n, v = len(self.ids), logits.shape[-1]
        if self.allowed is None or self.whole:
            return _top_k(logits, k)
        vals, ids = _top_k(logits, min(k + n, v))
        vals = jnp.where(jnp.asarray(self.allowed)[ids], vals, -jnp.inf)
        vals, order = _top_k(vals, k)
        return vals, jnp.take_along_axis(ids, order, axis=-1)


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` kept as XLA CPU's TopK kernel: when its outputs are sliced differently (values
    whole, indices [:, 0]) the compiler falls back to a full sort of the row, ~100x slower. The
    barrier stops that rewrite."""
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k))


def _sample_candidates(zc, ids, lse_z, top_k, top_p, u):
    """Sampling among the candidates (temperature-scaled logits zc sorted descending, their ids).

    Returns (ok [B], token [B]). ok is False where the truncated distribution reaches beyond the
    candidates: a top-k between the candidate count and the vocabulary, a nucleus wider than the
    candidates, or no truncation at all; the full-vocabulary path decides those rows.
    """
    n = zc.shape[1]
    idx = jnp.arange(n)[None, :]
    probs = jnp.where(idx < top_k[:, None], jnp.exp(zc - lse_z[:, None]), 0.0)
    cum = jnp.cumsum(probs, axis=-1)
    k_inside = top_k <= n
    # Probability mass of the top-k set: exact when that set lies inside the candidates, and 1 when
    # top-k is off (probabilities are normalised over the full vocabulary by lse_z).
    mass_k = jnp.where(k_inside, cum[:, -1], 1.0)
    reach = cum >= top_p[:, None] * mass_k[:, None]
    nucleus_inside = (top_p < 1.0) & jnp.any(reach, axis=-1)
    # A row whose last candidate is -inf (a grammar, min_p) has all of its tokens among them.
    ok = k_inside | ((top_k == _K_OFF) & nucleus_inside) | (zc[:, -1] == -jnp.inf)
    keep = jnp.where(top_p >= 1.0, jnp.minimum(top_k, n), jnp.argmax(reach, axis=-1) + 1)
    j = _inverse_cdf(jnp.where(idx < keep[:, None], probs, 0.0), u)
    return ok, jnp.take_along_axis(ids, j[:, None], axis=-1)[:, 0]


def _sample_full(z, lse_z, top_k, top_p, u):
    """Exact top-k / top-p sampling over the full vocabulary. The cut-offs are found by bisection
    on the logit value (each step one pass over the vocabulary), skipped when no row needs them."""
    lo0 = jnp.min(jnp.where(z > -jnp.inf, z, jnp.inf), axis=-1)  # removed tokens (-inf) aside
    hi0 = jnp.max(z, axis=-1) + 1.0
    probs = jnp.exp(z - lse_z[:, None])

    def bisect(holds):
        def step(_, bounds):
            lo, hi = bounds
            mid = 0.5 * (lo + hi)
            ok = holds(mid)
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
        return jax.lax.fori_loop(0, _BISECT_STEPS, step, (lo0, hi0))[0]

    neg_inf = jnp.full(lo0.shape, -jnp.inf)
    need_k = top_k != _K_OFF
    t_k = jax.lax.cond(
        jnp.any(need_k),
        lambda: jnp.where(need_k, bisect(lambda t: jnp.sum(z >= t[:, None], axis=-1) >= top_k), -jnp.inf),
        lambda: neg_inf,
    )
    in_k = z >= t_k[:, None]
    mass_k = jnp.sum(jnp.where(in_k, probs, 0.0), axis=-1)
    need_p = top_p < 1.0

    def nucleus_cut():
        def holds(t):
            mass = jnp.sum(jnp.where(in_k & (z >= t[:, None]), probs, 0.0), axis=-1)
            return mass >= top_p * mass_k
        return jnp.where(need_p, bisect(holds), -jnp.inf)

    t_p = jax.lax.cond(jnp.any(need_p), nucleus_cut, lambda: neg_inf)
    weights = jnp.where(z >= jnp.maximum(t_k, t_p)[:, None], probs, 0.0)
    return _inverse_cdf_blocked(weights, u)


def _inverse_cdf(weights, u):
    """Index i with cum[i-1] <= u * total < cum[i] per row (weights [B, N] >= 0, not all zero)."""
    cum = jnp.cumsum(weights, axis=-1)
    target = u * cum[:, -1]
    j = jnp.sum(cum <= target[:, None], axis=-1)
    # Rounding can step past the last positive weight; fall back to it.
    last = weights.shape[1] - 1 - jnp.argmax(weights[:, ::-1] > 0, axis=-1)
    return jnp.minimum(j, last)


def _inverse_cdf_blocked(weights, u):
    """`_inverse_cdf` over a large vocabulary in two levels (blocks, then inside the block): a
    cumulative sum over 262144 entries costs ~25 ms on CPU, two over 512 almost nothing."""
    b, v = weights.shape
    nblocks = -(-v // _BLOCK)
    w = jnp.pad(weights, ((0, 0), (0, nblocks * _BLOCK - v))).reshape(b, nblocks, _BLOCK)
    block_mass = jnp.sum(w, axis=-1)
    blk = _inverse_cdf(block_mass, u)
    before = jnp.sum(jnp.where(jnp.arange(nblocks)[None, :] < blk[:, None], block_mass, 0.0), axis=-1)
    inner_w = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]
    # Where u lands inside the chosen block, as a fraction of that block's mass.
    mass = jnp.take_along_axis(block_mass, blk[:, None], axis=-1)[:, 0]
    inner_u = jnp.clip((u * jnp.sum(block_mass, axis=-1) - before) / jnp.maximum(mass, 1e-30), 0.0, 1.0)
    return (blk * _BLOCK + _inverse_cdf(inner_w, inner_u)).astype(jnp.int32)


def prompt_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of a prompt's own tokens. logits float32 [B, T, V] at every position, tokens int32
    [B, T]. Returns (chosen [B, T-1]: log p(tokens[:, t+1]), top_ids [B, T-1, K], top_lps)."""
    return token_logprobs(logits[:, :-1], tokens[:, 1:])


def token_logprobs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [..., V] and the token each row scores, targets int32 [...]: (log p(target) [...],
    the MAX_TOP_LOGPROBS best ids [..., K] and their logprobs)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - lse
    vals, ids = _top_k(logits, MAX_TOP_LOGPROBS)
    return chosen, ids.astype(jnp.int32), vals - lse[..., None]
