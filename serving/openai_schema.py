"""OpenAI wire format: request models (strict types: "10" is not a number) and error bodies.

Unknown fields are ignored (clients send many). Fields we cannot honour are rejected when set to a
non-default value rather than silently ignored.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
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
