"""``POST /v1/chat/completions`` (streamed over SSE or not): what differs from the other routes (base.py has the
rest): a chat request's limits and session, its turn rendered from its messages (with tools, a reply parser),
OpenAI's ``n`` (each further sample a turn that reuses the first one's prompt), and the chat answer's shape."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse

from transformers import LogitsProcessorList

from .base import OpenAIServing, Started, generate_options, sse_data, store_info, usage_of
from .conversation import ToolsUnrenderable
from .engine import ToolsUnsupported, RequestTurn
from .errors import APIError
from .forced import ForcingUnsupported, forced_call_processor
from .protocol import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Choice, ChunkChoice, Delta,
                       FunctionDelta, ResponseMessage, ToolCallDelta)


RETAIN_24H_S = 24 * 3600  # `prompt_cache_retention: "24h"`

class ChatServing(OpenAIServing):
    """The chat-completions route over the shared base (`OpenAIServing`); the Responses route runs its requests
    as chat turns through `start_turn`.

    Example:
        >>> chat = ChatServing(engine, metrics, "smollm2", limits, 600.0, 256)  # doctest: +SKIP
        >>> app.post("/v1/chat/completions")(chat.create)  # doctest: +SKIP
    """

    async def create(self, body: ChatCompletionRequest, request: Request):
        """Answers one chat-completions request (the route's handler)."""
        self.check_request(body)
        body = self.sampling.fill(body)  # the server's defaults for what the request leaves out
        started = await self.start_turn(body, request)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return self.stream(started, ChatEvents(self, started, body, completion_id))
        samples = [started, *await self._more_samples(started, body, body.n - 1)]
        replies = []
        deadline = time.monotonic() + self.timeout_s  # one for all the samples
        try:
            for sample in samples:
                reply = await self.wait(sample, request, timeout_s=max(0.0, deadline - time.monotonic()))
                if reply is None:
                    return self.gone()
                replies.append(reply)
        finally:
            if len(replies) < len(samples):  # one failed, timed out or lost its client: none goes on
                for sample in samples:
                    sample.cancel.set()
        choices = []
        for i, (sample, reply) in enumerate(zip(samples, replies)):
            message = ResponseMessage(content=reply.text)
            if sample.parser is not None:
                self.parse_whole(sample.parser, reply, sample.max_new)
                message = ResponseMessage(content=sample.parser.message_content,
                                          tool_calls=sample.parser.calls or None)
            await self.record(sample.turn, reply, sample.parser)
            choices.append(Choice(index=i, message=message,
                                  finish_reason=self.engine.finish_reason(reply, sample.max_new, sample.parser),
                                  logprobs=chat_logprobs(self.engine.pipeline.tokenizer, reply)))
        turn = started.turn
        usage = usage_of(turn, replies[0])  # the prompt once (OpenAI's), every sample's tokens
        usage.completion_tokens = sum(r.generated_tokens for r in replies)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        result = ChatCompletion(id=completion_id, model=self.model_name, usage=usage,
                                attnstore=store_info(turn, replies[0]), choices=choices)
        if len(samples) > 1:  # how each further sample reused the first one's prompt
            result.attnstore.samples_reused_tokens = [r.reused_tokens for r in replies[1:]]
        return JSONResponse(result.model_dump(), headers={"X-Session-ID": turn.session_id})

    async def start_turn(self, body: ChatCompletionRequest, request: Request, session: str | None = None,
                         check=None) -> Started:
        """Checks a chat request's sizes and session id, then starts its turn (`OpenAIServing.start`), on the
        session the client names, else `session`, else the one the index finds. The model and the unsupported
        fields are checked before, once (`check_request`, on the request as the client sent it). `check(turn,
        max_new)`, when given, checks the rendered turn before it is queued (raising `APIError`).

        Raises:
            APIError: 400 for a request over a limit, and `start`'s.
        """
        over = self.limits.check(body)
        if over:
            field, what = over
            raise APIError(400, what, param=field)
        header = request.headers.get("x-session-id")
        if header:
            problem = self.limits.session_id_problem(header, "X-Session-ID")
            if problem is not None:
                raise APIError(400, problem, param="X-Session-ID")
        # The session the client names: its header, else the one a Responses chain continues. Else OpenAI's
        # prompt-cache key (the one that survives gateways that drop custom headers and `user`), else `user`: keys
        # that several conversations may share, followed only by the conversation that began the session
        # (`ChatEngine._place`). An empty one names nothing.
        session = header or session or None
        hint = None if session else (body.prompt_cache_key or body.user or None)
        self.metrics.prompt_cache(body.prompt_cache_key, body.prompt_cache_retention)
        max_new = body.max_new_tokens(self.default_max_tokens)

        def setup():
            made = self._setup(body, session, max_new, hint=hint)
            if check is not None:
                check(made[0], max_new)
            return made

        return await self.start(setup, max_new, stream=body.stream)

    def _setup(self, body: ChatCompletionRequest, session: str | None, max_new: int, turn: RequestTurn | None = None,
               hint: str | None = None):
        """A request's turn (rendered, unless given), reply parser and options; APIErrors for the client's faults."""
        forced = body.forced_functions()
        several = forced is not None and body.tool_choice == "required" and body.parallel_tool_calls is not False
        try:
            tools = body.template_tools()
            if turn is None:
                turn = self.engine.prepare([m.as_template_message() for m in body.messages], session,
                                           body.cache_salt, tools, hint=hint)
            if body.prompt_cache_retention == "24h":  # OpenAI's longest: idleness does not expire it before
                self.engine.pipeline.retain(turn.session_id, RETAIN_24H_S, turn.cache_salt)
            parser = self.engine.reply_parser(turn, tools, body.parallel_tool_calls is not False, drop_repeats=several) \
                if body.parses_tool_calls() else None
        except ToolsUnsupported as exc:
            raise APIError(400, str(exc), param="tools")
        except ToolsUnrenderable as exc:
            raise APIError(400, str(exc), param=exc.param)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages")
        if forced is None:
            return turn, parser, self.turn_options(body, max_new)
        # A forced call: the reply is constrained to calls (a `response_format` is for text replies: not this one).
        options = generate_options(body, max_new)
        try:
            processor = forced_call_processor(self.engine.grammars, self.engine.response_template, tools, forced,
                                              several=several, layout=self.engine.call_layout)
        except ForcingUnsupported as exc:
            raise APIError(400, str(exc), param="tool_choice")
        except ValueError as exc:  # GrammarError: a function's parameters llguidance cannot compile
            raise APIError(400, f"the tools' parameters cannot be forced: {exc}", param="tools")
        options["logits_processor"] = LogitsProcessorList([*options.get("logits_processor", []), processor])
        return turn, parser, options

    async def _more_samples(self, first: Started, body: ChatCompletionRequest, count: int) -> list[Started]:
        """`count` more samples of `first`'s prompt (OpenAI's ``n``), each a turn of its own on a new session with
        the same ids: they reuse the prompt's KV that the first one stores (the store's prefix sharing; in a
        batching pipeline each is looked up when its prefill comes), and the client's next request continues
        whichever sample it kept (the session index finds it). Sample ``i`` samples with ``seed + i`` when a seed
        is given, with a reply parser and a grammar of its own (they follow its tokens). Each holds its own room
        in the engine; when one cannot be started, all are cancelled."""

        def setup(i: int):
            turn = replace(first.turn, session_id=f"chat-{uuid.uuid4().hex}")
            turn, parser, options = self._setup(body, None, first.max_new, turn)
            if "seed" in options:  # within torch's range: [-2**63, 2**64)
                options["seed"] = options["seed"] + i if options["seed"] + i < 2**64 else options["seed"] - i
            return turn, parser, options

        started: list[Started] = []
        try:
            for i in range(1, count + 1):
                started.append(await self.start(lambda i=i: setup(i), first.max_new,
                                                why=f" (`n` asks for {count + 1} turns)"))
        except BaseException:
            for sample in [first, *started]:
                sample.cancel.set()
            raise
        return started


class ChatEvents:
    """A chat completion's stream chunks (`base.StreamEvents`): the assistant's role, text deltas, each tool call's
    id and name, then its arguments as they are written (as OpenAI streams them), then the finish reason with the
    log-probabilities and our ``attnstore`` object, and the usage when ``stream_options`` asks for it.

    Example:
        >>> return chat.stream(started, ChatEvents(chat, started, body, "chatcmpl-1"))  # doctest: +SKIP
    """

    done = True

    def __init__(self, serving: ChatServing, started: Started, body: ChatCompletionRequest, completion_id: str):
        self.serving, self.started, self.body, self.completion_id = serving, started, body, completion_id

    def _chunk(self, delta: Delta, finish=None, logprobs=None, **extra) -> str:
        chunk = ChatCompletionChunk(id=self.completion_id, model=self.serving.model_name,
                                    choices=[ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)],
                                    **extra)
        return sse_data(chunk.model_dump(exclude_none=True))

    def opening(self) -> list[str]:
        return [self._chunk(Delta(role="assistant", content=""))]

    def deltas(self, content: str, calls: list) -> list[str]:
        out = [self._chunk(Delta(content=content))] if content else []
        for piece in calls:  # tools.CallPiece: the call's id and name first, then its arguments as written
            if piece.id is not None:
                delta = ToolCallDelta(index=piece.index, id=piece.id, type="function",
                                      function=FunctionDelta(name=piece.name, arguments=""))
            elif piece.arguments:
                delta = ToolCallDelta(index=piece.index, function=FunctionDelta(arguments=piece.arguments))
            else:
                continue  # the call's end: nothing more to send
            out.append(self._chunk(Delta(tool_calls=[delta])))
        return out

    async def finished(self, reply) -> list[str]:
        serving, turn, parser = self.serving, self.started.turn, self.started.parser
        await serving.record(turn, reply, parser)
        # Log-probabilities come with the last chunk, all of them: the text streamer's pieces are not tokens.
        out = [self._chunk(Delta(), serving.engine.finish_reason(reply, self.started.max_new, parser),
                           chat_logprobs(serving.engine.pipeline.tokenizer, reply), attnstore=store_info(turn, reply))]
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            out.append(sse_data(ChatCompletionChunk(id=self.completion_id, model=serving.model_name, choices=[],
                                                    usage=usage_of(turn, reply)).model_dump(exclude_none=True)))
        return out

    def failed(self, error: dict) -> list[str]:
        return [sse_data(error)]


def chat_logprobs(tokenizer, reply) -> dict | None:
    """A reply's ``logprobs`` in chat completions' form (each token's text, log-probability, UTF-8 bytes and
    alternatives), or None without them.

    Example:
        >>> chat_logprobs(tokenizer, reply)["content"][0]["token"]  # doctest: +SKIP
        'Hello'
    """
    if reply.logprobs is None:
        return None

    def entry(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    special = set(tokenizer.all_special_ids)  # not in the content either (the end of turn, above all)
    return {"content": [{**entry(token, lp), "top_logprobs": [entry(t, l) for t, l in top]}
                        for token, lp, top in reply.logprobs if token not in special], "refusal": None}
