"""The OpenAI-compatible HTTP API of `attnstore serve`: an app factory, so tests build the app in-process.

Routes: ``POST /v1/chat/completions`` (streaming over SSE, or not), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text). Errors are OpenAI-style error objects: 400 for a malformed request or
one the server cannot serve (with what to change), 404 for an unknown model, 429 when the engine is full
(with ``Retry-After``), 500 for a failure of the server itself, 503 once it is shutting down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .engine import ChatEngine, Overloaded, Turn
from .metrics import ServerMetrics
from .protocol import (
    AttnStoreInfo,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseMessage,
    Usage,
    error_body,
)

logger = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param, self.headers = status, kind, code, param, headers


def create_app(engine: ChatEngine, model_name: str, *, default_max_tokens: int = 256,
               request_timeout_s: float = 600.0) -> FastAPI:
    """The FastAPI app serving `engine` under the model id `model_name`.

    Args:
        engine: The engine (pipeline, store, sessions).
        model_name: The id clients pass as ``model`` (``GET /v1/models`` lists it).
        default_max_tokens: Reply length when the request sets neither ``max_tokens`` nor
            ``max_completion_tokens``.
        request_timeout_s: Longest a request waits for its turn to finish.

    Example:
        >>> app = create_app(ChatEngine(ChatPipeline(model, tok, AttnStore("2GiB"))), "smollm2")  # doctest: +SKIP
        >>> uvicorn.run(app, port=8000)  # doctest: +SKIP
    """
    app = FastAPI(title="attnstore serve")
    metrics = ServerMetrics(engine.pipeline.store, engine.pending)
    app.state.engine, app.state.metrics = engine, metrics

    def error(exc: APIError) -> JSONResponse:
        metrics.errors.labels(str(exc.status)).inc()
        return JSONResponse(error_body(str(exc), exc.kind, exc.param, exc.code), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error(APIError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})"))
        if tuple(first.get("loc", ())) == ("body",):
            return error(APIError(400, "the request body must be a JSON object (Content-Type: application/json)"))
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return error(APIError(400, f"invalid request: {message}", param=where or None))

    @app.get("/health")
    async def health():
        return {"status": "ok", "pending": engine.pending(), "max_pending": engine.max_pending}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=model_name)])

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if body.model != model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {model_name!r} "
                           "(GET /v1/models)", code="model_not_found", param="model")
        missing = body.unsupported()
        if missing:
            field, what = missing
            raise APIError(400, f"{what} is not supported by this server", param=field)
        session = request.headers.get("x-session-id") or body.user
        try:
            engine.admit()
        except Overloaded as exc:
            raise APIError(429, str(exc), kind="rate_limit_error", code="overloaded", headers={"Retry-After": "1"})
        released = False
        try:
            try:
                turn = engine.prepare([m.as_template_message() for m in body.messages], session)
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages")
            max_new = body.max_new_tokens(default_max_tokens)
            options = _generate_options(body, max_new)
            completion_id = f"chatcmpl-{uuid.uuid4().hex}"
            cancel = threading.Event()
            streamer = None
            if body.stream:
                from transformers import AsyncTextIteratorStreamer

                streamer = AsyncTextIteratorStreamer(engine.pipeline.tokenizer, skip_prompt=True,
                                                     skip_special_tokens=True, timeout=request_timeout_s)
            try:
                future = engine.submit(turn, streamer, cancel, **options)
            except ValueError as exc:
                raise APIError(503, str(exc), kind="server_error", code="shutting_down")
            # The request holds its room in the engine until its turn ends, whoever stops waiting for it.
            future.add_done_callback(lambda _: engine.release())
            released = True
            if body.stream:
                return StreamingResponse(_stream(engine, metrics, turn, future, streamer, max_new, completion_id,
                                                 model_name, cancel, request_timeout_s, body),
                                         media_type="text/event-stream",
                                         headers={"X-Session-ID": turn.session_id, "Cache-Control": "no-cache"})
            reply = await _wait(future, request, cancel, request_timeout_s)
            if reply is None:
                metrics.cancelled.inc()
                return Response(status_code=499)  # the client is gone: nobody reads this
            engine.finish(turn, reply)
            metrics.observe(reply)
            result = ChatCompletion(id=completion_id, model=model_name, usage=_usage(turn, reply),
                                    attnstore=_info(turn, reply),
                                    choices=[Choice(message=ResponseMessage(content=reply.text),
                                                    finish_reason=engine.finish_reason(reply, max_new))])
            return JSONResponse(result.model_dump(), headers={"X-Session-ID": turn.session_id})
        finally:
            if not released:
                engine.release()

    return app


def _generate_options(body: ChatCompletionRequest, max_new: int) -> dict:
    options: dict = {"max_new_tokens": max_new}
    if body.temperature is not None:  # else the model's generation config decides, as in transformers serve
        if body.temperature == 0:
            options["do_sample"] = False
        else:
            options.update(do_sample=True, temperature=body.temperature)
    if body.top_p is not None and options.get("do_sample"):
        options["top_p"] = body.top_p
    if body.stop:
        options["stop_strings"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    return options


async def _wait(future, request: Request, cancel: threading.Event, timeout_s: float):
    """The turn's reply, or None if the client disconnected first (the turn is then cancelled)."""
    waiting = asyncio.wrap_future(future)
    deadline = time.monotonic() + timeout_s
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=_DISCONNECT_POLL_S)
        if done:
            try:
                return waiting.result()
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages")
            except Exception as exc:  # noqa: BLE001 - the turn failed inside the server
                logger.exception("a turn failed: %s", exc)
                raise APIError(500, f"the turn failed inside the server: {type(exc).__name__}", kind="server_error")
        if await request.is_disconnected():
            cancel.set()
            return None
        if time.monotonic() > deadline:
            cancel.set()
            raise APIError(504, f"the turn did not finish within {timeout_s} s", kind="server_error", code="timeout")


