"""The OpenAI-compatible HTTP API of `attnstore serve`: an app factory, so tests build the app in-process.

Routes: ``POST /v1/chat/completions`` (streaming over SSE, or not), ``POST /v1/responses`` with ``GET`` and
``DELETE /v1/responses/{id}`` (responses_api.py), ``POST /v1/completions`` (completions.py), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text). Errors are OpenAI-style error objects, the field at fault in ``param``:
400 for a malformed request or one the server cannot serve (with what to change; every size a client gives is
bounded by `RequestLimits`), 404 for an unknown model or route, 413 for a body over the limit, 429 when the
engine is full (with ``Retry-After``), 500 for a failure of the server itself, 503 only once it is shutting
down. Nothing a client sends can stop the server: the pipeline's worker survives any one turn's failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .completions import add_completions_routes
from .handling import (APIError, chat_logprobs, more_samples, parse_whole, sse_timeout, start_turn, store_info,
                       usage_of, wait_reply)

from .engine import ChatEngine, Turn
from .metrics import ServerMetrics
from .openai_schema import error_field, error_tag
from .protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ModelCard,
    ModelList,
    RequestLimits,
    ResponseMessage,
    ToolCallDelta,
    error_body,
)
from .responses import ResponseStore
from .responses_api import add_responses_routes
from .tools import ReplyParser

logger = logging.getLogger(__name__)


class _BodyTooLarge(StarletteHTTPException):
    """A request body over `RequestLimits.body_bytes` (raised while it is read: FastAPI passes it on)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes: send fewer or shorter messages")


