"""The generation endpoints: OpenAI completions and chat, and the native /generate. Each request
becomes one sequence per (prompt, n) in the engine core; their events arrive from the engine thread
on an asyncio queue. Completions and chat differ in how they build prompts and format choices;
one loop (`_openai_reply`) answers both, whole or streamed. When the client goes away (a failed send while streaming, or a disconnect noticed
while waiting) the request's sequences are cancelled, which frees their slots before the next step.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from serving import openai_format as fmt
from serving import structured_output, tools as tool_calls
from serving import chat_images, media
from serving.chat_template import render_chat
from serving.sequence import SeqImage
from serving.openai_schema import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    GenerateRequest, TokenizeRequest, error_body)
from serving.runtime import Runtime
from serving.sampling import InvalidParameter, SamplingParams
from serving.engine_core import ShuttingDown
from serving.output_processor import Event
from serving.sequence import QueueFull

log = logging.getLogger(__name__)

# While a request has nothing to send, an SSE comment this often notices a client that left.
_KEEPALIVE_SECONDS = 2.0
_DISCONNECT_POLL_SECONDS = 0.25


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def _reject_unsupported(req) -> None:
    if getattr(req, "best_of", None) not in (None, 1) and req.best_of != req.n:
        raise ApiError(400, "best_of is not supported by this server", param="best_of")
    if getattr(req, "suffix", None):
        raise ApiError(400, "suffix is not supported by this server", param="suffix")


def _sampling(req, max_tokens: int, logprobs: int | None, seed_offset: int = 0, grammar=None,
              vocab_size: int | None = None, defaults: dict | None = None) -> SamplingParams:
    """The request's sampling parameters; those it leaves out are `defaults`' (the model's,
    `Runtime.sampling_defaults`), else OpenAI's."""
    stop = req.stop if req.stop is not None else ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    defaults = defaults or {}

    def pick(name: str, fallback):
        value = getattr(req, name, None)
        return value if value is not None else defaults.get(name, fallback)

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            seed=SamplingParams.choice_seed(req.seed, seed_offset),
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            logprobs=logprobs,
            ignore_eos=req.ignore_eos,
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=_logit_bias(getattr(req, "logit_bias", None), vocab_size),
            min_tokens=getattr(req, "min_tokens", 0),
            grammar=grammar,
        )
    except InvalidParameter as e:
        raise ApiError(400, str(e), param=e.param) from None