async def _stream(engine: ChatEngine, metrics: ServerMetrics, turn: Turn, future, streamer, max_new: int,
                  completion_id: str, model_name: str, cancel: threading.Event, timeout_s: float,
                  body: ChatCompletionRequest):
    def event(chunk: ChatCompletionChunk | dict) -> str:
        data = chunk if isinstance(chunk, dict) else chunk.model_dump(exclude_none=True)
        return f"data: {json.dumps(data)}\n\n"

    def chunk(delta: Delta, finish=None, **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=completion_id, model=model_name,
                                   choices=[ChunkChoice(delta=delta, finish_reason=finish)], **extra)

    finished = False
    try:
        yield event(chunk(Delta(role="assistant", content="")))
        try:
            async for text in streamer:
                if text:
                    yield event(chunk(Delta(content=text)))
        except asyncio.TimeoutError:
            cancel.set()
        try:
            reply = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported in the stream: the status line is long gone
            kind = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
            metrics.errors.labels("400" if isinstance(exc, ValueError) else "500").inc()
            yield event(error_body(f"the turn failed: {exc}", kind))
            yield "data: [DONE]\n\n"
            finished = True
            return
        engine.finish(turn, reply)
        metrics.observe(reply)
        yield event(chunk(Delta(), engine.finish_reason(reply, max_new), attnstore=_info(turn, reply)))
        if (body.stream_options or {}).get("include_usage"):
            yield event(ChatCompletionChunk(id=completion_id, model=model_name, choices=[], usage=_usage(turn, reply)))
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            cancel.set()  # the client went away mid-stream (the generator was closed): stop the turn
            metrics.cancelled.inc()


def _usage(turn: Turn, reply) -> Usage:
    prompt = len(turn.client_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=reply.generated_tokens,
                 total_tokens=prompt + reply.generated_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=reply.reused_tokens))


def _info(turn: Turn, reply) -> AttnStoreInfo:
    return AttnStoreInfo(session_id=turn.session_id, kv_source=reply.kv_source, reused_tokens=reply.reused_tokens,
                         prefilled_tokens=reply.prefilled_tokens, dropped_tokens=reply.dropped_tokens,
                         ttft_ms=1000 * reply.ttft_s, queue_ms=1000 * reply.queued_s)
