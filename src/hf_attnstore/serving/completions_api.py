"""``POST /v1/completions``: OpenAI's (legacy) text completions, over the same store as the chat routes; what
differs from the other routes (base.py has the rest).

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
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from .base import OpenAIServing, Started, generate_options, sse_data, store_info, usage_of
from .errors import APIError
from .protocol import DEFAULT_MAX_TOKENS, CompletionRequest, completion_logprobs, completion_object, surrogate_at


class CompletionsServing(OpenAIServing):
    """The completions route over the shared base (`OpenAIServing`).

    Example:
        >>> completions = CompletionsServing(engine, metrics, "smollm2", limits, 600.0, 256)  # doctest: +SKIP
        >>> app.post("/v1/completions")(completions.create)  # doctest: +SKIP
    """

    async def create(self, body: CompletionRequest, request: Request):
        """Answers one completions request (the route's handler)."""
        self.check_request(body)
        body = self.sampling.fill(body)  # the server's defaults for what the request leaves out
        problem = self.limits.check_completion(body)
        if problem:
            raise APIError(400, problem[1], param=problem[0])
        prompt, ids = await self._prompt_ids(body)
        max_new = body.max_tokens or DEFAULT_MAX_TOKENS
        window = self.engine.pipeline.truncation.context_window or self.engine.pipeline.position_limit
        if window is not None and len(ids) + max_new > window:
            raise APIError(400, f"the prompt has {len(ids)} tokens and `max_tokens` is {max_new}: together at most "
                           f"{window} fit the context window; shorten the prompt or lower `max_tokens`",
                           param="prompt")
        header = request.headers.get("x-session-id") or None
        named = header or body.user or None
        if named:
            why = self.limits.session_id_problem(named, "X-Session-ID" if header else "user")
            if why is not None:
                raise APIError(400, why, param="X-Session-ID" if header else "user")
        session, hint = header, None if header else (body.user or None)  # `user` is shared: see ChatEngine._place

        def setup():
            try:
                turn = self.engine.prepare_ids(ids, session, body.cache_salt, hint=hint)
            except ValueError as exc:
                raise APIError(400, str(exc), param="cache_salt" if body.cache_salt is not None else "prompt")
            return turn, None, generate_options(body, max_new)

        started = await self.start(setup, max_new, stream=body.stream)
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        tokenizer = self.engine.pipeline.tokenizer
        echo = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if body.echo else ""
        if body.stream:
            return self.stream(started, CompletionEvents(self, started, body, completion_id, echo))
        reply = await self.wait(started, request, param="prompt")
        if reply is None:
            return self.gone()
        turn = started.turn
        await self.record(turn, reply)
        result = completion_object(completion_id, self.model_name, echo + reply.text,
                                   self.engine.finish_reason(reply, max_new),
                                   completion_logprobs(tokenizer, reply, len(echo)))
        result.update(usage=usage_of(turn, reply).model_dump(), attnstore=store_info(turn, reply).model_dump())
        return JSONResponse(result, headers={"X-Session-ID": turn.session_id})

    async def _prompt_ids(self, body: CompletionRequest) -> tuple[str | list[int], list[int]]:
        """The request's one prompt as sent and as token ids (text tokenized off the event loop); a 400 naming
        ``prompt`` for one this server will not run."""
        limits = self.limits
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
            tokenizer = self.engine.pipeline.tokenizer
            return prompt, await asyncio.to_thread(lambda: tokenizer(prompt)["input_ids"])
        bad = next((t for t in prompt if limits.vocab_size is not None and t >= limits.vocab_size or t < 0), None)
        if bad is not None:
            raise APIError(400, f"the prompt has the token id {bad}, outside the vocabulary [0, "
                           f"{limits.vocab_size})", param="prompt")
        return prompt, list(prompt)


class CompletionEvents:
    """A completion's stream chunks (`base.StreamEvents`): the echoed prompt first when asked, the text as it
    comes, then the finish reason with the log-probabilities and our ``attnstore`` object, and the usage when
    ``stream_options`` asks for it.

    Example:
        >>> return completions.stream(started, CompletionEvents(completions, started, body, "cmpl-1", ""))  # doctest: +SKIP
    """

    done = True

    def __init__(self, serving: CompletionsServing, started: Started, body: CompletionRequest, completion_id: str,
                 echo: str):
        self.serving, self.started, self.body, self.completion_id, self.echo = \
            serving, started, body, completion_id, echo

    def _object(self, text: str, finish: str | None = None, logprobs: dict | None = None) -> dict:
        return completion_object(self.completion_id, self.serving.model_name, text, finish, logprobs)

    def opening(self) -> list[str]:
        return [sse_data(self._object(self.echo))] if self.echo else []

    def deltas(self, content: str, calls: list) -> list[str]:
        return [sse_data(self._object(content))] if content else []

    async def finished(self, reply) -> list[str]:
        serving, turn = self.serving, self.started.turn
        await serving.record(turn, reply)
        # Log-probabilities come with the last chunk, all of them: the text streamer's pieces are not tokens.
        last = self._object("", serving.engine.finish_reason(reply, self.started.max_new),
                            completion_logprobs(serving.engine.pipeline.tokenizer, reply, len(self.echo)))
        last["attnstore"] = store_info(turn, reply).model_dump()
        out = [sse_data(last)]
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            out.append(sse_data({**self._object(""), "choices": [], "usage": usage_of(turn, reply).model_dump()}))
        return out

    def failed(self, error: dict) -> list[str]:
        return [sse_data(error)]
