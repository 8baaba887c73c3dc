"""Structured output: grammars compiled with llguidance (checked when a request arrives), and the
per-sequence matchers whose allowed-token masks the sampler applies on device. Masks for the
next step are computed on a worker thread while the device runs the current one; a grammar
that fails ends its own request only. See docs/structured_output.md for why llguidance and the
flow of a constrained step."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import re
import threading
import time
import weakref
from typing import Callable

import numpy as np

from serving.sampling import InvalidParameter

log = logging.getLogger(__name__)

# Base models ramble inside free whitespace; JSON output is compact (what OpenAI returns too).
_JSON_OPTIONS = {"whitespace_flexible": False}
_MAX_GRAMMAR_BYTES = 1 << 20


def _llg():
    import llguidance

    return llguidance


_PARSER_LIMITS = None


def parser_limits():
    """llguidance's default resource limits, with errors that carry no parser state: its verbose
    errors dump the grammar and the parser's rows (tens of KB to MB) into a message a client
    and the log would see."""
    global _PARSER_LIMITS
    if _PARSER_LIMITS is None:
        _PARSER_LIMITS = _llg().LLParserLimits(verbose_errors=False)
    return _PARSER_LIMITS


# ---- the tokenizer as llguidance sees it ----

_TOKENIZERS: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def token_bytes_table(tok) -> tuple[list[bytes], list[int]]:
    """(bytes of every token, ids of special tokens) for a SentencePiece vocabulary with byte
    fallback: '<0xNN>' pieces are byte NN, U+2581 is a space, control/unknown/unused pieces are
    special (never text). Works for `models.gemma3.tokenizer.Tokenizer` and for any tokenizer with
    `id_to_piece` and `vocab_size` whose special pieces look like '<name>'."""
    sp = getattr(tok, "_sp", None)
    # Ids the SentencePiece model has as they are (not a token added past it or renamed).
    in_sp = (lambda i: i < sp.GetPieceSize() and i not in tok._added) if sp is not None else None
    out, special = [], []
    for i in range(tok.vocab_size):
        piece = tok.id_to_piece(i)
        if in_sp is not None and in_sp(i):
            is_byte, is_special = sp.IsByte(i), sp.IsControl(i) or sp.IsUnknown(i) or sp.IsUnused(i)
        else:
            is_byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
            is_special = not is_byte and piece.startswith("<") and piece.endswith(">")
        if is_byte:
            out.append(bytes([int(piece[3:5], 16)]))
        elif is_special:
            out.append(piece.encode("utf-8"))
            special.append(i)
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out, special


def grammar_tokenizer(tok, eos_ids: tuple[int, ...]):
    """The llguidance tokenizer of `tok` (built once per tokenizer object: about a second for
    262k tokens). The tokens a model must not emit (`never_generate_ids`) are left out (no
    bytes): text never takes them and a grammar cannot name them."""
    from models.gemma3.tokenizer import never_generate_ids

    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(tok)
        if cached is not None:
            return cached
        llg = _llg()
        table, special = token_bytes_table(tok)
        never = set(never_generate_ids(tok))
        table = [b"" if i in never else t for i, t in enumerate(table)]
        special = [i for i in special if i not in never]

        class _Wrapped:
            eos_token_id = eos_ids[0]
            bos_token_id = getattr(tok, "bos_id", None)
            tokens = table
            special_token_ids = special

            def __call__(self, s):
                return _encode_avoiding(tok, s.decode("utf-8", errors="replace")
                                        if isinstance(s, bytes) else s, never)

        built = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped()), n_vocab=tok.vocab_size, eos_token=list(eos_ids))
        _TOKENIZERS[tok] = built
        return built


def _encode_avoiding(tok, text: str, never: set[int]) -> list[int]:
    """`tok.encode(text)`, or where that takes an id of `never` (text such as
    "<start_of_image>"), the encodings of its halves: the same text in allowed tokens, which is
    what llguidance asks for when a grammar forces text."""
    ids = tok.encode(text)
    if len(text) < 2 or not never.intersection(ids):
        return ids
    half = len(text) // 2
    return _encode_avoiding(tok, text[:half], never) + _encode_avoiding(tok, text[half:], never)


# ---- grammars ----

@dataclasses.dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled, validated grammar: `kind` says where it came from (json_schema, json_object,
    regex, choice, grammar, tool_call); each sequence gets a copy of `matcher` in its start state."""

    kind: str
    source: str  # llguidance's serialized grammar
    matcher: object  # llguidance.LLMatcher in its start state (never advanced)

    def new_matcher(self):
        return self.matcher.deep_copy()


