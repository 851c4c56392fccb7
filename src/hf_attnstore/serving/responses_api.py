"""The Responses routes: ``POST /v1/responses`` (streamed events or not), ``GET`` and ``DELETE
/v1/responses/{id}``; what differs from the other routes (base.py has the rest). A request becomes a chat turn
(`protocol.chat_request`) run as chat completions run (`ChatServing.start_turn`), and its answer the Responses
form: output items (an assistant message, function calls), ``usage`` with ``input_tokens_details.cached_tokens``,
and our ``attnstore`` object; a stored response is what ``previous_response_id`` chains from
(response_store.py)."""

from __future__ import annotations

import asyncio
import json
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ..cache.fingerprint import salted_fingerprint
from .base import OpenAIServing, Started, store_info
from .chat_api import ChatServing
from .engine import ChatEngine, Remembered
from .errors import APIError
from .protocol import (ChatMessage, FunctionCallItem, FunctionCallOutputItem, RequestLimits, ResponsesRequest,
                       call_item, chat_request, echo_problem, message_item, output_items, response_object)
from .protocol.common import tools_text_problem
from .response_store import ResponseStore, StoredResponse, ids_array, new_response_id
from .tools import message_call_key


class ResponsesServing(OpenAIServing):
    """The Responses routes over the shared base (`OpenAIServing`); a request's turn is started as a chat turn
    (`chat`, the chat-completions route's handler).

    Example:
        >>> responses = ResponsesServing(chat, ResponseStore())  # doctest: +SKIP
        >>> app.post("/v1/responses")(responses.create)  # doctest: +SKIP
    """

    def __init__(self, chat: ChatServing, responses: ResponseStore):
        super().__init__(chat.engine, chat.metrics, chat.model_name, chat.limits, chat.timeout_s,
                         chat.default_max_tokens)
        self.chat, self.responses = chat, responses

    async def create(self, body: ResponsesRequest, request: Request):
        """Answers one Responses request (the route's handler)."""
        self.check_request(body)
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
        try:
            # The chat request is checked for its sizes only: its model and fields are this request's, checked above.
            started = await self.chat.start_turn(chat, request, session)
        except APIError as exc:
            exc.param = _responses_param(exc.param)
            raise
        response_id = new_response_id()
        if body.stream:
            return self.stream(started, ResponseEvents(self, started, body, response_id, scope))
        reply = await self.wait(started, request, param="input")
        if reply is None:
            return self.gone()
        if started.parser is not None:
            self.parse_whole(started.parser, reply, started.max_new)
        result = await self.finish(started, reply, body, response_id, scope)
        return JSONResponse(result, headers={"X-Session-ID": started.turn.session_id})

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

    async def finish(self, started: Started, reply, body: ResponsesRequest, response_id: str, scope: str,
                     streamed: list[dict] | None = None) -> dict:
        """The finished response: recorded (memo, index, metrics), stored when asked (off the event loop: a file
        is written), as the response object (its output `streamed`, when it was: the items the client saw)."""
        turn, parser = started.turn, started.parser
        remembered = await self.record(turn, reply, parser)
        items, message = output_items(parser.message_content if parser is not None else reply.text,
                                      parser.calls if parser is not None else [])
        items = streamed or items
        length = self.engine.finish_reason(reply, started.max_new, parser) == "length"
        usage = {"input_tokens": len(turn.client_ids),
                 "input_tokens_details": {"cached_tokens": reply.reused_tokens},
                 "output_tokens": reply.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": len(turn.client_ids) + reply.generated_tokens}
        result = response_object(body, response_id, self.model_name, "incomplete" if length else "completed", items,
                                 usage, "max_output_tokens" if length else None, store_info(turn, reply).model_dump())
        if body.store and remembered is not None:
            new = [m.model_dump(exclude_none=True) for m in body.input_messages()]

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


class ResponseEvents:
    """A response's streamed events (`base.StreamEvents`), as OpenAI sends them: created, in progress, each output
    item added, its text deltas (or a call's arguments) and done, then completed, incomplete or failed. No
    ``data: [DONE]``: the last event says the stream is over.

    Example:
        >>> return responses.stream(started, ResponseEvents(responses, started, body, "resp_1", ""))  # doctest: +SKIP
    """

    done = False

    def __init__(self, serving: ResponsesServing, started: Started, body: ResponsesRequest, response_id: str,
                 scope: str):
        self.serving, self.started, self.body, self.response_id, self.scope = \
            serving, started, body, response_id, scope
        self.sequence = 0
        self.output: list[dict] = []  # items done so far
        self.open_message: dict | None = None  # the message item text is being streamed into
        self.open_calls: dict[int, tuple[int, str]] = {}  # a call being streamed: its output index and item id
        self.shell = response_object(body, response_id, serving.model_name, "in_progress", [])

    def _event(self, kind: str, **data) -> str:
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.sequence - 1, **data})}\n\n"

    def _close_message(self) -> list[str]:
        if self.open_message is None:
            return []
        item, index = self.open_message, len(self.output)
        text = item["text"]
        done = message_item(item["id"], text, "completed")
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
        lines = self._close_message()
        parser = self.started.parser
        if parser is not None and parser.failed:
            parser.content, parser.calls = reply.text, []  # as the whole-reply path: all content
        # The streamed items (and their ids) are what the client saw: the stored response is them.
        result = await self.serving.finish(self.started, reply, self.body, self.response_id, self.scope, self.output)
        kind = "response.incomplete" if result["status"] == "incomplete" else "response.completed"
        return lines + [self._event(kind, response=result)]

    def failed(self, error: dict) -> list[str]:
        # Nothing is stored: a failed response cannot be continued.
        return [self._event("response.failed", response={**self.shell, "status": "failed", "error": error["error"]})]


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
