"""The OpenAI-compatible HTTP API of `attnstore serve`: an app factory, so tests build the app in-process.

Routes: ``POST /v1/chat/completions`` (chat_api.py), ``POST /v1/completions`` (completions_api.py), ``POST
/v1/responses`` with ``GET`` and ``DELETE /v1/responses/{id}`` and ``POST /v1/responses/compact``
(responses_api.py), and its WebSocket mode on ``/v1/responses`` (responses_ws.py), each a handler over the shared
base (base.py: model check, unsupported fields, admission, submission, waiting, one SSE loop); ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text), and SGLang's ``GET /server_info`` and ``/model_info`` (what
sglang-router reads a worker's model from), here. Errors are OpenAI-style error objects (errors.py),
the field at fault in ``param``: 400 for a malformed request or one the server cannot serve (with what to change; every size a client gives is
bounded by `RequestLimits`), 404 for an unknown model or route, 413 for a body over the limit, 429 when the
engine is full (with ``Retry-After``), 500 for a failure of the server itself, 503 only once it is shutting
down. Nothing a client sends can stop the server: the pipeline's worker survives any one turn's failure.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .chat_api import ChatServing
from .completions_api import CompletionsServing
from .engine import ChatEngine
from .errors import BodyLimit, add_error_handlers
from .metrics import ServerMetrics
from .protocol import ModelCard, ModelList, RequestLimits, SamplingDefaults
from .response_store import ResponseStore
from .response_store_redis import RedisResponseStore
from .responses_api import ResponsesServing
from .responses_ws import ResponsesSocket


def create_app(engine: ChatEngine, model_name: str, *, default_max_tokens: int = 256,
               request_timeout_s: float = 600.0, limits: RequestLimits | None = None,
               responses: ResponseStore | RedisResponseStore | None = None,
               sampling_defaults: SamplingDefaults | dict | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under the model id `model_name`.

    Args:
        engine: The engine (pipeline, store, sessions).
        model_name: The id clients pass as ``model`` (``GET /v1/models`` lists it).
        default_max_tokens: Reply length when the request sets neither ``max_tokens`` nor
            ``max_completion_tokens``; at most `limits.max_tokens`.
        request_timeout_s: Longest a request waits for its turn to finish.
        limits: The most a request may ask for; default `RequestLimits.for_pipeline(engine.pipeline)` (from
            the context window).
        responses: Where ``/v1/responses`` keeps stored responses; default: the replicas' shared Redis when the
            engine has a shared state (`RedisResponseStore`), else in memory, and in ``<disk_dir>/responses`` when
            the store has a disk tier (chains then survive a restart).
        sampling_defaults: Sampling fields filled in where a request leaves them out (`SamplingDefaults`, or a
            dict of its fields: ``temperature``, ``top_p``, ``top_k``, ``presence_penalty``,
            ``frequency_penalty``); what a request sends wins. Default: none (unset fields follow the model's
            generation config).

    Raises:
        ValueError: A `default_max_tokens` that is not a positive integer or does not fit the context window; a
            `sampling_defaults` field that is unknown or out of its range.

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
    if isinstance(sampling_defaults, dict):
        sampling_defaults = SamplingDefaults.of(sampling_defaults)
    app = FastAPI(title="attnstore serve")
    app.add_middleware(BodyLimit, limit=limits.body_bytes)
    metrics = ServerMetrics(engine.pipeline.store, engine.pending, engine.pipeline.batch_memory)
    app.state.engine, app.state.metrics, app.state.limits = engine, metrics, limits
    if responses is None and engine.shared is not None:  # replicas: a chain continues on any of them
        responses = RedisResponseStore(engine.shared)
    elif responses is None:
        store = engine.pipeline.store
        disk = store.config.disk_dir if store is not None else None
        responses = ResponseStore(Path(disk) / "responses" if disk is not None else None)
    app.state.responses = responses

    add_error_handlers(app, metrics)

    @app.get("/health")
    async def health():
        body = {"status": "ok", "pending": engine.pending(), "max_pending": engine.max_pending}
        store = engine.pipeline.store
        if store is not None:
            stats = store.stats()
            # Sessions whose last turn is not yet written to the tier below host memory (disk, else the remote
            # tier): behind a load balancer, another replica resumes a session in full once this is 0.
            body["saves_pending"] = stats.saves_pending
            if store.config.remote is not None:
                # A cache, not a dependency: the server is healthy with it down (its lookups are misses meanwhile).
                body["remote"] = "down" if stats.remote_down else "up"
        return body

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=model_name)])

    # SGLang's info endpoints: sglang-router discovers each worker's model from them (without them it lists the
    # model as "unknown", and a client that takes the model id from the router's /v1/models gets a 404 here).
    info = {"served_model_name": model_name, "is_generation": True}

    @app.get("/server_info")
    async def server_info():
        return info

    @app.get("/model_info")
    async def model_info():
        return info

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # The three OpenAI routes: handlers over one base (base.OpenAIServing), each holding only what differs.
    chat = ChatServing(engine, metrics, model_name, limits, request_timeout_s, default_max_tokens, sampling_defaults)
    completions = CompletionsServing(engine, metrics, model_name, limits, request_timeout_s, default_max_tokens,
                                     sampling_defaults)
    stored = ResponsesServing(chat, responses)
    app.post("/v1/chat/completions")(chat.create)
    app.post("/v1/completions")(completions.create)
    app.post("/v1/responses")(stored.create)
    app.post("/v1/responses/compact")(stored.compact)
    app.state.responses_socket = ResponsesSocket(stored)
    app.websocket("/v1/responses")(app.state.responses_socket)
    app.get("/v1/responses/{response_id}")(stored.get)
    app.delete("/v1/responses/{response_id}")(stored.delete)
    return app