def json_schema_grammar_source(schema: dict | bool, param: str = "response_format", lenient: bool = False) -> str:
    """lenient: keywords llguidance does not implement (uniqueItems, not, if/then, contains, ...)
    are ignored, so not enforced; otherwise they are an error."""
    llg = _llg()
    if schema is True:
        schema = {}
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                      overrides={**_JSON_OPTIONS, "lenient": lenient})
    except (ValueError, TypeError) as e:
        raise InvalidParameter(param, f"invalid JSON schema: {_short(str(e))}") from None


def grammar_source(kind: str, spec, param: str) -> str:
    """llguidance's grammar for one of: json_schema (a dict), json_object (spec unused), regex,
    choice (a list of strings), grammar (Lark or GBNF text). Raises InvalidParameter(param)."""
    llg = _llg()
    if kind in ("json_schema", "json_schema_lenient"):
        if not isinstance(spec, (dict, bool)):
            raise InvalidParameter(param, "a JSON schema must be an object")
        return json_schema_grammar_source(spec, param, lenient=kind == "json_schema_lenient")
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=_JSON_OPTIONS)
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidParameter(param, "a regular expression must be a non-empty string")
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise InvalidParameter(param, "choices must be a non-empty list of non-empty strings")
        # One terminal (a lexeme), not a rule of alternatives: the lexer takes tens of thousands
        # of values, where the parser's rows stop at 2,000 (llguidance's max_items_in_row).
        values = dict.fromkeys(spec)
        return llg.LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in values))
    if kind in ("grammar", "lark"):
        if not isinstance(spec, str) or not spec.strip():
            raise InvalidParameter(param, "a grammar must be a non-empty string")
        try:
            return llg.grammar_from("grammar", spec)
        except ValueError as e:
            raise InvalidParameter(param, f"invalid grammar: {_short(str(e))}") from None
    raise InvalidParameter(param, f"unknown grammar kind {kind!r}")


