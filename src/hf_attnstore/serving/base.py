"""What every OpenAI route shares, written once (vLLM's ``entrypoints/openai/serving_engine.py``): `OpenAIServing`,
the base of the chat-completions, completions and Responses handlers.

A request goes one way whatever its route: `check_request` (the model, then the fields this server does not
implement: once per request), the route's own checks, `start` (admission, a 429 when the engine is full; the turn
set up off the event loop; submission, a 503 once the server is shutting down), then either `wait` (a whole
answer; a client that goes away cancels its turn) or `stream` (one SSE loop for every route: the route's
`StreamEvents` say what its events look like). Failures become `errors.APIError`, which the app answers as
OpenAI-style error objects. Route modules (chat_api.py, completions_api.py, responses_api.py) hold only what
differs: their checks, how a request becomes a turn, and the shape of their answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from transformers import LogitsProcessorList

from .engine import ChatEngine, Overloaded, RequestTurn
from .errors import APIError
from .metrics import ServerMetrics
from .penalties import OpenAIPenalties
from .pipeline import PipelineClosed
from .protocol import AttnStoreInfo, PromptTokensDetails, RequestLimits, SamplingDefaults, Usage, error_body
from .tools import ReplyParser

logger = logging.getLogger(__name__)
MIN_TEMPERATURE = 1e-5  # a lower temperature divides logits into infinities (a NaN reply, a 500): clamped to it
_DISCONNECT_POLL_S = 0.25
SSE_DONE = "data: [DONE]\n\n"


@dataclass
class Started:
    """A request's turn, queued: what a route needs to answer it.

    Example:
        >>> started = await serving.start(setup, max_new=16)  # doctest: +SKIP
        >>> reply = await serving.wait(started, request)  # doctest: +SKIP
    """

    turn: RequestTurn
    parser: ReplyParser | None  # with tools: parses the reply into content and calls
    future: object  # the pipeline's Future of the Reply
    streamer: object | None  # with `stream`: the reply's text as it is generated
    cancel: threading.Event
    max_new: int


class StreamEvents(Protocol):
    """The events of one route's stream, for `OpenAIServing.stream` (which owns the loop, the timeout, the
    client going away, and ``data: [DONE]`` where `done` asks for it). Each method returns the SSE lines to send.

    Example:
        >>> return serving.stream(started, ChatEvents(serving, started, body, "chatcmpl-1"))  # doctest: +SKIP
    """

    done: bool  # the stream ends with ``data: [DONE]`` (chat completions and completions; not Responses)

    def opening(self) -> list[str]:
        """Before any text (chat: the assistant's role; Responses: created, in progress)."""

    def deltas(self, content: str, calls: list) -> list[str]:
        """New text of the reply, and the tool calls that closed with it (the reply parser's, when there is one)."""

    async def finished(self, reply) -> list[str]:
        """The last events of a finished turn; records it (`OpenAIServing.record`)."""

    def failed(self, error: dict) -> list[str]:
        """The events of a turn that failed or timed out (`error` an OpenAI error object)."""


def sse_data(data: dict) -> str:
    """One SSE event of `data` as JSON (chat completions' and completions' form: no event name).

    Example:
        >>> sse_data({"a": 1})
        'data: {"a": 1}\\n\\n'
    """
    return f"data: {json.dumps(data)}\n\n"


class OpenAIServing:
    """The base the route handlers share (see the module's docstring): model check, unsupported fields,
    admission, submission, waiting, streaming and error mapping, each written once.

    Args:
        engine: The engine the turns are submitted to (handlers never run the model).
        metrics: The server's metrics (errors, cancellations, replies).
        model_name: The id clients pass as ``model``.
        limits: The most a request may ask for.
        timeout_s: Longest a request waits for its turn to finish.
        default_max_tokens: Reply length when a chat request sets none.
        sampling: The sampling fields filled in where a request leaves them out (default: none).

    Example:
        >>> serving = OpenAIServing(engine, metrics, "smollm2", limits, 600.0, 256)  # doctest: +SKIP
        >>> serving.check_request(body)  # 404 for another model, 400 for an unsupported field  # doctest: +SKIP
    """

    def __init__(self, engine: ChatEngine, metrics: ServerMetrics, model_name: str, limits: RequestLimits,
                 timeout_s: float, default_max_tokens: int, sampling: SamplingDefaults | None = None):
        self.engine, self.metrics, self.model_name, self.limits = engine, metrics, model_name, limits
        self.timeout_s, self.default_max_tokens = timeout_s, default_max_tokens
        self.sampling = sampling if sampling is not None else SamplingDefaults()

    # -- checks -------------------------------------------------------------------------------------------
    def check_request(self, body) -> None:
        """The checks every request gets first, once: the model it asks for, then the first field this server does
        not implement (`body.unsupported()`).

        Raises:
            APIError: 404 naming ``model`` for another model; 400 naming the unsupported field.
        """
        if body.model != self.model_name:
            raise APIError(404, f"model {body.model[:200]!r} is not served here; this server serves "
                           f"{self.model_name!r} (GET /v1/models)", code="model_not_found", param="model")
        missing = body.unsupported()
        if missing:
            field, what = missing
            raise APIError(400, f"{what} is not supported by this server", param=field)

    # -- admission and submission -------------------------------------------------------------------------
    def admit(self, why: str = "") -> None:
        """Reserves room for one turn in the engine (`release` gives it back; `start` does both).

        Raises:
            APIError: 429 with ``Retry-After`` when the engine is full (`why` says what asked for the room).
        """
        try:
            self.engine.admit()
        except Overloaded as exc:
            raise APIError(429, f"{exc}{why}", kind="rate_limit_error", code="overloaded",
                           headers={"Retry-After": "1"})

    def submit(self, turn: RequestTurn, streamer, cancel: threading.Event, options: dict):
        """Queues `turn` on the engine; its Future of the Reply.

        Raises:
            APIError: 503 once the server is shutting down; 400 for options the pipeline refuses.
        """
        try:
            return self.engine.submit(turn, streamer, cancel, **options)
        except PipelineClosed:
            raise APIError(503, "the server is shutting down: retry on another one", kind="server_error",
                           code="shutting_down")
        except ValueError as exc:  # validated before: a bug here, but the client's request all the same
            raise APIError(400, str(exc))

    async def start(self, setup: Callable[[], tuple[RequestTurn, ReplyParser | None, dict]], max_new: int,
                    stream: bool = False, why: str = "") -> Started:
        """Admits a request, sets up its turn and queues it. `setup` (run off the event loop: rendering and
        tokenizing a long conversation and compiling a grammar take a while, and other requests and streams must
        not wait for them) gives the turn, its reply parser and its `generate` options, raising `APIError` for
        the client's faults. The turn holds its room in the engine until it ends, whoever stops waiting for it.

        Raises:
            APIError: 429 when the engine is full, 503 once it is shutting down, or `setup`'s.
        """
        self.admit(why)
        try:
            turn, parser, options = await asyncio.to_thread(setup)
            cancel = threading.Event()
            streamer = None
            if stream:
                from transformers import AsyncTextIteratorStreamer

                # With tools, the parser reads the special tokens too (templates close regions on them).
                streamer = AsyncTextIteratorStreamer(self.engine.pipeline.tokenizer, skip_prompt=True,
                                                     skip_special_tokens=parser is None, timeout=self.timeout_s)
            future = self.submit(turn, streamer, cancel, options)
        except BaseException:
            self.engine.release()
            raise
        future.add_done_callback(lambda _: self.engine.release())
        return Started(turn, parser, future, streamer, cancel, max_new)

    # -- answers ------------------------------------------------------------------------------------------
    async def wait(self, started: Started, request: Request, param: str = "messages",
                   timeout_s: float | None = None):
        """The turn's reply, or None if the client disconnected first (the turn is then cancelled).

        Raises:
            APIError: 400 naming `param` for a turn refused with a ValueError (the client's), 500 for a failure
                inside the server, 504 past `timeout_s` (default: the server's).
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        waiting = asyncio.wrap_future(started.future)
        deadline = time.monotonic() + timeout_s
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=_DISCONNECT_POLL_S)
            if done:
                try:
                    return waiting.result()
                except ValueError as exc:
                    raise APIError(400, str(exc), param=param)
                except Exception as exc:  # noqa: BLE001 - the turn failed inside the server
                    logger.exception("a turn failed: %s", exc)
                    raise APIError(500, f"the turn failed inside the server: {type(exc).__name__}",
                                   kind="server_error")
            if await request.is_disconnected():
                started.cancel.set()
                return None
            if time.monotonic() > deadline:
                started.cancel.set()
                raise APIError(504, f"the turn did not finish within {timeout_s} s", kind="server_error",
                               code="timeout")

    def gone(self) -> Response:
        """The answer to a client that went away (nobody reads it): counted as cancelled."""
        self.metrics.cancelled.inc()
        return Response(status_code=499)

    async def record(self, turn: RequestTurn, reply, parser: ReplyParser | None = None):
        """A finished turn: the engine learns where its session stands (`ChatEngine.finish`, whose answer it
        returns) and the metrics count its reply. Off the event loop: with replicas, `finish` writes to the shared
        Redis, and a slow one would stall every stream and `/health` meanwhile."""
        remembered = await asyncio.to_thread(self.engine.finish, turn, reply, parser)
        self.metrics.observe(reply)
        return remembered

    def parse_whole(self, parser: ReplyParser, reply, max_new: int) -> None:
        """Parses a whole reply for tool calls (its ids decoded with their special tokens, on which templates close
        regions). Where the parser gives up, the calls closed before stay calls and the rest is content, as a
        streamed reply gives them; a reply cut (at `max_new` tokens) in its last call keeps its complete ones."""
        parser.feed(self.engine.pipeline.tokenizer.decode(list(reply.generated_ids)))
        parser.finish(cut=self.engine.finish_reason(reply, max_new) == "length")

    def stream(self, started: Started, events: StreamEvents) -> StreamingResponse:
        """The turn's answer as server-sent events: `events` shape them, the loop here is every route's."""
        return StreamingResponse(self._sse(started, events), media_type="text/event-stream",
                                 headers={"X-Session-ID": started.turn.session_id, "Cache-Control": "no-cache"})

    def stream_lines(self, started: Started, events: StreamEvents):
        """The lines `stream` sends, from the same loop, without the HTTP response (a WebSocket sends them itself)."""
        return self._sse(started, events)

    async def _sse(self, started: Started, events: StreamEvents):
        parser = started.parser
        finished = timed_out = False
        try:
            for line in events.opening():
                yield line
            try:
                async for text in started.streamer:
                    if text:
                        for line in events.deltas(*parser.feed(text)) if parser is not None else \
                                events.deltas(text, []):
                            yield line
            except asyncio.TimeoutError:  # cut: reported as an error below, not as a finished reply
                started.cancel.set()
                timed_out = True
            reply, failure = None, None
            try:
                reply = await asyncio.wait_for(asyncio.wrap_future(started.future), self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - reported in the stream: the status line is long gone
                failure = exc
            if parser is not None:  # the reply's end known first: a call it was cut in is no call, nor text
                cut = reply is not None and self.engine.finish_reason(reply, started.max_new) == "length"
                for line in events.deltas(*parser.finish(cut=cut)):
                    yield line
            if failure is not None:
                client = isinstance(failure, ValueError)
                self.metrics.errors.labels("400" if client else "500").inc()
                lines = events.failed(error_body(f"the turn failed: {failure}",
                                                 "invalid_request_error" if client else "server_error"))
            else:
                if timed_out:
                    await self.record(started.turn, reply, parser)  # the index learns where the session stands
                    self.metrics.errors.labels("504").inc()
                    lines = events.failed(error_body(f"the turn did not finish within {self.timeout_s} s",
                                                     "server_error", code="timeout"))
                else:
                    lines = await events.finished(reply)
            for line in lines:
                yield line
            if events.done:
                yield SSE_DONE
            finished = True
        finally:
            if not finished:
                started.cancel.set()  # the client went away mid-stream (the generator was closed): stop the turn
                self.metrics.cancelled.inc()

    # -- options ------------------------------------------------------------------------------------------
    def turn_options(self, body, max_new: int) -> dict:
        """A turn's `generate` options (`generate_options`) with, for a JSON ``response_format``, the processor
        that constrains its reply (structured.py: one per turn, it follows the turn's tokens).

        Raises:
            APIError: 400 naming ``response_format`` for a format the grammar compiler refuses.
        """
        options = generate_options(body, max_new)
        try:
            wanted, schema = body.json_schema()
            if wanted:
                processor = self.engine.grammars.processor(schema)
                options["logits_processor"] = LogitsProcessorList([*options.get("logits_processor", []), processor])
        except ValueError as exc:  # GrammarError included
            raise APIError(400, str(exc), param="response_format")
        return options


def generate_options(body, max_new: int) -> dict:
    """`generate` options for a request, over the pipeline's: chat completions, completions or Responses (a
    field a route does not have counts as unset).

    Example:
        >>> from hf_attnstore.serving.protocol import CompletionRequest
        >>> generate_options(CompletionRequest(model="m", prompt="hi", temperature=0.0), 8)
        {'max_new_tokens': 8, 'do_sample': False}
    """
    def field(name: str):
        return getattr(body, name, None)

    options: dict = {"max_new_tokens": max_new}
    temperature = field("temperature")
    if temperature is not None:  # else the model's generation config decides, as in transformers serve
        if temperature == 0:
            options["do_sample"] = False
        else:  # clamped as the batch runner does: a tinier one overflows the logits into NaN (a 500)
            options.update(do_sample=True, temperature=max(temperature, MIN_TEMPERATURE))
    if field("top_p") is not None and options.get("do_sample"):
        options["top_p"] = field("top_p")
    if field("stop"):
        options["stop_strings"] = body.stops()
    if field("seed") is not None:  # the same sampled tokens for the same seed, alone or batched
        options["seed"] = field("seed")
    if field("top_k") is not None and options.get("do_sample"):
        options["top_k"] = field("top_k")
    if field("frequency_penalty") or field("presence_penalty"):
        options["logits_processor"] = LogitsProcessorList([OpenAIPenalties(field("frequency_penalty") or 0.0,
                                                                           field("presence_penalty") or 0.0)])
    logprobs = field("logprobs")
    if logprobs is True:  # chat completions: `logprobs` and `top_logprobs` alternatives
        options["logprobs"] = field("top_logprobs") or 0
    elif isinstance(logprobs, int) and not isinstance(logprobs, bool):  # completions: the alternatives
        options["logprobs"] = logprobs
    if field("logit_bias"):  # transformers' own processor for it (GenerationConfig.sequence_bias)
        options["sequence_bias"] = {(int(token),): float(bias) for token, bias in field("logit_bias").items()}
    return options


def store_info(turn: RequestTurn, reply) -> AttnStoreInfo:
    """Ours, beside OpenAI's fields: how the turn used the store.

    Example:
        >>> store_info(turn, reply).kv_source  # doctest: +SKIP
        'host'
    """
    return AttnStoreInfo(session_id=turn.session_id, kv_source=reply.kv_source, reused_tokens=reply.reused_tokens,
                         prefilled_tokens=reply.prefilled_tokens, dropped_tokens=reply.dropped_tokens,
                         ttft_ms=1000 * reply.ttft_s, queue_ms=1000 * reply.queued_s)


def usage_of(turn: RequestTurn, reply) -> Usage:
    """OpenAI's usage of a turn: ``cached_tokens`` are the prompt tokens whose KV was reused.

    Example:
        >>> usage_of(turn, reply).prompt_tokens_details.cached_tokens  # doctest: +SKIP
        12
    """
    prompt = len(turn.client_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=reply.generated_tokens,
                 total_tokens=prompt + reply.generated_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=reply.reused_tokens))
