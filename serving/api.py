"""The HTTP app (FastAPI on uvicorn): routes, authentication, readiness, body parsing and
OpenAI-style errors. The generation endpoints themselves are in `endpoints.py`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from serving import endpoints
from serving.endpoints import ApiError
from serving.metrics import CONTENT_TYPE_LATEST
from serving import openai_schema
from serving.openai_schema import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    GenerateRequest, TokenizeRequest, error_body)
from serving.runtime import Runtime

log = logging.getLogger(__name__)


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


# Far above any prompt that fits a context (a 32k-token prompt is ~150 KB of text).
MAX_BODY_BYTES = 16 << 20


class _App(FastAPI):
    """FastAPI, but a request whose error response went out whole (a 500, logged by its handler)
    keeps its connection, without uvicorn's second traceback; and a request cut short by the
    end of shutdown's grace period is ended as well as can be: 503 when nothing was sent yet,
    else its stream ends where it was."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        sent = {"start": False, "end": False}

        async def tracked(message):
            if message["type"] == "http.response.start":
                sent["start"] = True
            elif not message.get("more_body", False):
                sent["end"] = True
            await send(message)

        try:
            await super().__call__(scope, receive, tracked)
        except asyncio.CancelledError:
            log.warning("%s %s: cut short by the shutdown", scope["method"], scope["path"])
            await _end_cut_short(scope, send, sent)
        except Exception:
            if not sent["end"]:
                raise


async def _end_cut_short(scope, send, sent: dict) -> None:
    try:
        if not sent["start"]:
            await _error_response(ApiError(503, "the server shut down before the request finished",
                                           "service_unavailable"))(scope, None, send)
        elif not sent["end"]:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except Exception:  # the connection is gone already
        pass


def create_app(runtime: Runtime) -> FastAPI:
    app = _App(title="gemma3-equarx", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = runtime

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind, None, e.status_code), status_code=e.status_code)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, _):
        log.info("%s %s: its body never came whole (the client left, or a timeout or the shutdown ended it)",
                 request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        body = {"status": runtime.status, **runtime.describe()}
        if runtime.error:
            body["error"] = runtime.error
        if runtime.ready:
            c = runtime.core
            body.update(running=c.num_running, waiting=c.num_waiting)
        return JSONResponse(body, status_code=200 if runtime.ready else 503)

    @app.get("/metrics")
    async def metrics():
        m, c = runtime.metrics, runtime.core
        if m is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        m.on_state(c.num_running, c.num_waiting, c.kv_usage())
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(runtime, request)
        return {"object": "list", "data": [_model_card(runtime)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        _authorize(runtime, request)
        _check_model(runtime, name)
        return _model_card(runtime)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _accept(runtime, request, CompletionRequest)
        return await endpoints.completions(runtime, request, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _accept(runtime, request, ChatCompletionRequest)
        return await endpoints.chat(runtime, request, req)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await _accept(runtime, request, TokenizeRequest)
        return await asyncio.to_thread(endpoints.tokenize, runtime, req)  # off the event loop

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await _accept(runtime, request, DetokenizeRequest)
        return await asyncio.to_thread(endpoints.detokenize, runtime, req)

    @app.post("/generate")
    async def generate(request: Request):
        req = await _accept(runtime, request, GenerateRequest)
        return await endpoints.generate(runtime, request, req)

    return app


# ---- request checks ----

async def _accept(runtime: Runtime, request: Request, schema: type[BaseModel]):
    """A request to a model endpoint, in the order its errors are reported: the API key (401),
    the body (413 / 400), readiness (503), then the model it names (404; /generate names none)."""
    _authorize(runtime, request)
    req = await _parse(request, schema)
    _check_ready(runtime)
    _check_model(runtime, getattr(req, "model", None))
    return req


def _authorize(runtime: Runtime, request: Request) -> None:
    key = runtime.config.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                       "invalid_request_error", code="invalid_api_key")


def _check_ready(runtime: Runtime) -> None:
    if runtime.status == "ready":
        return
    why = {"loading": "the model is still loading", "shutting_down": "the server is shutting down",
           "stuck": runtime.error}
    raise ApiError(503, why.get(runtime.status) or f"the model failed to load: {runtime.error}",
                   "service_unavailable", headers={"Retry-After": "5"})


def _check_model(runtime: Runtime, name: str | None) -> None:
    if name is not None and name != runtime.config.model_name:
        raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                       f"'{runtime.config.model_name}'.", "not_found_error", "model", "model_not_found")


async def _read_body(request: Request) -> bytes:
    """The body, refused (413) once it passes MAX_BODY_BYTES: up front when its Content-Length
    says so, else while it is read, so that a chunked upload is never held whole in memory."""
    too_large = ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


class ClientGone(Exception):
    """The client left (or the server gave up on it) before its request body was whole."""


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

# Bodies larger than this are decoded and validated on a worker thread: a body of megabytes
# takes tens of milliseconds, which every other request and stream would wait for on the loop.
# One thread for them all: several would take the GIL from the event loop in turn.
PARSE_ON_LOOP_BYTES = 64 << 10
_PARSER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="request-parser")


async def _parse(request: Request, model: type[BaseModel]):
    body = await _read_body(request)
    if len(body) > PARSE_ON_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(_PARSER, _validate, body, model)
    return _validate(body, model)


def _validate(body: bytes, model: type[BaseModel]):
    """The body as a `model`, or ApiError(400) saying what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        data = openai_schema.loads(text)
    except openai_schema.JsonLimitError as e:
        raise ApiError(400, str(e), code="json_limit_exceeded") from None
    except ValueError as e:  # json.JSONDecodeError, NaN
        raise ApiError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        # JSON escapes can smuggle lone surrogates (\ud800) that are not Unicode text.
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the request contains invalid Unicode (a lone surrogate escape)") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"] if not _is_type_tag(p)]
        param = ".".join(loc) or None
        message = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param or 'body'}: {message}", param=param) from None


def _is_type_tag(p) -> bool:
    # pydantic names union branches in error locations ("str", "list[int]"): not part of the path.
    return isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p)


def _model_card(runtime: Runtime) -> dict:
    d = runtime.describe()
    return {"id": runtime.config.model_name, "object": "model", "created": runtime.created,
            "owned_by": "gemma3-equarx", "root": runtime.config.model, "parent": None,
            "max_model_len": d["max_model_len"], "tp": d["tp"], "dtype": d["dtype"],
            "allreduce": d["allreduce"], "allreduce_label": d["allreduce_label"],
            "input_modalities": ["text", "image"] if _takes_images(runtime) else ["text"]}


def _takes_images(runtime: Runtime) -> bool:
    """Whether chat requests may carry images: the model has a vision tower."""
    from serving import chat_images

    runner = runtime.runner
    return (runner is not None and chat_images.vision_of(runner) is not None
            and hasattr(runner, "image_features"))