def _logit_bias(bias: dict | None, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id as a string": bias} -> ((id, bias), ...), ids checked against the vocabulary."""
    out = []
    for key, value in (bias or {}).items():
        digits = key.strip().removeprefix("-")
        # ASCII digits only: str.isdigit() also holds for "²" and "٣", which int() refuses or reads.
        if not (digits.isascii() and digits.isdigit()):
            raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {key[:40]!r}")
        if len(digits) > 18:  # (no vocabulary comes near; int() refuses 4,300 digits and more)
            raise InvalidParameter("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}), "
                                   f"got one of {len(digits)} digits")
        t = int(key)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise InvalidParameter("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}), got {t}")
        out.append((t, value))
    return tuple(out)


async def _grammar(runtime: Runtime, spec: tuple[str, object, str] | None):
    """The compiled grammar of (kind, spec, param), off the event loop (a large grammar, or the
    first one, which builds the tokenizer's table, takes a while); 400 when it is not valid."""
    if spec is None:
        return None
    tok, eos = runtime.runner.tokenizer, runtime.runner.info.eos_ids
    try:
        return await asyncio.to_thread(structured_output.build_grammar, *spec, tok, eos)
    except InvalidParameter as e:
        raise ApiError(400, str(e), param=e.param) from None


def _request_grammar_spec(req):
    try:
        return structured_output.request_grammar(req)
    except InvalidParameter as e:
        raise ApiError(400, str(e), param=e.param) from None


def _check_ids(runtime: Runtime, ids: list[int], param: str) -> None:
    vocab = runtime.runner.info.token_ids
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ApiError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", param=param)


# ---- running sequences ----

class _Run:
    """The sequences of one request and the queue their events arrive on."""

    def __init__(self, runtime: Runtime, prompts: list[list[int]], params: list[SamplingParams],
                 prompt_logprobs: bool = False, images: tuple = ()):
        self.core = runtime.core
        self.model_name = runtime.config.model_name
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        reqs = [(p, sp, self._sink(loop, i)) + ((images,) if images else ())
                for i, (p, sp) in enumerate(zip(prompts, params))]
        try:
            self.ids = self.core.submit(reqs, prompt_logprobs=prompt_logprobs)
        except InvalidParameter as e:
            raise ApiError(400, str(e), param=e.param, code="context_length_exceeded"
                           if e.param in ("prompt", "max_tokens") else None) from None
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), "service_unavailable", headers={"Retry-After": "5"}) from None
        self.pending = set(range(len(reqs)))

    def _sink(self, loop, index):
        def sink(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
            except RuntimeError:  # the event loop has closed (the server has shut down)
                pass
        return sink

    async def events(self, request: Request, streaming: bool) -> AsyncIterator[tuple[int, Event] | None]:
        """Yields (index, event) until every sequence has finished; None when idle for a while
        (streaming: a keep-alive). Cancels what is left when the consumer stops early."""
        timeout = _KEEPALIVE_SECONDS if streaming else _DISCONNECT_POLL_SECONDS
        next_poll = time.monotonic() + _DISCONNECT_POLL_SECONDS
        try:
            while self.pending:
                # Streaming notices a departed client when a send fails; a plain request asks.
                if not streaming and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + _DISCONNECT_POLL_SECONDS
                    if await request.is_disconnected():
                        log.info("client disconnected; cancelling %d sequence(s)", len(self.pending))
                        return
                try:
                    # Events that are already queued need no wait_for (a task and a timer each).
                    index, event = (self.queue.get_nowait() if not self.queue.empty()
                                    else await asyncio.wait_for(self.queue.get(), timeout))
                except asyncio.TimeoutError:
                    if streaming:
                        yield None
                    continue
                if event.finish_reason is not None:
                    self.pending.discard(index)
                yield index, event
        finally:
            self.cancel()

    def cancel(self) -> None:
        if self.pending:
            self.core.cancel([self.ids[i] for i in self.pending])
            self.pending = set()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- the OpenAI reply, whole or streamed ----

async def _openai_reply(run: _Run, request: Request, req, choices: list[fmt.Choice], usage, chat: bool,
                        apply=None, tool_streams=None):
    """Collects or streams the events of `run` into `choices`. usage(): the usage so far;
    apply(index, event): adds an event to its choice and returns the delta (default
    `fmt.Choice.add`). tool_streams (chat with tools): one `tools.ToolStream` per choice, which
    turns text that is a list of calls into tool_calls."""
    apply = apply or (lambda index, event: choices[index].add(event))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created, name = int(time.time()), run.model_name
    if not req.stream:
        async for item in run.events(request, streaming=False):
            apply(*item)
        if run.pending or any(c.finish_reason is None for c in choices):
            return Response(status_code=499)  # the client left; nobody reads this
        _raise_if_failed(choices)
        bodies = [c.chat_choice() if chat else c.completion_choice() for c in choices]
        for body, ts in zip(bodies, tool_streams or ()):
            ts.finish_choice(body)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": name, "choices": bodies, "usage": usage()}

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunks(index: int, delta: dict) -> list[dict]:
        if not chat:
            if not (delta["text"] or delta["logprobs"] or delta["finish_reason"]):
                return []
            return [fmt.completion_chunk(rid, created, name, index, delta["text"], delta["logprobs"],
                                         delta["finish_reason"], include_usage)]
        out = []
        if tool_streams is not None:
            deltas, reason = tool_streams[index].feed(delta["text"], delta["finish_reason"])
            if delta["chat_logprobs"] and not deltas:
                deltas = [{}]
            for i, d in enumerate(deltas):
                out.append(fmt.chat_chunk(rid, created, name, index, d, delta["chat_logprobs"] if i == 0 else None,
                                          None, include_usage))
            if reason:
                out.append(fmt.chat_chunk(rid, created, name, index, {}, None, reason, include_usage))
            return out
        if delta["text"] or delta["chat_logprobs"]:
            out.append(fmt.chat_chunk(rid, created, name, index, {"content": delta["text"]},
                                      delta["chat_logprobs"], None, include_usage))
        if delta["finish_reason"]:  # chat sends the finish reason in a chunk of its own
            out.append(fmt.chat_chunk(rid, created, name, index, {}, None, delta["finish_reason"], include_usage))
        return out

    async def stream():
        if chat:  # each choice opens with its role
            for c in choices:
                yield _sse(fmt.chat_chunk(rid, created, name, c.index, {"role": "assistant", "content": ""},
                                          None, None, include_usage))
        # The SSE events of everything already queued go out in one send: one event per token
        # as before, but not one write (and one pass through the ASGI server) per token.
        ready: list[str] = []
        async for item in run.events(request, streaming=True):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            delta = apply(*item)
            if delta.get("error"):
                ready.append(_sse(error_body(delta["error"], "server_error")))
            else:
                ready.extend(_sse(chunk) for chunk in chunks(item[0], delta))
            if ready and run.queue.empty():
                yield "".join(ready)
                ready = []
        if ready:
            yield "".join(ready)
        if include_usage:
            yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": created, "model": name, "choices": [], "usage": usage()})
        yield "data: [DONE]\n\n"

    return _stream_response(stream())


# ---- /v1/completions ----

async def completions(runtime: Runtime, request: Request, req: CompletionRequest):
    _reject_unsupported(req)
    tok = runtime.runner.tokenizer
    # Tokenizing (and rendering a chat) off the event loop: a prompt of megabytes takes seconds,
    # every other stream's chunks would wait for it (the tokenizer releases the GIL).
    prompts, texts, added_bos = await asyncio.to_thread(_completion_prompts, runtime, req.prompt, req.echo)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens < 0 or (max_tokens == 0 and not req.echo):
        raise ApiError(400, f"max_tokens must be >= 1 (0 only with echo), got {max_tokens}", param="max_tokens")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise ApiError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
    scoring_only = max_tokens == 0  # echo of the prompt (with its logprobs): nothing generated
    grammar = await _grammar(runtime, _request_grammar_spec(req))
    vocab = runtime.runner.info.token_ids
    params = [_sampling(req, max(max_tokens, 1), req.logprobs, j, grammar, vocab, runtime.sampling_defaults)
              for _ in prompts for j in range(req.n)]
    seq_prompts = [p for p in prompts for _ in range(req.n)]
    run = _Run(runtime, seq_prompts, params, prompt_logprobs=req.echo and req.logprobs is not None)
    choices = [fmt.Choice(tok, i, req.logprobs) for i in range(len(seq_prompts))]
    for i, c in enumerate(choices):
        p = i // req.n
        if req.echo:
            c.echo(texts[p], prompts[p], skip_first=added_bos[p])
    usage = lambda: fmt.usage(sum(len(p) for p in prompts),  # noqa: E731
                              0 if scoring_only else sum(c.num_generated for c in choices))

    def apply(index: int, event: Event) -> dict:
        if scoring_only:
            event = Event(text="", tokens=(), finish_reason=event.finish_reason and "length",
                          prompt_logprobs=event.prompt_logprobs)
        return choices[index].add(event)

    return await _openai_reply(run, request, req, choices, usage, chat=False, apply=apply)


def _completion_prompts(runtime: Runtime, prompt, echo: bool = True) -> tuple[list[list[int]], list[str], list[bool]]:
    """-> (token ids per prompt, prompt text per prompt, whether we added BOS). The text of a
    token-id prompt is decoded only for `echo` (megabytes of ids take a while)."""
    tok = runtime.runner.tokenizer
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    ids, texts, bos = [], [], []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            ids.append([tok.bos_id] + tok.encode(p))
            texts.append(p)
            bos.append(True)
        else:
            if not p:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            _check_ids(runtime, p, "prompt")
            ids.append(list(p))
            texts.append(tok.decode(p) if echo else "")
            bos.append(False)
    return ids, texts, bos


def _raise_if_failed(choices) -> None:
    for c in choices:
        if c.error:
            raise ApiError(500, f"generation failed: {c.error}", "server_error")


# ---- /v1/chat/completions ----

async def chat(runtime: Runtime, request: Request, req: ChatCompletionRequest):
    _reject_unsupported(req)
    tok = runtime.runner.tokenizer
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    try:
        tools = tool_calls.parse_tools(req.tools) if req.tools else []  # [] as no tools, as vLLM
        mode = tool_calls.tool_mode(req.tool_choice, tools)
    except InvalidParameter as e:
        raise ApiError(400, str(e), param=e.param) from None
    parts = chat_images.image_parts(req.messages)
    prepared, sentinel = [], None
    if parts:
        try:
            chat_images.check_allowed(runtime.runner, len(parts), runtime.config.limit_mm_per_prompt)
            vision = chat_images.vision_of(runtime.runner)
            crops = chat_images.pan_and_scan(runtime.config.processor_kwargs,
                                             req.mm_processor_kwargs)
            # Decoding and resizing take milliseconds to seconds: not on the event loop.
            prepared = await asyncio.to_thread(chat_images.prepare, parts, vision.config.image_size,
                                               runtime.config.media_domains, crops)
        except (chat_images.ImageRequestError, media.MediaError) as e:
            raise ApiError(400, str(e), param="messages") from None
        tok = chat_images.ImageTokenizer(tok, vision.tokens.start, vision.tokens.end,
                                         vision.tokens.soft, vision.config.tokens_per_image)
        sentinel = tok.sentinel
    turns = _chat_turns(req.messages, sentinel)
    if any(p.crops for p in prepared):
        turns = chat_images.with_crops(turns, sentinel, [p.crops for p in prepared])
    if mode != "none":  # the tools are described first, as a system message
        turns.insert(0, ("system", tool_calls.preamble(tools)))
    try:
        prompt = await asyncio.to_thread(render_chat, turns, tok)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    images = ()
    if prepared:
        spans = chat_images.soft_spans(prompt, tok.soft)
        frames = [1 + p.crops for p in prepared]  # an image's spans: the original, its crops
        if len(spans) != sum(frames):
            raise ApiError(400, f"the chat template kept {len(spans)} of the request's "
                           f"{sum(frames)} images and crops", param="messages")
        at = [sum(frames[:i]) for i in range(len(frames))]
        images = tuple(SeqImage(spans=tuple(spans[a:a + n]), pixels=p.pixels, key=p.content_hash)
                       for a, n, p in zip(at, frames, prepared))
    spec = _request_grammar_spec(req)
    if mode not in ("none", "auto"):
        if spec is not None:
            raise ApiError(400, f"tool_choice {req.tool_choice!r} constrains the output already; it cannot "
                           f"be combined with {spec[2]}", param=spec[2])
        try:
            source = tool_calls.call_grammar(tools, mode, req.parallel_tool_calls)
        except InvalidParameter as e:
            raise ApiError(400, str(e), param=e.param) from None
        spec = ("tool_call", source, "tools")
    grammar = await _grammar(runtime, spec)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    n_top = (req.top_logprobs or 0) if req.logprobs else None
    if n_top is not None and not 0 <= n_top <= 20:
        raise ApiError(400, f"top_logprobs must be in [0, 20], got {n_top}", param="top_logprobs")
    limit = runtime.runner.info.max_seq_len
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = max(limit - len(prompt), 1)  # the rest of the context (over-long prompts fail below)
    elif max_tokens < 1:
        raise ApiError(400, f"{param} must be >= 1, got {max_tokens}", param=param)
    vocab = runtime.runner.info.token_ids
    params = [_sampling(req, max_tokens, n_top, j, grammar, vocab, runtime.sampling_defaults)
              for j in range(req.n)]
    run = _Run(runtime, [prompt] * req.n, params, images=images)
    choices = [fmt.Choice(runtime.runner.tokenizer, i, n_top) for i in range(req.n)]
    usage = lambda: fmt.usage(len(prompt), sum(c.num_generated for c in choices))  # noqa: E731
    streams = None
    if mode != "none":
        streams = [tool_calls.ToolStream(tools, constrained=mode != "auto") for _ in choices]
    return await _openai_reply(run, request, req, choices, usage, chat=True, tool_streams=streams)


def _chat_turns(messages, image_sentinel: str | None = None) -> list[tuple[str, str]]:
    """(role, text) turns for the chat template: an assistant turn that called tools reads as the
    calls in Gemma's format, a tool's result as a user turn (serving.tools). Image parts become
    `image_sentinel` (serving.chat_images); without one they are refused."""
    turns = []
    for i, m in enumerate(messages):
        text = _message_text(m.content, i, image_sentinel)
        if m.role == "assistant" and m.tool_calls:
            try:
                calls = tool_calls.assistant_calls_text(m.tool_calls, i)
            except InvalidParameter as e:
                raise ApiError(400, str(e), param=e.param) from None
            text = (text + "\n" if text else "") + calls
        elif m.role == "tool":
            turns.append(("user", tool_calls.tool_result_text(text)))
            continue
        turns.append((m.role, text))
    return turns


def _message_text(content, index: int, image_sentinel: str | None = None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts, images = [], False
    for j, part in enumerate(content):
        if part.get("type") == "image_url" and image_sentinel is not None:
            images = True
            continue
        if part.get("type") == "image_url":  # (no sentinel: an endpoint without images)
            raise ApiError(400, f"messages[{index}].content[{j}]: image_url parts are not "
                           "supported here", param=f"messages.{index}.content")
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"messages[{index}].content[{j}]: only text and image_url parts "
                           "are supported", param=f"messages.{index}.content")
        parts.append(part["text"])
    if images:
        return chat_images.message_text(content, image_sentinel)
    return "\n".join(parts)


# ---- /generate (native) ----

async def generate(runtime: Runtime, request: Request, req: GenerateRequest):
    tok = runtime.runner.tokenizer
    if (req.prompt is None) == (req.prompt_ids is None):
        raise ApiError(400, "give exactly one of prompt and prompt_ids", param="prompt")
    if req.prompt is not None:
        if not req.prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        ids = ([tok.bos_id] if req.add_bos else []) + await asyncio.to_thread(tok.encode, req.prompt)
    else:
        _check_ids(runtime, req.prompt_ids, "prompt_ids")
        ids = list(req.prompt_ids)
    params = _sampling(req, req.max_tokens, req.logprobs)
    run = _Run(runtime, [ids], params=[params])
    choice = fmt.Choice(tok, 0, req.logprobs)

    def result() -> dict:
        return {"text": choice.text, "token_ids": choice.token_ids, "finish_reason": choice.finish_reason,
                "usage": fmt.usage(len(ids), choice.num_generated),
                **({"logprobs": choice.native_logprobs()} if req.logprobs is not None else {})}

    if not req.stream:
        async for item in run.events(request, streaming=False):
            choice.add(item[1])
        if choice.finish_reason is None:
            return Response(status_code=499)
        _raise_if_failed([choice])
        return result()

    async def stream():
        async for item in run.events(request, streaming=True):
            if item is None:
                continue
            delta = choice.add(item[1])
            line = {"text": delta["text"], "token_ids": [t.id for t in item[1].tokens],
                    "finish_reason": delta["finish_reason"]}
            if delta.get("error"):
                line["error"] = delta["error"]
            if delta["finish_reason"]:
                line["usage"] = fmt.usage(len(ids), choice.num_generated)
            yield json.dumps(line, ensure_ascii=False) + "\n"

    return StreamingResponse(stream(), media_type="application/x-ndjson")




# ---- /tokenize, /detokenize (vLLM's shapes) ----

def tokenize(runtime: Runtime, req: TokenizeRequest) -> dict:
    tok = runtime.runner.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        ids = ([tok.bos_id] if req.add_special_tokens else []) + tok.encode(req.prompt)
    else:
        if not req.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        try:
            ids = render_chat(_chat_turns(req.messages), tok)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        opening = [tok.start_of_turn_id] + tok.encode("model\n")
        if not req.add_generation_prompt and ids[-len(opening):] == opening:
            ids = ids[:-len(opening)]
    body = {"count": len(ids), "max_model_len": runtime.runner.info.max_seq_len, "tokens": ids,
            "token_strs": [fmt.token_str(tok, i) for i in ids] if req.return_token_strs else None}
    return body


def detokenize(runtime: Runtime, req: DetokenizeRequest) -> dict:
    _check_ids(runtime, req.tokens, "tokens")
    return {"prompt": runtime.runner.tokenizer.decode(req.tokens)}
