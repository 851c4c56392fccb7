"""What the HTTP routes share: the error they raise, a request's `generate` options, waiting for a turn (and
noticing a client that went away), and parsing a whole reply for tool calls."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import Request
from transformers import LogitsProcessorList

from .engine import ChatEngine, Overloaded, ToolsUnsupported, Turn
from .penalties import OpenAIPenalties
from .pipeline import PipelineClosed
from .protocol import AttnStoreInfo, ChatCompletionRequest, PromptTokensDetails, RequestLimits, Usage, error_body
from .tools import ReplyParser

logger = logging.getLogger(__name__)
MIN_TEMPERATURE = 1e-5  # a lower temperature divides logits into infinities (a NaN reply, a 500): clamped to it
_DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An HTTP error as OpenAI sends them: the status, the message, its type, code and the field at fault."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param, self.headers = status, kind, code, param, headers


def generate_options(body, max_new: int) -> dict:
    """`generate` options for a request, over the pipeline's: chat completions, completions or Responses (a
    field a route does not have counts as unset)."""
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


def parse_whole(engine: ChatEngine, parser: ReplyParser, reply) -> None:
    """Parses a whole reply (its ids decoded with their special tokens, on which templates close regions); a
    reply the parser gives up on is all content, as generated."""
    parser.feed(engine.pipeline.tokenizer.decode(list(reply.generated_ids)))
    parser.finish()
    if parser.failed:
        parser.content, parser.calls = reply.text, []


async def wait_reply(future, request: Request, cancel: threading.Event, timeout_s: float, param: str = "messages"):
    """The turn's reply, or None if the client disconnected first (the turn is then cancelled). A turn refused
    with a ValueError is the client's: a 400 naming `param`."""
    waiting = asyncio.wrap_future(future)
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
                raise APIError(500, f"the turn failed inside the server: {type(exc).__name__}", kind="server_error")
        if await request.is_disconnected():
            cancel.set()
            return None
        if time.monotonic() > deadline:
            cancel.set()
            raise APIError(504, f"the turn did not finish within {timeout_s} s", kind="server_error", code="timeout")




@dataclass
class Started:
    """A request's turn, queued: what a route needs to answer it."""

    turn: Turn
    parser: ReplyParser | None  # with tools: parses the reply into content and calls
    future: object  # the pipeline's Future of the Reply
    streamer: object | None  # with `stream`: the reply's text as it is generated
    cancel: threading.Event
    max_new: int


def check_model(asked: str, model_name: str) -> None:
    """A 404 naming ``model`` unless `asked` is the model this server serves."""
    if asked != model_name:
        raise APIError(404, f"model {asked[:200]!r} is not served here; this server serves {model_name!r} "
                       "(GET /v1/models)", code="model_not_found", param="model")


def sse_timeout(metrics, timeout_s: float) -> list[str]:
    """The end of an SSE stream whose turn its timeout cut: an error event (a 504's), then ``[DONE]``."""
    metrics.errors.labels("504").inc()
    error = error_body(f"the turn did not finish within {timeout_s} s", "server_error", code="timeout")
    return [f"data: {json.dumps(error)}\n\n", "data: [DONE]\n\n"]


def turn_options(engine: ChatEngine, body, max_new: int) -> dict:
    """A turn's `generate` options (`generate_options`) with, for a JSON ``response_format``, the processor that
    constrains its reply (structured.py: one per turn, it follows the turn's tokens).

    Raises:
        APIError: 400 naming ``response_format`` for a format the grammar compiler refuses.
    """
    options = generate_options(body, max_new)
    try:
        wanted, schema = body.json_schema()
        if wanted:
            processor = engine.grammars.processor(schema)
            options["logits_processor"] = LogitsProcessorList([*options.get("logits_processor", []), processor])
    except ValueError as exc:  # GrammarError included
        raise APIError(400, str(exc), param="response_format")
    return options


async def start_turn(engine: ChatEngine, body: ChatCompletionRequest, request: Request, limits: RequestLimits,
                     model_name: str, default_max_tokens: int, timeout_s: float, session: str | None = None) -> Started:
    """Checks a chat request (model, unsupported fields, limits, session id), admits it, renders it and queues
    its turn (on the session the client names, else `session`, else the one the index finds). The request holds
    its room in the engine until the turn ends, whoever stops waiting for it.

    Raises:
        APIError: 404 for another model, 400 for a request this server will not run, 429 when the engine is
            full, 503 once it is shutting down.
    """
    check_model(body.model, model_name)
    missing = body.unsupported()
    if missing:
        field, what = missing
        raise APIError(400, f"{what} is not supported by this server", param=field)
    over = limits.check(body)
    if over:
        field, what = over
        raise APIError(400, what, param=field)
    header = request.headers.get("x-session-id")
    if header:
        problem = limits.session_id_problem(header, "X-Session-ID")
        if problem is not None:
            raise APIError(400, problem, param="X-Session-ID")
    session = header or body.user or session or None  # an empty id names no session
    try:
        engine.admit()
    except Overloaded as exc:
        raise APIError(429, str(exc), kind="rate_limit_error", code="overloaded", headers={"Retry-After": "1"})
    max_new = body.max_new_tokens(default_max_tokens)
    try:
        # Off the event loop: rendering and tokenizing a long conversation, decoding it for the reply parser
        # and compiling a grammar take a while, and other requests (and streams) must not wait for them.
        turn, parser, options = await asyncio.to_thread(_setup, engine, body, session, max_new)
        cancel = threading.Event()
        streamer = None
        if body.stream:
            from transformers import AsyncTextIteratorStreamer

            # With tools, the parser reads the special tokens too (templates close regions on them).
            streamer = AsyncTextIteratorStreamer(engine.pipeline.tokenizer, skip_prompt=True,
                                                 skip_special_tokens=parser is None, timeout=timeout_s)
        future = _submit(engine, turn, streamer, cancel, options)
    except BaseException:
        engine.release()
        raise
    future.add_done_callback(lambda _: engine.release())
    return Started(turn, parser, future, streamer, cancel, max_new)


