"""The Responses routes: ``POST /v1/responses`` (streamed events or not), ``GET`` and ``DELETE
/v1/responses/{id}``; what differs from the other routes (base.py has the rest). A request becomes a chat turn
(`protocol.chat_request`) run as chat completions run (`ChatServing.start_turn`), and its answer the Responses
form: output items (an assistant message, function calls), ``usage`` with ``input_tokens_details.cached_tokens``,
and our ``attnstore`` object; a stored response is what ``previous_response_id`` chains from
(response_store.py)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ..cache.fingerprint import salted_fingerprint
from .base import OpenAIServing, Started, store_info
from .chat_api import ChatServing
from .engine import ChatEngine, Remembered
from .errors import APIError
from .protocol import (ChatMessage, CompactRequest, FunctionCallItem, FunctionCallOutputItem, RequestLimits,
                       ResponsesRequest, call_item, chat_request, compaction_content, echo_problem, message_item,
                       output_items, response_object)
from .protocol.common import tools_text_problem
from .response_store import ResponseStore, StoredResponse, ids_array, new_response_id
from .tools import message_call_key


# The compaction turn's last message: what the model is asked to write into the compaction item.
COMPACT_PROMPT = ("Summarize the conversation so far for its continuation: keep every fact, name, number, decision "
                  "and open question, briefly. Write only the summary.")


class ResponsesServing(OpenAIServing):
    """The Responses routes over the shared base (`OpenAIServing`); a request's turn is started as a chat turn
    (`chat`, the chat-completions route's handler).

    Example:
        >>> responses = ResponsesServing(chat, ResponseStore())  # doctest: +SKIP
        >>> app.post("/v1/responses")(responses.create)  # doctest: +SKIP
    """

    def __init__(self, chat: ChatServing, responses: ResponseStore):
        super().__init__(chat.engine, chat.metrics, chat.model_name, chat.limits, chat.timeout_s,
                         chat.default_max_tokens, chat.sampling)
        self.chat, self.responses = chat, responses

    async def create(self, body: ResponsesRequest, request: Request):
        """Answers one Responses request (the route's handler)."""
        begun = await self.begin(body, request)
        if body.stream:
            return self.stream(begun.started, ResponseEvents(self, begun))
        reply = await self.wait(begun.started, request, param="input")
        if reply is None:
            return self.gone()
        if begun.started.parser is not None:
            self.parse_whole(begun.started.parser, reply, begun.started.max_new)
        result = await self.finish(begun, reply)
        return JSONResponse(result, headers={"X-Session-ID": begun.started.turn.session_id})

    async def begin(self, body: ResponsesRequest, request, local: "LocalResponse | None" = None,
                    fresh: bool = False) -> "Begun":
        """Checks a request, rebuilds the conversation it continues (from `local`, a WebSocket connection's most
        recent response, when it is the one named; else from the stored responses) and queues its turn: what
        answering it needs (`Begun`). `request` is the HTTP request or the WebSocket (its headers are read).
        `fresh`: the turn runs on a new session of its own (it still reuses the longest stored prefix).

        Raises:
            APIError: 4xx for the client's mistakes (naming the field), 429 and 503 as every route.
        """
        created_at = int(time.time())  # fixed here: every event of the response and its stored copy carry it
        self.check_request(body)
        body = self.sampling.fill(body)  # the server's defaults for what the request leaves out (and echoed)
        text = tools_text_problem(body.tools, nested=False)  # before the echo check: it names the field
        if text is not None:
            raise APIError(400, text[1], param=text[0])
        for name in ("metadata", "tools", "text", "tool_choice", "instructions"):  # echoed in the response
            problem = echo_problem(name, getattr(body, name))
            if problem is not None:
                raise APIError(400, problem, param=name)
        try:
            scope = salted_fingerprint("", body.cache_salt) if body.cache_salt is not None else ""
        except ValueError as exc:
            raise APIError(400, str(exc), param="cache_salt")
        history: list[dict] = []
        session = None
        if body.previous_response_id is not None:
            if local is not None and local.response_id == body.previous_response_id and local.scope == scope:
                history = local.history  # the connection's own: no lookup, and `store: false` continues too
                point = await asyncio.to_thread(self.engine.session_point, local.session_id, scope)
                session = local.session_id if point in (None, local.point) else None
            else:
                history, session = await asyncio.to_thread(_history, self.engine, self.responses,
                                                           body.previous_response_id, scope, self.limits)
        unanswered = _unanswered_output(body, history)
        if unanswered is not None:  # OpenAI's rule and message
            raise APIError(400, f"No tool call found for function call output with call_id {unanswered[:100]!r}: a "
                           "`function_call_output` answers a `function_call` earlier in `input` or in the chain of "
                           "`previous_response_id`", param="input")
        try:
            chat = chat_request(body, history)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise APIError(400, f"invalid request: {where}: {first.get('msg')}".replace("Value error, ", ""),
                           param="input")
        except ValueError as exc:
            raise APIError(400, str(exc), param="tools" if str(exc).startswith("tools.") else "input")
        window = self.engine.pipeline.truncation.context_window

        def fits(turn, max_new: int) -> None:  # `truncation: "disabled"` (OpenAI's default): nothing is dropped
            if body.truncation != "auto" and window is not None and len(turn.client_ids) + max_new > window:
                raise APIError(400, f"the conversation ({len(turn.client_ids)} tokens) and its reply (up to "
                               f"{max_new}) do not fit the context window ({window} tokens), and `truncation` is "
                               '"disabled": send `truncation: "auto"` to drop the oldest tokens instead, or a shorter '
                               "`input` or `max_output_tokens`", param="input", code="context_length_exceeded")

        if fresh:
            session = f"compact-{uuid.uuid4().hex}"
        try:
            # The chat request is checked for its sizes only: its model and fields are this request's, checked above.
            started = await self.chat.start_turn(chat, request, session, check=fits)
        except APIError as exc:
            exc.param = _responses_param(exc.param)
            raise
        return Begun(started, body, new_response_id(), scope, created_at, history)

    async def compact(self, body: CompactRequest, request: Request):
        """``POST /v1/responses/compact``: the conversation (`body`'s input after the chain it names) as a compacted
        window: its user messages as they were, then one ``compaction`` item holding a summary of the rest, which
        the model writes (greedily, at most the server's default reply length) on a session of its own. Nothing is
        stored and no session moves: the compacted window, sent back as a new chain's ``input``, starts a new
        session, which reuses the longest stored prefix it shares; the conversation's own session stays as it
        was, reusable by a client that goes on with the whole conversation."""
        self.check_request(body)
        if body.input is None and body.previous_response_id is None:
            raise APIError(400, "nothing to compact: send `input`, or `previous_response_id`", param="input")
        if isinstance(body.input, list) and not body.input:
            raise APIError(400, "`input` is empty: send the conversation to compact", param="input")
        # Greedy; a conversation over the context window is summarized from what fits (the server's truncation).
        summarize = body.as_request(COMPACT_PROMPT, temperature=0.0, truncation="auto")
        begun = await self.begin(summarize, request, fresh=True)
        reply = await self.wait(begun.started, request, param="input")
        if reply is None:
            return self.gone()
        turn = begun.started.turn
        await self.record(turn, reply)
        conversation = [*begun.history, *(m.model_dump(exclude_none=True) for m in summarize.input_messages()[:-1])]
        kept = [{"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "user",
                 "content": [{"type": "input_text", "text": ChatMessage.model_validate(m).text() or ""}]}
                for m in conversation if m.get("role") == "user"]
        compaction = {"type": "compaction", "id": f"cmp_{uuid.uuid4().hex}",
                      "encrypted_content": compaction_content(reply.text.strip())}
        usage = {"input_tokens": len(turn.client_ids), "input_tokens_details": {"cached_tokens": reply.reused_tokens},
                 "output_tokens": reply.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": len(turn.client_ids) + reply.generated_tokens}
        return JSONResponse({"id": f"cmp_{uuid.uuid4().hex}", "object": "response.compaction",
                             "created_at": begun.created_at, "output": [*kept, compaction], "usage": usage,
                             "attnstore": store_info(turn, reply).model_dump()},
                            headers={"X-Session-ID": turn.session_id})

    def used(self, body: ResponsesRequest, max_new: int) -> dict:
        """The sampling settings a turn runs with, as the response echoes them: the request's, else the
        pipeline's defaults (greedy unless it samples), and the reply's cap."""
        options = self.engine.pipeline.generate_kwargs
        config = self.engine.pipeline.model.generation_config
        sampling = options.get("do_sample", config.do_sample) if body.temperature is None else body.temperature > 0
        temperature = body.temperature if body.temperature is not None else \
            float(options.get("temperature", config.temperature or 1.0)) if sampling else 0.0
        top_p = body.top_p if body.top_p is not None else \
            float(options.get("top_p", config.top_p or 1.0)) if sampling else 1.0
        return {"temperature": temperature, "top_p": top_p, "max_output_tokens": max_new}

    async def get(self, response_id: str):
        """``GET /v1/responses/{id}``: a stored response."""
        record = await asyncio.to_thread(self.responses.get, response_id)
        if record is None:
            raise _not_found(response_id)
        return record.body

    async def delete(self, response_id: str):
        """``DELETE /v1/responses/{id}``: forgets a stored response."""
        if not await asyncio.to_thread(self.responses.delete, response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def socket_events(self, begun: "Begun", local: "LocalResponse"):
        """A WebSocket turn's events (`ResponseEvents`, each one JSON message) and the loop that makes them (the
        streams' own, `OpenAIServing.stream`'s: timeouts, failures, a client gone)."""
        events = ResponseEvents(self, begun, local, websocket=True)
        return events, self.stream_lines(begun.started, events)

    def shell(self, begun: "Begun", status: str, output: list[dict] | None = None) -> dict:
        """The response object before it is done (``in_progress``, or ``failed``): no usage, no completion."""
        return response_object(begun.body, begun.response_id, self.model_name, status, output or [],
                               created_at=begun.created_at, used=self.used(begun.body, begun.started.max_new))

    async def finish(self, begun: "Begun", reply, streamed: list[dict] | None = None,
                     local: "LocalResponse | None" = None) -> dict:
        """The finished response: recorded (memo, index, metrics), stored when asked (off the event loop: a file
        is written), as the response object (its output `streamed`, when it was: the items the client saw). With
        `local` (a WebSocket connection's), the connection keeps it as its most recent response, stored or not."""
        started, body, response_id, scope = begun.started, begun.body, begun.response_id, begun.scope
        turn, parser = started.turn, started.parser
        remembered = await self.record(turn, reply, parser)
        length = self.engine.finish_reason(reply, started.max_new, parser) == "length"
        items, message = output_items(parser.message_content if parser is not None else reply.text,
                                      parser.calls if parser is not None else [], "incomplete" if length else "completed")
        items = streamed or items
        usage = {"input_tokens": len(turn.client_ids),
                 "input_tokens_details": {"cached_tokens": reply.reused_tokens},
                 "output_tokens": reply.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": len(turn.client_ids) + reply.generated_tokens}
        result = response_object(body, response_id, self.model_name, "incomplete" if length else "completed", items,
                                 usage, "max_output_tokens" if length else None, store_info(turn, reply).model_dump(),
                                 created_at=begun.created_at, used=self.used(body, started.max_new),
                                 completed_at=int(time.time()))
        new = [m.model_dump(exclude_none=True) for m in body.input_messages()]
        if local is not None and remembered is not None:
            point = await asyncio.to_thread(self.engine.session_point, turn.session_id, scope)
            local.keep(response_id, scope, turn.session_id, point or "", [*begun.history, *new, message])
        if body.store and remembered is not None:

            def store():  # off the event loop: the session's ids may come from the shared Redis, the record goes to
                # a file or to Redis
                point = self.engine.session_point(turn.session_id, scope) or ""
                client, model = self.engine.session_ids(turn.session_id, scope) or ([], [])
                self.responses.put(StoredResponse(
                    response_id, scope, turn.session_id, point, ids_array(client), ids_array(model),
                    body.previous_response_id, new, message, remembered.text, list(remembered.ids),
                    remembered.calls_key is not None, result))

            await asyncio.to_thread(store)
        return result


@dataclass
class Begun:
    """A Responses request whose turn is queued: what answering it needs.

    Example:
        >>> begun = await responses.begin(body, request)  # doctest: +SKIP
        >>> begun.started.turn.session_id  # doctest: +SKIP
        'chat-...'
    """

    started: Started
    body: ResponsesRequest
    response_id: str
    scope: str
    created_at: int
    history: list[dict]  # the conversation before this request's input (the chain it continues), as messages


class LocalResponse:
    """A WebSocket connection's most recent response (the spec's connection-local state): the conversation up to
    its reply, as messages, and where its session stood, so that a continuation on the connection needs no
    lookup, and a ``store: false`` response can be continued at all. One at a time: keeping a newer one forgets
    it, and a failed continuation evicts it (`evict`).

    Example:
        >>> local = LocalResponse()
        >>> local.keep("resp_1", "", "chat-1", "p", [{"role": "user", "content": "hi"}])
        >>> local.response_id
        'resp_1'
    """

    def __init__(self):
        self.keep(None, "", "", "", [])

    def keep(self, response_id: str | None, scope: str, session_id: str, point: str, history: list[dict]) -> None:
        self.response_id, self.scope, self.session_id, self.point, self.history = \
            response_id, scope, session_id, point, history

    def evict(self, response_id: str | None) -> None:
        """Forgets the kept response if it is `response_id` (the one a failed continuation named)."""
        if response_id is not None and response_id == self.response_id:
            self.keep(None, "", "", "", [])


class ResponseEvents:
    """A response's streamed events (`base.StreamEvents`), as OpenAI sends them: created, in progress, each output
    item added, its text deltas (or a call's arguments) and done, then completed, incomplete or failed. No
    ``data: [DONE]``: the last event says the stream is over.

    Over a WebSocket (`websocket`), each event is one JSON message instead of an SSE event, and `local` (the
    connection's state) keeps the finished response.

    Example:
        >>> return responses.stream(started, ResponseEvents(responses, begun))  # doctest: +SKIP
    """

    done = False

    def __init__(self, serving: ResponsesServing, begun: Begun, local: LocalResponse | None = None,
                 websocket: bool = False):
        self.serving, self.begun, self.started, self.local, self.websocket = \
            serving, begun, begun.started, local, websocket
        self.sequence = 0
        self.output: list[dict] = []  # items done so far
        self.open_message: dict | None = None  # the message item text is being streamed into
        self.open_calls: dict[int, tuple[int, str]] = {}  # a call being streamed: its output index and item id
        self.shell = serving.shell(begun, "in_progress")
        self.status: str | None = None  # the terminal event's status, once sent

    def _event(self, kind: str, **data) -> str:
        self.sequence += 1
        payload = json.dumps({'type': kind, 'sequence_number': self.sequence - 1, **data})
        return payload if self.websocket else f"event: {kind}\ndata: {payload}\n\n"

    def _close_message(self, status: str = "completed") -> list[str]:
        if self.open_message is None:
            return []
        item, index = self.open_message, len(self.output)
        text = item["text"]
        done = message_item(item["id"], text, status)
        part = done["content"][0]
        self.open_message = None
        self.output.append(done)
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=done)]

    def opening(self) -> list[str]:
        return [self._event("response.created", response=self.shell),
                self._event("response.in_progress", response=self.shell)]

    def deltas(self, content: str, calls: list) -> list[str]:
        lines = []
        if content:
            if self.open_message is None:
                self.open_message = {"id": f"msg_{uuid.uuid4().hex}", "text": ""}
                index = len(self.output)
                lines += [self._event("response.output_item.added", output_index=index,
                                      item=message_item(self.open_message["id"], "", "in_progress")),
                          self._event("response.content_part.added", item_id=self.open_message["id"],
                                      output_index=index, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []})]
            self.open_message["text"] += content
            lines.append(self._event("response.output_text.delta", item_id=self.open_message["id"],
                                     output_index=len(self.output), content_index=0, delta=content, logprobs=[]))
        for piece in calls:  # tools.CallPiece: a call's item opens with its name, its arguments stream, it closes
            if piece.id is not None:
                lines += self._close_message()
                index = len(self.output)
                self.open_calls[piece.index] = (index, f"fc_{piece.id.removeprefix('call_')}")
                lines.append(self._event("response.output_item.added", output_index=index, item={
                    "type": "function_call", "id": self.open_calls[piece.index][1], "call_id": piece.id,
                    "name": piece.name, "arguments": "", "status": "in_progress"}))
            index, item_id = self.open_calls[piece.index]
            if piece.arguments:
                lines.append(self._event("response.function_call_arguments.delta", item_id=item_id,
                                         output_index=index, delta=piece.arguments))
            if piece.done is not None:
                done = call_item(piece.done, "completed")
                lines += [self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                      arguments=piece.done.function.arguments),
                          self._event("response.output_item.done", output_index=index, item=done)]
                self.output.append(done)
                del self.open_calls[piece.index]
        return lines

    async def finished(self, reply) -> list[str]:
        parser = self.started.parser
        length = self.serving.engine.finish_reason(reply, self.started.max_new, parser) == "length"
        lines = self._close_message("incomplete" if length else "completed")  # a cut message is incomplete
        if parser is not None and parser.failed:
            parser.content, parser.calls = reply.text, []  # as the whole-reply path: all content
        # The streamed items (and their ids) are what the client saw: the stored response is them.
        result = await self.serving.finish(self.begun, reply, self.output, self.local)
        self.status = result["status"]
        kind = "response.incomplete" if result["status"] == "incomplete" else "response.completed"
        return lines + [self._event(kind, response=result)]

    def failed(self, error: dict) -> list[str]:
        # Nothing is stored: a failed response cannot be continued. The spec's schema wants the error's code.
        self.status = "failed"
        error = {**error["error"], "code": error["error"].get("code") or error["error"].get("type") or "server_error"}
        return [self._event("response.failed", response={**self.shell, "status": "failed", "error": error})]


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response has the id {response_id[:100]!r} (it was never stored, was deleted "
                    "or is older than the server keeps)", code="not_found")


def _unanswered_output(body: ResponsesRequest, history: list[dict]) -> str | None:
    """The call id of the first ``function_call_output`` of `body`'s input that answers no call before it: a
    ``function_call`` earlier in the input or a call of the chain (`history`, chat messages); None if all do."""
    if isinstance(body.input, str):
        return None
    calls = {call.get("id") for message in history for call in message.get("tool_calls") or ()}
    for item in body.input:
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
            return item.call_id
    return None


def _responses_param(param: str | None) -> str | None:
    """A chat field at fault, as the Responses request names it."""
    if param is None:
        return None
    if param.startswith("tools.") and ".function" in param:  # chat's tools nest the function; Responses' are flat
        head, _, rest = param.partition(".function")
        return head + rest
    for chat, ours in (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                       ("response_format", "text.format")):
        if param == chat or param.startswith(chat + "."):
            return ours
    return param


def _history(engine: ChatEngine, responses: ResponseStore, previous_id: str, scope: str,
             limits: RequestLimits) -> tuple[list[dict], str | None]:
    """The conversation up to `previous_id`'s reply, as chat messages (its replies' exact ids given to the memo
    again: a restart forgot them), and the session to continue: the response's own while it still stands where
    the response left it, or while the index does not know it (after a restart: the store compares the ids, so
    at worst it is a miss); None for a branch from an older response (a new session, which reuses the longest
    stored prefix). A 400 naming ``previous_response_id`` when the chain cannot be rebuilt."""
    record = responses.get(previous_id)
    if record is None or record.scope != scope:  # another salt's response is not shown to exist
        raise APIError(400, f"previous response {previous_id[:100]!r} is not found: it was never stored (store: "
                       "false), was deleted, or is older than the server keeps; send the whole conversation as "
                       "`input` instead", param="previous_response_id", code="previous_response_not_found")
    chain = responses.chain(record, limits.max_messages)
    if chain is not None and any(step.scope != scope for step in chain):
        chain = None  # a step of another salt (a damaged or planted record): never shown, as if it were gone
    vocab = limits.vocab_size
    if chain is not None and vocab is not None and any(
            max(ids, default=0) >= vocab for step in chain for ids in (step.content_ids, step.client_ids, step.model_ids)):
        chain = None  # ids this model cannot have made (a file from elsewhere): never fed to it
    if chain is None:
        raise APIError(400, "a response earlier in this chain is gone (deleted, or older than the server keeps): "
                       "send the whole conversation as `input` instead", param="previous_response_id",
                       code="previous_response_not_found")
    history: list[dict] = []
    for step in chain:
        history += step.input + [step.output]
        key = message_call_key(ChatMessage.model_validate(step.output).as_template_message()) if step.calls else None
        engine.remember(Remembered(step.raw, step.content_ids, key), scope)
    point = engine.session_point(record.session_id, scope)
    if point is None:  # the index forgot the session (a restart): where the response left it
        engine.restore_session(record.session_id, list(record.client_ids), list(record.model_ids), scope)
    return history, record.session_id if point in (None, record.point) else None
