"""OpenAI wire format: request models (strict types: "10" is not a number) and error bodies.

Unknown fields are ignored (clients send many). Fields we cannot honour are rejected when set to a
non-default value rather than silently ignored.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Limits of the JSON a request carries, in its body or in strings holding JSON (guided_json,
# tool call arguments): far above any real request, well below what the parsers and the code
# walking a schema recurse through.
MAX_JSON_DEPTH = 128
MAX_INT_DIGITS = 100


class JsonLimitError(ValueError):
    """JSON nested deeper than MAX_JSON_DEPTH, or an integer of more than MAX_INT_DIGITS digits."""


def loads(text: str | bytes, what: str = "the request body"):
    """json.loads within the limits above (JsonLimitError naming the limit, json.JSONDecodeError
    for malformed JSON); NaN and Infinity are not JSON and are refused too."""
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise _too_deep(what) from None
    except (json.JSONDecodeError, _NotJson):
        raise
    except ValueError:  # int() refused the digits (Python's own limit is far above ours)
        raise _too_long() from None
    _check_depth_and_integers(data, what)
    return data


class _NotJson(ValueError):
    pass


def _reject_constant(name: str):
    raise _NotJson(f"{name} is not a valid JSON number")


def _too_deep(what: str) -> JsonLimitError:
    return JsonLimitError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")


def _too_long() -> JsonLimitError:
    return JsonLimitError(f"an integer has more than {MAX_INT_DIGITS} digits")


_INT_BOUND = 10 ** MAX_INT_DIGITS


def _check_depth_and_integers(data, what: str) -> None:
    """One pass over the containers, level by level: iterative (a recursive walk would itself
    hit Python's recursion limit) and in bytecode (a large body checked on a worker thread
    leaves the event loop its turns)."""
    level = [data] if isinstance(data, (dict, list)) else []
    if type(data) is int and not -_INT_BOUND < data < _INT_BOUND:
        raise _too_long()
    depth = 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(what)
        values = [v for c in level for v in (c.values() if type(c) is dict else c)]
        ints = [v for v in values if type(v) is int]
        if ints and (max(ints) >= _INT_BOUND or min(ints) <= -_INT_BOUND):
            raise _too_long()
        level = [v for v in values if type(v) is dict or type(v) is list]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    min_tokens: int = 0
    user: str | None = None
    # Structured output: OpenAI's response_format, and vLLM's guided_* extra body fields.
    response_format: dict | None = None
    guided_json: dict | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("guided_json")
    @classmethod
    def _guided_json_within_limits(cls, value):
        if isinstance(value, str):
            try:
                loads(value, "its JSON")
            except JsonLimitError:
                raise
            except ValueError:
                pass  # malformed: structured_output says how
        return value


class CompletionRequest(_SamplingFields):
    # Token ids first: pydantic's union tries its members in order, and a long list of ids
    # validates ~50x faster against list[int] first.
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Content parts of other types (images, audio) are rejected with a clear message by the app.
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's result
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # vLLM's per-request image processor settings: {"do_pan_and_scan": true} (serving.chat_images)
    mm_processor_kwargs: dict | None = None


class GenerateRequest(_Strict):
    """The native endpoint: a prompt string or token ids, the sampling fields, NDJSON streaming."""

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    stream: bool = False
    add_bos: bool = True


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt: prepend BOS
    add_generation_prompt: bool = True  # messages: end with the model's turn opening
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