def _setup(engine: ChatEngine, body: ChatCompletionRequest, session: str | None, max_new: int,
           turn: Turn | None = None):
    """A request's turn (rendered, unless given), reply parser and options; APIErrors for the client's faults."""
    try:
        tools = body.template_tools()
        if turn is None:
            turn = engine.prepare([m.as_template_message() for m in body.messages], session, body.cache_salt, tools)
        parser = engine.reply_parser(turn, tools, body.parallel_tool_calls is not False) \
            if body.parses_tool_calls() else None
    except ToolsUnsupported as exc:
        raise APIError(400, str(exc), param="tools")
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages")
    return turn, parser, turn_options(engine, body, max_new)


def _submit(engine: ChatEngine, turn: Turn, streamer, cancel: threading.Event, options: dict):
    try:
        return engine.submit(turn, streamer, cancel, **options)
    except PipelineClosed:
        raise APIError(503, "the server is shutting down: retry on another one", kind="server_error",
                       code="shutting_down")
    except ValueError as exc:  # validated before: a bug here, but the client's request all the same
        raise APIError(400, str(exc))


async def more_samples(engine: ChatEngine, first: Started, body: ChatCompletionRequest, count: int) -> list[Started]:
    """`count` more samples of `first`'s prompt (OpenAI's ``n``), each a turn of its own on a new session with
    the same ids: they reuse the prompt's KV that the first one stores (the store's prefix sharing; in a
    batching pipeline each is looked up when its prefill comes), and the client's next request continues
    whichever sample it kept (the session index finds it). Sample ``i`` samples with ``seed + i`` when a seed is
    given, with a reply parser and a grammar of its own (they follow its tokens). Each holds its own room in the
    engine; when one cannot be started, all are cancelled.

    Raises:
        APIError: 429 when the engine is full, 503 once it is shutting down.
    """
    started: list[Started] = []
    try:
        for i in range(1, count + 1):
            try:
                engine.admit()
            except Overloaded as exc:
                raise APIError(429, f"{exc} (`n` asks for {count + 1} turns)", kind="rate_limit_error",
                               code="overloaded", headers={"Retry-After": "1"})
            try:
                turn = replace(first.turn, session_id=f"chat-{uuid.uuid4().hex}")
                turn, parser, options = await asyncio.to_thread(_setup, engine, body, None, first.max_new, turn)
                if "seed" in options:  # within torch's range: [-2**63, 2**64)
                    options["seed"] = options["seed"] + i if options["seed"] + i < 2**64 else options["seed"] - i
                cancel = threading.Event()
                future = _submit(engine, turn, None, cancel, options)
            except BaseException:
                engine.release()
                raise
            future.add_done_callback(lambda _: engine.release())
            started.append(Started(turn, parser, future, None, cancel, first.max_new))
    except BaseException:
        for sample in [first, *started]:
            sample.cancel.set()
        raise
    return started


def store_info(turn: Turn, reply) -> AttnStoreInfo:
    """Ours, beside OpenAI's fields: how the turn used the store."""
    return AttnStoreInfo(session_id=turn.session_id, kv_source=reply.kv_source, reused_tokens=reply.reused_tokens,
                         prefilled_tokens=reply.prefilled_tokens, dropped_tokens=reply.dropped_tokens,
                         ttft_ms=1000 * reply.ttft_s, queue_ms=1000 * reply.queued_s)


def chat_logprobs(tokenizer, reply) -> dict | None:
    """A reply's ``logprobs`` in chat completions' form (each token's text, log-probability, UTF-8 bytes and
    alternatives), or None without them."""
    if reply.logprobs is None:
        return None

    def entry(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    special = set(tokenizer.all_special_ids)  # not in the content either (the end of turn, above all)
    return {"content": [{**entry(token, lp), "top_logprobs": [entry(t, l) for t, l in top]}
                        for token, lp, top in reply.logprobs if token not in special], "refusal": None}


def usage_of(turn: Turn, reply) -> Usage:
    """OpenAI's usage of a turn: ``cached_tokens`` are the prompt tokens whose KV was reused."""
    prompt = len(turn.client_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=reply.generated_tokens,
                 total_tokens=prompt + reply.generated_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=reply.reused_tokens))