class _BodyLimit:
    """ASGI middleware: a request body longer than `limit` bytes is refused (413) as soon as it is known to be:
    from its Content-Length, or while it is read (a chunked body), never held whole in memory."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        seen = 0

        async def limited():
            nonlocal seen
            if declared.isdigit() and int(declared) > self.limit:
                raise _BodyTooLarge(self.limit)
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge(self.limit)
            return message

        return await self.app(scope, limited, send)


def create_app(engine: ChatEngine, model_name: str, *, default_max_tokens: int = 256,
               request_timeout_s: float = 600.0, limits: RequestLimits | None = None,
               responses: ResponseStore | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under the model id `model_name`.

    Args:
        engine: The engine (pipeline, store, sessions).
        model_name: The id clients pass as ``model`` (``GET /v1/models`` lists it).
        default_max_tokens: Reply length when the request sets neither ``max_tokens`` nor
            ``max_completion_tokens``; at most `limits.max_tokens`.
        request_timeout_s: Longest a request waits for its turn to finish.
        limits: The most a request may ask for; default `RequestLimits.for_pipeline(engine.pipeline)` (from
            the context window).
        responses: Where ``/v1/responses`` keeps stored responses; default: in memory, and in
            ``<disk_dir>/responses`` when the store has a disk tier (chains then survive a restart).

    Raises:
        ValueError: A `default_max_tokens` that is not a positive integer or does not fit the context window.

    Example:
        >>> app = create_app(ChatEngine(ChatPipeline(model, tok, AttnStore("2GiB"))), "smollm2")  # doctest: +SKIP
        >>> uvicorn.run(app, port=8000)  # doctest: +SKIP
    """
    limits = limits if limits is not None else RequestLimits.for_pipeline(engine.pipeline)
    if not isinstance(default_max_tokens, int) or isinstance(default_max_tokens, bool) or default_max_tokens < 1:
        raise ValueError(f"`default_max_tokens` must be a positive integer, got {default_max_tokens!r}")
    if limits.max_tokens is not None and default_max_tokens > limits.max_tokens:
        raise ValueError(f"`default_max_tokens` ({default_max_tokens}) is longer than the longest reply the context "
                         f"window allows ({limits.max_tokens}): lower it (--max-tokens) or widen the window "
                         "(--context-window)")
    app = FastAPI(title="attnstore serve")
    app.add_middleware(_BodyLimit, limit=limits.body_bytes)
    metrics = ServerMetrics(engine.pipeline.store, engine.pending, engine.pipeline.batch_memory)
    app.state.engine, app.state.metrics, app.state.limits = engine, metrics, limits
    if responses is None:
        store = engine.pipeline.store
        disk = store.config.disk_dir if store is not None else None
        responses = ResponseStore(Path(disk) / "responses" if disk is not None else None)
    app.state.responses = responses

    def error(exc: APIError) -> JSONResponse:
        metrics.errors.labels(str(exc.status)).inc()
        return JSONResponse(error_body(str(exc), exc.kind, exc.param, exc.code), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # Starlette's and FastAPI's own errors (unknown route, wrong method, an unreadable body) as OpenAI errors.
        status, param, code = exc.status_code, None, None
        cause = exc.__cause__
        if isinstance(exc, _BodyTooLarge):
            message, param, code = str(exc.detail), "messages", "request_too_large"
        elif status == 400 and isinstance(cause, UnicodeDecodeError):
            message = (f"the request body is not valid UTF-8 (byte {cause.start}: {cause.reason}): send JSON "
                       "encoded as UTF-8")
        elif status == 400 and cause is not None:
            message = f"the request body could not be parsed ({type(cause).__name__}): send a JSON object"
        elif status == 404:
            message = f"Invalid URL ({request.method} {request.url.path}): this server serves POST " \
                      "/v1/chat/completions, POST /v1/completions, POST /v1/responses, GET and DELETE /v1/responses/{id}, GET " \
                      "/v1/models, /health and /metrics"
            code = "not_found"
        elif status == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message = str(exc.detail)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return error(APIError(status, message, kind=kind, code=code, param=param, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # A failure of the server itself, as an OpenAI error too (Starlette logs it and re-raises it after this).
        return error(APIError(500, f"the server failed: {type(exc).__name__}", kind="server_error"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error(APIError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})"))
        if tuple(first.get("loc", ())) == ("body",):
            return error(APIError(400, "the request body must be a JSON object (Content-Type: application/json)"))
        message, param = _validation_message(exc.errors())
        return error(APIError(400, message, param=param))

    @app.get("/health")
    async def health():
        body = {"status": "ok", "pending": engine.pending(), "max_pending": engine.max_pending}
        store = engine.pipeline.store
        if store is not None and store.config.remote is not None:
            # A cache, not a dependency: the server is healthy with it down (its lookups are misses meanwhile).
            body["remote"] = "down" if store.stats().remote_down else "up"
        return body

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=model_name)])

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        started = await start_turn(engine, body, request, limits, model_name, default_max_tokens, request_timeout_s)
        turn, parser, future, streamer, cancel, max_new = (started.turn, started.parser, started.future,
                                                           started.streamer, started.cancel, started.max_new)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(_stream(engine, metrics, turn, future, streamer, max_new, completion_id,
                                             model_name, cancel, request_timeout_s, body, parser),
                                     media_type="text/event-stream",
                                     headers={"X-Session-ID": turn.session_id, "Cache-Control": "no-cache"})
        samples = [started, *await more_samples(engine, started, body, body.n - 1)]
        replies = []
        deadline = time.monotonic() + request_timeout_s  # one for all the samples
        try:
            for sample in samples:
                reply = await wait_reply(sample.future, request, sample.cancel,
                                         max(0.0, deadline - time.monotonic()))
                if reply is None:
                    metrics.cancelled.inc()
                    return Response(status_code=499)  # the client is gone: nobody reads this
                replies.append(reply)
        finally:
            if len(replies) < len(samples):  # one failed, timed out or lost its client: none goes on
                for sample in samples:
                    sample.cancel.set()
        choices = []
        for i, (sample, reply) in enumerate(zip(samples, replies)):
            message = ResponseMessage(content=reply.text)
            if sample.parser is not None:
                parse_whole(engine, sample.parser, reply)
                message = ResponseMessage(content=sample.parser.message_content,
                                          tool_calls=sample.parser.calls or None)
            engine.finish(sample.turn, reply, sample.parser)
            metrics.observe(reply)
            choices.append(Choice(index=i, message=message,
                                  finish_reason=engine.finish_reason(reply, max_new, sample.parser),
                                  logprobs=chat_logprobs(engine.pipeline.tokenizer, reply)))
        usage = usage_of(turn, replies[0])  # the prompt once (OpenAI's), every sample's tokens
        usage.completion_tokens = sum(r.generated_tokens for r in replies)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        result = ChatCompletion(id=completion_id, model=model_name, usage=usage, attnstore=store_info(turn, replies[0]),
                                choices=choices)
        if len(samples) > 1:  # how each further sample reused the first one's prompt
            result.attnstore.samples_reused_tokens = [r.reused_tokens for r in replies[1:]]
        return JSONResponse(result.model_dump(), headers={"X-Session-ID": turn.session_id})


    add_responses_routes(app, engine, metrics, responses, model_name, limits, default_max_tokens, request_timeout_s)
    add_completions_routes(app, engine, metrics, model_name, limits, request_timeout_s)
    return app


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A request's validation errors as an OpenAI error: its message and the field at fault (``param``). A
    field of several accepted types that matches none names each type's complaint."""
    def located(e: dict) -> tuple:
        return tuple(part for part in e.get("loc", ()) if part != "body")

    def what(e: dict) -> str:
        return str(e.get("msg", "invalid request")).removeprefix("Value error, ")

    where, alternatives = error_field(located(errors[0]))
    if alternatives:
        depth = len(where.split(".")) if where else 0
        first: dict[str, str] = {}  # each accepted type (its tag) and the first complaint of it
        for e in errors:
            loc = located(e)
            if error_field(loc)[0] != where:
                continue
            tag = str(loc[depth])
            inner = [str(p) for p in loc[depth + 1:] if not error_tag(p)]
            shown = tag if len(tag) <= 24 else tag.split("[")[0] + "[...]"
            first.setdefault(tag, f"{shown}{' at ' + '.'.join(inner) if inner else ''}: {what(e)}")
        message = "matches none of its accepted types (" + "; ".join(first.values()) + ")"
    else:
        message = what(errors[0])
    return f"invalid request: {where}: {message}" if where else f"invalid request: {message}", where


async def _stream(engine: ChatEngine, metrics: ServerMetrics, turn: Turn, future, streamer, max_new: int,
                  completion_id: str, model_name: str, cancel: threading.Event, timeout_s: float,
                  body: ChatCompletionRequest, parser: ReplyParser | None = None):
    def event(chunk: ChatCompletionChunk | dict) -> str:
        data = chunk if isinstance(chunk, dict) else chunk.model_dump(exclude_none=True)
        return f"data: {json.dumps(data)}\n\n"

    def chunk(delta: Delta, finish=None, logprobs=None, **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=completion_id, model=model_name,
                                   choices=[ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)], **extra)

    calls = 0

    def deltas(content: str, new_calls: list) -> list[str]:
        nonlocal calls
        out = [event(chunk(Delta(content=content)))] if content else []
        for call in new_calls:  # each call whole, when its region closes (as transformers serve streams them)
            out.append(event(chunk(Delta(tool_calls=[ToolCallDelta(index=calls, id=call.id,
                                                                   function=call.function)]))))
            calls += 1
        return out

    finished = timed_out = False
    try:
        yield event(chunk(Delta(role="assistant", content="")))
        try:
            async for text in streamer:
                if text:
                    for line in deltas(*parser.feed(text)) if parser is not None else deltas(text, []):
                        yield line
        except asyncio.TimeoutError:  # cut: reported as an error below, not as a finished reply
            cancel.set()
            timed_out = True
        if parser is not None:
            for line in deltas(*parser.finish()):
                yield line
        try:
            reply = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported in the stream: the status line is long gone
            kind = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
            metrics.errors.labels("400" if isinstance(exc, ValueError) else "500").inc()
            yield event(error_body(f"the turn failed: {exc}", kind))
            yield "data: [DONE]\n\n"
            finished = True
            return
        engine.finish(turn, reply, parser)
        metrics.observe(reply)
        if timed_out:
            for line in sse_timeout(metrics, timeout_s):
                yield line
            finished = True
            return
        # Log-probabilities come with the last chunk, all of them: the text streamer's pieces are not tokens.
        yield event(chunk(Delta(), engine.finish_reason(reply, max_new, parser),
                          chat_logprobs(engine.pipeline.tokenizer, reply), attnstore=store_info(turn, reply)))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield event(ChatCompletionChunk(id=completion_id, model=model_name, choices=[], usage=usage_of(turn, reply)))
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            cancel.set()  # the client went away mid-stream (the generator was closed): stop the turn
            metrics.cancelled.inc()