def compile_grammar(kind: str, source: str, tok, eos_ids: tuple[int, ...], param: str) -> Grammar:
    """Validates `source` against the tokenizer and returns its Grammar (InvalidParameter(param)
    when the grammar or schema is not valid, matches no string, or exceeds llguidance's limits:
    `admission_error`). Can take a while for a large grammar: call it off the event loop."""
    what = kind.removesuffix("_lenient").replace("_", " ")
    if len(source) > _MAX_GRAMMAR_BYTES:
        raise InvalidParameter(param, f"the grammar is too large (over {_MAX_GRAMMAR_BYTES} bytes compiled)")
    llg = _llg()
    lt = grammar_tokenizer(tok, eos_ids)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(source, lt, limits=parser_limits())
    if is_error:
        raise InvalidParameter(param, f"invalid {what}: {_short(messages[0])}")
    matcher = llg.LLMatcher(lt, source, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise InvalidParameter(param, f"invalid {what}: {matcher_error(matcher)}")
    if kind in ("grammar", "lark"):
        _refuse_never_generated(source, tok, param)
    problem = admission_error(matcher, _closing_preference(tok, tuple(eos_ids)), eos_ids, (tok.vocab_size + 31) // 32)
    if problem is not None:
        raise InvalidParameter(param, f"the {what} cannot be served: {problem}")
    return Grammar(kind, source, matcher)


_TOKEN_REFS = re.compile(r"<\[([0-9,\-\s]+)\]>")  # Lark's token-id sets: <[5]>, <[5-9,12]>


def _refuse_never_generated(source: str, tok, param: str) -> None:
    """InvalidParameter when a grammar's token-id set (`<[...]>`) holds only ids the model never
    generates (image tokens, padding rows): that part of the grammar could never match."""
    from models.gemma3.tokenizer import never_generate_ids

    never = set(never_generate_ids(tok))
    for m in _TOKEN_REFS.finditer(source):
        ranges = [(int(a), int(b or a)) for a, _, b in
                  (part.strip().partition("-") for part in m.group(1).split(",") if part.strip())]
        if ranges and all(b - a < len(never) and all(i in never for i in range(a, b + 1)) for a, b in ranges):
            raise InvalidParameter(param, f"the grammar names token ids the model never generates: "
                                          f"<[{m.group(1).strip()}]>")


# Tokens the admission check walks from the start state (`admission_error`).
ADMISSION_TOKENS = 32


def admission_error(matcher, preference: list[int], eos_ids, words: int,
                    limit: int = ADMISSION_TOKENS) -> str | None:
    """Why a grammar cannot be served, or None. It can not when no string satisfies it (its
    first mask allows nothing: `start: start`, `{"$ref": "#"}`, an empty character class) or
    when llguidance gives up on it within the first tokens (a lexer or parser limit: a{99999999},
    a choice among 50,000 values, a required recursive $ref). The check walks the closing paths
    (`closing_path`) from the start state, at most `limit` tokens each: a path that ends proves
    some string satisfies the grammar. One that does not end within it proves nothing either
    way; generation then runs, and a grammar that cannot finish within max_tokens leaves a valid
    prefix with finish_reason "length"."""
    for fresh in (False, True):
        path, error = _closing_walk(matcher, preference, eos_ids, words, limit, fresh)
        if error is not None:
            return error
        if path is not None:
            return None
    return None


_LIMIT_WORDS = re.compile(r"too many|too complex|too large|limit|max is", re.IGNORECASE)


def matcher_error(matcher) -> str:
    """A matcher's error in a line or two (llguidance's first line, bounded)."""
    text = str(matcher.get_error()).replace("<non-verbose/>", "").strip()
    first = text.splitlines()[0] if text else "unknown error"
    if first.startswith("NoExtension"):
        return "no string satisfies it"
    # A limit reached (lexer states or expressions, Earley items, a row's alternatives) reads so
    # in the message only: the stop reason after a failed token is "InternalError" either way.
    if matcher.stop_reason() in ("ParserTooComplex", "LexerTooComplex") or _LIMIT_WORDS.search(first):
        return f"it exceeds the grammar engine's limits ({_short(first, 300)})"
    return _short(first)


def _short(message: str, limit: int = 400) -> str:
    message = " ".join(str(message).split())
    return message if len(message) <= limit else message[:limit] + "..."


# ---- finishing within the token budget ----

# How close to the end of its budget a sequence starts checking that it can still complete, and
# how many tokens early it takes the closing path (one sampled token can open more to close).
CLOSING_WINDOW = 16
CLOSING_MARGIN = 4
# A closing search fills one mask per token it tries: it tries at most CLOSING_HORIZON +
# CLOSING_WINDOW tokens (a grammar that needs more to close is not closed in time), and one that
# finds nothing is not repeated before the last that many tokens of the budget. Otherwise a
# grammar whose greedy path never ends (a+b: 'a' is always preferred) searched the whole budget at
# every step (~0.5 s a step at a 32k context, holding up every stream's step).
CLOSING_HORIZON = 128
# Short texts, most useful first, to end whatever is open: close strings, arrays, objects and
# calls, end a number (a comma before a digit, or numbers never end), then the shortest values.
_CLOSING_TEXTS = ('"', "}", "]", ")", ",", "0", ":", "[", "{")


def _closing_preference(tok, eos_ids: tuple[int, ...]) -> list[int]:
    """Token ids in the order the closing path tries them: EOS first, then `_CLOSING_TEXTS`."""
    ids = list(eos_ids)
    # Then any other ASCII punctuation, digits and letters: a pattern such as [a-z]+@[a-z]+ is
    # left through its punctuation (a letter first would go round forever).
    rest = [chr(c) for c in range(33, 127) if not chr(c).isalnum()] + ["true", "null", " ", "\n"] + \
        list("0123456789abcdefghijklmnopqrstuvwxyzA")
    for text in _CLOSING_TEXTS + tuple(rest):
        enc = tok.encode(text)
        if len(enc) == 1 and enc[0] not in ids:
            ids.append(enc[0])
    return ids


def closing_path(matcher, preference: list[int], eos_ids, words: int, limit: int,
                 fresh: bool = False) -> list[int] | None:
    """A short token path that completes the grammar from the matcher's state (ending with EOS,
    which is allowed only where the grammar accepts), found greedily: at each step the first
    allowed token of `preference` (with `fresh`, the first not yet in the path, if any), else the
    lowest allowed id. None when none is found within `limit` tokens. Works on a copy of the
    matcher."""
    return _closing_walk(matcher, preference, eos_ids, words, limit, fresh)[0]


def _closing_walk(matcher, preference: list[int], eos_ids, words: int, limit: int,
                  fresh: bool = False) -> tuple[list[int] | None, str | None]:
    """(`closing_path`, the error the matcher met on the way: it allowed no token, or llguidance
    gave up on the grammar)."""
    from llguidance.numpy import fill_next_token_bitmask

    m = matcher.deep_copy()
    mask = np.zeros((1, words), np.int32)
    eos = set(eos_ids)
    path: list[int] = []
    while len(path) < limit:
        if m.is_stopped():
            return (None, matcher_error(m)) if m.is_error() else (path, None)
        fill_next_token_bitmask(m, mask)
        if m.is_error():
            return None, matcher_error(m)
        bits = mask[0].view(np.uint32)
        allowed = (t for t in preference if bits[t // 32] >> (t % 32) & 1)
        tok = next(allowed, None)
        if fresh and tok in path:
            tok = next((t for t in allowed if t not in path), tok)
        if tok is None:
            nz = np.flatnonzero(bits)
            if not len(nz):
                return None, "no string satisfies it" if not path else "its mask allows no token"
            w = int(nz[0])
            tok = w * 32 + (int(bits[w]) & -int(bits[w])).bit_length() - 1
        path.append(tok)
        if tok in eos:
            return path, None
        if not m.consume_token(tok):
            return None, matcher_error(m)
    return None, None


# ---- per-sequence matchers and masks ----

def id_bits(n: int, words: int) -> np.ndarray:
    """int32 [words] with the bits of ids [0, n) set (a token mask allowing those ids)."""
    out = np.zeros(words, np.uint32)
    full, rest = divmod(n, 32)
    out[:full] = 0xFFFFFFFF
    if rest:
        out[full] = (1 << rest) - 1
    return out.view(np.int32)


@dataclasses.dataclass(eq=False)
class _Row:
    matcher: object
    budget: int  # tokens this sequence may still generate (max_tokens, the context)
    # Where this sequence's mask for its next token is, once computed: (job, row in the job).
    job: "_MaskJob | None" = None
    job_index: int = 0
    # Length of its closing path when last computed (-1: never yet): the check runs while the
    # budget is within CLOSING_WINDOW of it.
    closing_len: int = -1
    closing: list[int] | None = None  # that path while the sequence follows it
    dirty: bool = True  # the matcher advanced (or is new) since its mask was computed
    # Why the grammar can no longer constrain this sequence (its mask failed, llguidance gave
    # up, a token was rejected): the sequence then ends with an error, never with free text.
    failure: str | None = None


class _MaskJob:
    """The masks of several sequences, computed in one pass on the worker thread (the grammar's
    width: its tokenizer's vocabulary)."""

    def __init__(self, rows: list[_Row], words: int):
        self.rows = rows
        self.masks = np.zeros((len(rows), words), np.int32)
        self.future: concurrent.futures.Future | None = None

    def wait(self) -> None:
        """Waits for the job; a job that failed as a whole fails its rows, not the step."""
        try:
            self.future.result()
        except Exception as e:
            log.exception("a grammar mask job failed")
            for r in self.rows:
                r.failure = r.failure or f"the grammar's mask failed: {type(e).__name__}: {_short(str(e), 200)}"


class PendingMask:
    """The mask rows of one step; `result()` waits for their jobs and gathers them ([B, words]:
    the logits' width; a grammar row allows nothing past its tokenizer's vocabulary)."""

    def __init__(self, rows: list[tuple[int, _Row]], n: int, keep: np.ndarray, failed: np.ndarray):
        self._rows, self._n, self._keep, self._failed = rows, n, keep, failed
        self.words = len(keep)

    def result(self) -> np.ndarray:
        out = np.full((self._n, self.words), -1, np.int32)
        for i, row in self._rows:
            row.job.wait()
            # A failed row's token is discarded (the sequence ends with its error): EOS only.
            mask = self._failed if row.failure is not None else row.job.masks[row.job_index]
            w = min(len(mask), self.words)
            out[i, :w] = mask[:w] & self._keep[:w]
            out[i, w:] = 0
        return out


class StructuredOutputs:
    """The matchers of the live sequences that have a grammar, keyed by sequence id. `add` comes
    from the threads that submit (under the engine core's lock), everything else from the engine
    thread, which iterates over snapshots of the table; the masks are computed on one worker
    thread (llguidance's executor releases the GIL and may use more threads for a large batch)."""

    def __init__(self, vocab_size: int, eos_ids: tuple[int, ...], max_seq_len: int | None = None,
                 tokenizer=None, mask_timer: Callable[[float], None] | None = None,
                 never_generate: tuple[int, ...] = ()):
        """mask_timer: called with the seconds of each mask job, on the worker thread where it
        runs (a benchmark's view of the host work a constrained step adds). never_generate:
        ids no mask allows (the model's, `RunnerInfo.never_generate`)."""
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        # The grammar's masks cover its tokenizer's ids (llguidance takes exactly that width),
        # which a checkpoint's padded embedding may outnumber; ids the logits lack are cleared.
        text = vocab_size if tokenizer is None else tokenizer.vocab_size
        self.grammar_words = (text + 31) // 32
        keep = id_bits(min(text, vocab_size), self.words).view(np.uint32)
        for i in never_generate:
            if 0 <= i < vocab_size:
                keep[i // 32] &= ~np.uint32(1 << (i % 32))
        self._keep = keep.view(np.int32)
        self.eos_ids = tuple(eos_ids)
        self.max_seq_len = max_seq_len
        self._closers = _closing_preference(tokenizer, self.eos_ids) if tokenizer is not None else list(self.eos_ids)
        self._eos_only = np.zeros(self.grammar_words, np.uint32)
        for t in self.eos_ids:
            self._eos_only[t // 32] |= np.uint32(1 << (t % 32))
        self._eos_only = self._eos_only.view(np.int32)
        self._rows: dict[int, _Row] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor = None
        self._mask_timer = mask_timer

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, seq) -> None:
        grammar = getattr(seq.params, "grammar", None)
        if grammar is not None:
            budget = seq.params.max_tokens - len(seq.generated)
            if self.max_seq_len is not None:
                budget = min(budget, self.max_seq_len - seq.length)
            self._rows[seq.id] = _Row(grammar.new_matcher(), budget)

    def remove(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._rows

    def accept(self, seq_id: int, token: int) -> str | None:
        """Advances a sequence's matcher by its sampled token (EOS included: it is valid only
        where the grammar accepts). Returns None while the grammar goes on, "stop" when it can
        take nothing more (complete), "error" when the grammar failed (`error` says why): the
        token broke it, llguidance gave up on it, or its mask could not be computed."""
        row = self._rows.get(seq_id)
        if row is None:
            return None
        if row.job is not None:
            row.job.wait()  # never advance a matcher while its mask is being computed
        row.dirty = True
        row.budget -= 1
        # The closing path stays valid while the sequence follows it (no new search).
        row.closing = row.closing[1:] if row.closing and row.closing[0] == token else None
        if row.failure is None:
            if row.matcher.is_error():  # llguidance gave up while computing the mask
                row.failure = f"the grammar could not be enforced: {matcher_error(row.matcher)}"
            elif not row.matcher.consume_token(int(token)) or row.matcher.is_error():
                row.failure = f"the grammar rejected token {int(token)}: {matcher_error(row.matcher)}"
        if row.failure is not None:
            log.warning("sequence %d: %s", seq_id, row.failure)
            return "error"
        if row.matcher.is_stopped():
            return "stop"
        return None

    def error(self, seq_id: int) -> str:
        """Why a sequence's grammar failed (short: no parser state), "" if it did not."""
        row = self._rows.get(seq_id)
        return "" if row is None else row.failure or ""

    def prefetch(self) -> None:
        """Starts the masks of every sequence whose matcher moved (one job, worker thread)."""
        dirty = [r for r in list(self._rows.values()) if r.dirty]  # list(): one atomic snapshot
        if not dirty:
            return
        job = _MaskJob(dirty, self.grammar_words)
        for i, r in enumerate(dirty):
            r.job, r.job_index, r.dirty = job, i, False
        closing = [(i, r) for i, r in enumerate(dirty) if r.closing_len < 0 or r.budget <= r.closing_len + CLOSING_WINDOW]
        job.future = self._worker().submit(self._compute, dirty, job.masks, closing)

    def masks(self, seq_ids: list[int | None]) -> PendingMask | None:
        """The pending mask of a step's rows (a row without a grammar allows everything), or None
        when no row has a grammar."""
        live = dict(self._rows)  # one atomic snapshot
        rows = [(i, live[s]) for i, s in enumerate(seq_ids) if s is not None and s in live]
        if not rows:
            return None
        if any(r.dirty for _, r in rows):
            self.prefetch()
        return PendingMask(rows, len(seq_ids), self._keep, self._eos_only)

    def _compute(self, rows: list[_Row], out: np.ndarray, closing) -> None:
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        t0 = time.perf_counter()
        live = [(i, r) for i, r in enumerate(rows) if r.failure is None]
        try:
            fill_next_token_bitmask_par(self._executor, [(r.matcher, i) for i, r in live], out)
        except Exception:
            # One matcher made llguidance raise (the call names none): row by row, so that
            # only the sequences whose masks fail end, with their error.
            for i, r in live:
                try:
                    fill_next_token_bitmask(r.matcher, out, i)
                except Exception as e:
                    r.failure = f"the grammar's mask failed: {type(e).__name__}: {_short(str(e), 200)}"
        for i, row in closing:
            if row.failure is None:
                try:
                    self._close_in_time(row, out[i])
                except Exception as e:
                    row.failure = f"the grammar's mask failed: {type(e).__name__}: {_short(str(e), 200)}"
        if self._mask_timer is not None:
            self._mask_timer(time.perf_counter() - t0)

    def _close_in_time(self, row: _Row, mask: np.ndarray) -> None:
        """Near the end of a sequence's token budget: when the shortest way we know to complete
        the grammar (`closing_path`) needs all the tokens left, allow only its first token, so
        that output cut by max_tokens still parses (finish_reason "stop", not "length")."""
        budget = row.budget
        reach = min(max(budget, 0), CLOSING_HORIZON)
        path = row.closing
        if path is None:
            args = (row.matcher, self._closers, self.eos_ids, self.grammar_words, reach + CLOSING_WINDOW)
            # The greedy walk, else one that takes tokens new to the path first: where the
            # preferred token loops (x+y: 'x' for ever) the next one preferred ends it.
            path = closing_path(*args)
            if path is None:
                path = closing_path(*args, fresh=True)
        row.closing = path
        # No path within reach: a lower bound, so the next search waits for the last tokens.
        row.closing_len = len(path) if path is not None else max(row.closing_len, reach)
        if path and len(path) + CLOSING_MARGIN >= budget:
            mask[:] = 0
            mask[path[0] // 32] = np.int32(np.uint32(1 << (path[0] % 32)).view(np.int32))

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._executor = _llg().LLExecutor()
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


# ---- what a request asks for ----

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def request_grammar(req) -> tuple[str, object, str] | None:
    """(kind, spec, param) of the structure an OpenAI / vLLM request asks for, or None: OpenAI's
    `response_format` (text, json_object, json_schema) or one of vLLM's guided_* fields. Raises
    InvalidParameter for a malformed or ambiguous request."""
    asked = [name for name in _GUIDED if getattr(req, name, None) is not None]
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.get("type", "text") != "text":
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise InvalidParameter(asked[1], f"give at most one of response_format and {', '.join(_GUIDED)}; "
                               f"got {' and '.join(asked)}")
    if rf is not None:
        kind = rf.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise InvalidParameter("response_format", "response_format.type must be 'text', 'json_object' "
                                   f"or 'json_schema', got {kind!r}")
    if not asked:
        return None
    name = asked[0]
    if name == "response_format":
        if rf["type"] == "json_object":
            return "json_object", None, "response_format"
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise InvalidParameter("response_format", "response_format json_schema needs "
                                   "{'json_schema': {'name': ..., 'schema': {...}}}")
        if "name" in js and not isinstance(js["name"], str):
            raise InvalidParameter("response_format", "response_format.json_schema.name must be a string")
        # OpenAI's strict mode refuses what it cannot enforce; without it, a best effort: keywords
        # the grammar engine does not implement are then ignored (docs/structured_output.md).
        kind = "json_schema" if js.get("strict") is True else "json_schema_lenient"
        return kind, js.get("schema", {}), "response_format"
    value = getattr(req, name)
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidParameter(name, f"guided_json is not valid JSON: {e}") from None
        return "json_schema", value, name
    return {"guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}[name], value, name


def build_grammar(kind: str, spec, param: str, tok, eos_ids: tuple[int, ...]) -> Grammar:
    """`grammar_source` then `compile_grammar` (InvalidParameter(param) for a bad one)."""
    try:
        source = _llg().LLMatcher.grammar_from_lark(spec) if kind == "tool_call" else grammar_source(kind, spec, param)
    except InvalidParameter:
        raise
    except (ValueError, TypeError) as e:
        raise InvalidParameter(param, f"invalid {kind.removesuffix('_lenient').replace('_', ' ')}: {_short(str(e))}") from None
    return compile_grammar(kind, source, tok, eos_ids, param)
