"""``POST /v1/completions``: OpenAI's (legacy) text completions, over the same store as the chat routes.

The prompt is text (tokenized as the model's tokenizer does by default, special tokens included) or token ids.
No chat template: the prompt is the model's input as given. A prompt that continues a stored session (its ids
begin with that session's prompt and completion: a client that appends the completion it got and goes on) reuses
it, as a chat conversation does, and a new prompt reuses the longest prefix it shares with any stored one (a
shared few-shot preamble). Clients that send token ids get exact reuse; text is tokenized anew, so a boundary
where the tokenizer merges the completion with what follows ends reuse there (a miss, never wrong KV).

A prompt and its completion must fit the context window together (vLLM's rule for ``max_model_len``): a raw
prompt is the client's, and truncating it silently would change the answer.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from .engine import ChatEngine, Overloaded
from .handling import APIError, check_model, generate_options, sse_timeout, store_info, usage_of, wait_reply
from .metrics import ServerMetrics
from .pipeline import PipelineClosed
from .openai_schema import OpenAIRequest
from .protocol import RequestLimits, StreamOptions, error_body, surrogate_at

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionRequest(OpenAIRequest):
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    echo: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's range: alternatives per token
    suffix: str | None = None
    user: str | None = None
    cache_salt: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.n != 1:
            return "n", "`n` other than 1"
        if self.best_of not in (None, 1):
            return "best_of", "`best_of` other than 1"
        if self.suffix:
            return "suffix", "`suffix` (insertion)"
        return None

    def one_prompt(self) -> str | list[int]:
        """The prompt: text or ids (a list of one prompt is taken; several are refused, as `n` > 1 is)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("several prompts in one request are not supported: send one per request")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    def stops(self) -> list[str]:
        if not self.stop:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def add_completions_routes(app: FastAPI, engine: ChatEngine, metrics: ServerMetrics, model_name: str,
                           limits: RequestLimits, timeout_s: float) -> None:
    """Adds ``POST /v1/completions`` to `app` (see the module's docstring)."""
    tokenizer = engine.pipeline.tokenizer

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model, model_name)
        missing = body.unsupported()
        if missing:
            raise APIError(400, f"{missing[1]} is not supported by this server", param=missing[0])
        problem = _check(body, limits)
        if problem:
            raise APIError(400, problem[1], param=problem[0])
        try:
            prompt = body.one_prompt()
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt")
        if isinstance(prompt, str):
            bad = surrogate_at(prompt)
            if bad is not None:
                raise APIError(400, f"the prompt has a lone surrogate at {bad}: send valid Unicode text",
                               param="prompt")
            if len(prompt) > limits.max_request_chars:
                raise APIError(400, f"the prompt has {len(prompt)} characters; at most {limits.max_request_chars} "
                               "are accepted", param="prompt")
            ids = await asyncio.to_thread(lambda: tokenizer(prompt)["input_ids"])
        else:
            bad = next((t for t in prompt if limits.vocab_size is not None and t >= limits.vocab_size or t < 0), None)
            if bad is not None:
                raise APIError(400, f"the prompt has the token id {bad}, outside the vocabulary [0, "
                               f"{limits.vocab_size})", param="prompt")
            ids = list(prompt)
        max_new = body.max_tokens or DEFAULT_MAX_TOKENS
        window = engine.pipeline.truncation.context_window or engine.pipeline.position_limit
        if window is not None and len(ids) + max_new > window:
            raise APIError(400, f"the prompt has {len(ids)} tokens and `max_tokens` is {max_new}: together at most "
                           f"{window} fit the context window; shorten the prompt or lower `max_tokens`",
                           param="prompt")
        session = request.headers.get("x-session-id") or body.user or None
        if session:
            why = limits.session_id_problem(session, "X-Session-ID" if request.headers.get("x-session-id")
                                            else "user")
            if why is not None:
                raise APIError(400, why, param="user")
        try:
            engine.admit()
        except Overloaded as exc:
            raise APIError(429, str(exc), kind="rate_limit_error", code="overloaded", headers={"Retry-After": "1"})
        try:
            try:
                turn = engine.prepare_ids(ids, session, body.cache_salt)
            except ValueError as exc:
                raise APIError(400, str(exc), param="cache_salt" if body.cache_salt is not None else "prompt")
            cancel, streamer = threading.Event(), None
            if body.stream:
                from transformers import AsyncTextIteratorStreamer

                streamer = AsyncTextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True,
                                                     timeout=timeout_s)
            try:
                future = engine.submit(turn, streamer, cancel, **generate_options(body, max_new))
            except PipelineClosed:
                raise APIError(503, "the server is shutting down: retry on another one", kind="server_error",
                               code="shutting_down")
        except BaseException:
            engine.release()
            raise
        future.add_done_callback(lambda _: engine.release())
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        echo = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if body.echo else ""
        if body.stream:
            return StreamingResponse(_stream(engine, metrics, turn, future, streamer, cancel, body, completion_id,
                                             model_name, max_new, echo, timeout_s),
                                     media_type="text/event-stream",
                                     headers={"X-Session-ID": turn.session_id, "Cache-Control": "no-cache"})
        reply = await wait_reply(future, request, cancel, timeout_s, param="prompt")
        if reply is None:
            metrics.cancelled.inc()
            return Response(status_code=499)
        engine.finish(turn, reply)
        metrics.observe(reply)
        result = _object(completion_id, model_name, echo + reply.text, engine.finish_reason(reply, max_new),
                         _logprobs(tokenizer, reply, len(echo)))
        result.update(usage=usage_of(turn, reply).model_dump(), attnstore=store_info(turn, reply).model_dump())
        return JSONResponse(result, headers={"X-Session-ID": turn.session_id})


def _check(body: CompletionRequest, limits: RequestLimits) -> tuple[str, str] | None:
    """The request's sizes against `limits` (those it shares with chat requests)."""
    if body.max_tokens is not None and limits.max_tokens is not None and body.max_tokens > limits.max_tokens:
        return "max_tokens", f"`max_tokens` is {body.max_tokens}; use at most {limits.max_tokens}"
    stops = body.stops()
    if len(stops) > limits.max_stop or any(not s or len(s) > limits.max_stop_chars or surrogate_at(s) is not None
                                           for s in stops):
        return "stop", (f"`stop` takes at most {limits.max_stop} strings, each of 1 to {limits.max_stop_chars} "
                        "characters of valid Unicode")
    if body.logit_bias:
        problem = limits.logit_bias_problem(body.logit_bias)
        if problem is not None:
            return "logit_bias", problem
    return None


def _object(completion_id: str, model_name: str, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def _logprobs(tokenizer, reply, offset: int) -> dict | None:
    """A reply's ``logprobs`` in the completions form (tokens, their log-probabilities, the alternatives by
    token text, each token's offset in the returned text), or None without them."""
    if reply.logprobs is None:
        return None
    special = set(tokenizer.all_special_ids)  # not in the text either
    kept = [entry for entry in reply.logprobs if entry[0] not in special]
    tokens = [tokenizer.decode([token]) for token, _, _ in kept]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in kept],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in top} for _, _, top in kept],
            "text_offset": offsets}


async def _stream(engine: ChatEngine, metrics: ServerMetrics, turn, future, streamer, cancel: threading.Event,
                  body: CompletionRequest, completion_id: str, model_name: str, max_new: int, echo: str,
                  timeout_s: float):
    def event(data: dict) -> str:
        return f"data: {json.dumps(data)}\n\n"

    finished = timed_out = False
    try:
        if echo:
            yield event(_object(completion_id, model_name, echo, None))
        try:
            async for text in streamer:
                if text:
                    yield event(_object(completion_id, model_name, text, None))
        except asyncio.TimeoutError:  # cut: reported as an error below, not as a finished completion
            cancel.set()
            timed_out = True
        try:
            reply = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported in the stream: the status line is long gone
            metrics.errors.labels("400" if isinstance(exc, ValueError) else "500").inc()
            yield event(error_body(f"the turn failed: {exc}",
                                   "invalid_request_error" if isinstance(exc, ValueError) else "server_error"))
            yield "data: [DONE]\n\n"
            finished = True
            return
        engine.finish(turn, reply)
        metrics.observe(reply)
        if timed_out:
            for line in sse_timeout(metrics, timeout_s):
                yield line
            finished = True
            return
        # Log-probabilities come with the last chunk, all of them: the text streamer's pieces are not tokens.
        last = _object(completion_id, model_name, "", engine.finish_reason(reply, max_new),
                       _logprobs(engine.pipeline.tokenizer, reply, len(echo)))
        last["attnstore"] = store_info(turn, reply).model_dump()
        yield event(last)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield event({**_object(completion_id, model_name, "", None), "choices": [],
                         "usage": usage_of(turn, reply).model_dump()})
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            cancel.set()
            metrics.cancelled.inc()
