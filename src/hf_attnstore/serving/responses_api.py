"""The Responses routes: ``POST /v1/responses`` (streamed events or not), ``GET`` and ``DELETE
/v1/responses/{id}``. A request becomes a chat turn (`responses.chat_request`) run as chat completions run,
and its answer the Responses form: output items (an assistant message, function calls), ``usage`` with
``input_tokens_details.cached_tokens``, and our ``attnstore`` object."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..cache.fingerprint import salted_fingerprint
from .engine import ChatEngine, Remembered
from .handling import APIError, Started, check_model, parse_whole, start_turn, store_info, wait_reply
from .metrics import ServerMetrics
from .protocol import ChatMessage, RequestLimits, echo_problem, error_body
from .responses import ResponsesRequest, ResponseStore, StoredResponse, chat_request, ids_array, new_response_id
from .tools import ReplyParser, message_call_key


def add_responses_routes(app: FastAPI, engine: ChatEngine, metrics: ServerMetrics, responses: ResponseStore,
                         model_name: str, limits: RequestLimits, default_max_tokens: int, timeout_s: float) -> None:
    """Adds the Responses routes to `app` (see the module's docstring)."""

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        check_model(body.model, model_name)
        missing = body.unsupported()
        if missing:
            raise APIError(400, f"{missing[1]} is not supported by this server", param=missing[0])
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
            history, session = await asyncio.to_thread(_history, engine, responses, body.previous_response_id, scope,
                                                       limits)
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
            started = await start_turn(engine, chat, request, limits, model_name, default_max_tokens, timeout_s,
                                       session)
        except APIError as exc:
            exc.param = _responses_param(exc.param)
            raise
        response_id = new_response_id()
        if body.stream:
            return StreamingResponse(_events(engine, metrics, responses, started, body, response_id, model_name,
                                             scope, timeout_s),
                                     media_type="text/event-stream",
                                     headers={"X-Session-ID": started.turn.session_id, "Cache-Control": "no-cache"})
        reply = await wait_reply(started.future, request, started.cancel, timeout_s, param="input")
        if reply is None:
            metrics.cancelled.inc()
            return Response(status_code=499)
        if started.parser is not None:
            parse_whole(engine, started.parser, reply)
        result = await _finish(engine, metrics, responses, started, reply, body, response_id, model_name, scope)
        return JSONResponse(result, headers={"X-Session-ID": started.turn.session_id})

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        record = await asyncio.to_thread(responses.get, response_id)
        if record is None:
            raise _not_found(response_id)
        return record.body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not await asyncio.to_thread(responses.delete, response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response has the id {response_id[:100]!r} (it was never stored, was deleted "
                    "or is older than the server keeps)", code="not_found")


def _responses_param(param: str | None) -> str | None:
    """A chat field at fault, as the Responses request names it."""
    if param is None:
        return None
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


def _output_items(parser: ReplyParser | None, text: str) -> tuple[list[dict], dict]:
    """The response's output items and the reply as a chat message (what the chain keeps)."""
    content = parser.message_content if parser is not None else text
    calls = parser.calls if parser is not None else []
    items = []
    if content is not None or not calls:
        items.append(_message_item(f"msg_{uuid.uuid4().hex}", content or "", "completed"))
    for call in calls:
        items.append(_call_item(call, "completed"))
    message = ChatMessage(role="assistant", content=content, tool_calls=[c.model_dump() for c in calls] or None)
    return items, message.model_dump(exclude_none=True)


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(call, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.function.name, "arguments": call.function.arguments, "status": status}


def _response_object(body: ResponsesRequest, response_id: str, model_name: str, status: str, output: list[dict],
                     usage: dict | None = None, incomplete: str | None = None, info: dict | None = None) -> dict:
    out = {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model_name,
           "status": status, "error": None,
           "incomplete_details": {"reason": incomplete} if incomplete else None,
           "instructions": body.instructions, "output": output, "previous_response_id": body.previous_response_id,
           "parallel_tool_calls": body.parallel_tool_calls is not False, "store": body.store,
           "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
           "tools": body.tools or [], "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
           "text": {"format": (body.text or {}).get("format") or {"type": "text"}}, "truncation": "auto", "user": body.user, "usage": usage}
    if info is not None:
        out["attnstore"] = info
    return out


async def _finish(engine: ChatEngine, metrics: ServerMetrics, responses: ResponseStore, started: Started, reply,
                  body: ResponsesRequest, response_id: str, model_name: str, scope: str,
                  streamed: list[dict] | None = None) -> dict:
    """The finished response: recorded (memo, index, metrics), stored when asked (off the event loop: a file
    is written), as the response object."""
    turn, parser = started.turn, started.parser
    remembered = engine.finish(turn, reply, parser)
    metrics.observe(reply)
    items, message = _output_items(parser, reply.text)
    items = streamed or items
    length = engine.finish_reason(reply, started.max_new, parser) == "length"
    usage = {"input_tokens": len(turn.client_ids),
             "input_tokens_details": {"cached_tokens": reply.reused_tokens},
             "output_tokens": reply.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": len(turn.client_ids) + reply.generated_tokens}
    result = _response_object(body, response_id, model_name, "incomplete" if length else "completed", items, usage,
                              "max_output_tokens" if length else None, store_info(turn, reply).model_dump())
    if body.store and remembered is not None:
        new = [m.model_dump(exclude_none=True) for m in body.input_messages()]
        point = engine.session_point(turn.session_id, scope) or ""
        client, model = engine.session_ids(turn.session_id, scope) or ([], [])
        record = StoredResponse(response_id, scope, turn.session_id, point, ids_array(client), ids_array(model),
                                body.previous_response_id, new, message, remembered.text, list(remembered.ids),
                                remembered.calls_key is not None, result)
        await asyncio.to_thread(responses.put, record)
    return result


async def _events(engine: ChatEngine, metrics: ServerMetrics, responses: ResponseStore, started: Started,
                  body: ResponsesRequest, response_id: str, model_name: str, scope: str, timeout_s: float):
    """The streamed events of a response, as OpenAI sends them: created, in progress, each output item added,
    its text deltas (or a call's arguments) and done, then completed (or failed)."""
    sequence = 0
    output: list[dict] = []  # items done so far
    open_message: dict | None = None  # the message item text is being streamed into

    def event(kind: str, **data) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence - 1, **data})}\n\n"

    def close_message() -> list[str]:
        nonlocal open_message
        if open_message is None:
            return []
        item, index = open_message, len(output)
        text = item["text"]
        done = _message_item(item["id"], text, "completed")
        part = done["content"][0]
        open_message = None
        output.append(done)
        return [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=text, logprobs=[]),
                event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part),
                event("response.output_item.done", output_index=index, item=done)]

    def deltas(text: str, calls: list) -> list[str]:
        nonlocal open_message
        lines = []
        if text:
            if open_message is None:
                open_message = {"id": f"msg_{uuid.uuid4().hex}", "text": ""}
                index = len(output)
                lines += [event("response.output_item.added", output_index=index,
                                item=_message_item(open_message["id"], "", "in_progress")),
                          event("response.content_part.added", item_id=open_message["id"], output_index=index,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
            open_message["text"] += text
            lines.append(event("response.output_text.delta", item_id=open_message["id"], output_index=len(output),
                               content_index=0, delta=text, logprobs=[]))
        for call in calls:
            lines += close_message()
            index, done = len(output), _call_item(call, "completed")
            lines += [event("response.output_item.added", output_index=index,
                            item={**_call_item(call, "in_progress"), "arguments": ""}),
                      event("response.function_call_arguments.delta", item_id=done["id"], output_index=index,
                            delta=call.function.arguments),
                      event("response.function_call_arguments.done", item_id=done["id"], output_index=index,
                            arguments=call.function.arguments),
                      event("response.output_item.done", output_index=index, item=done)]
            output.append(done)
        return lines

    parser = started.parser
    finished = timed_out = False
    try:
        shell = _response_object(body, response_id, model_name, "in_progress", [])
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        try:
            async for text in started.streamer:
                if text:
                    for line in deltas(*parser.feed(text)) if parser is not None else deltas(text, []):
                        yield line
        except asyncio.TimeoutError:  # cut: the response fails below (nothing is stored)
            started.cancel.set()
            timed_out = True
        if parser is not None:
            for line in deltas(*parser.finish()):
                yield line
        try:
            reply = await asyncio.wait_for(asyncio.wrap_future(started.future), timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported in the stream: the status line is long gone
            client = isinstance(exc, ValueError)
            metrics.errors.labels("400" if client else "500").inc()
            error = error_body(f"the turn failed: {exc}", "invalid_request_error" if client else "server_error")
            yield event("response.failed", response={**shell, "status": "failed", "error": error["error"]})
            finished = True
            return
        if timed_out:
            engine.finish(started.turn, reply, parser)  # the index learns where the session stands
            metrics.errors.labels("504").inc()
            error = error_body(f"the turn did not finish within {timeout_s} s", "server_error", code="timeout")
            yield event("response.failed", response={**shell, "status": "failed", "error": error["error"]})
            finished = True
            return
        for line in close_message():
            yield line
        if parser is not None and parser.failed:
            parser.content, parser.calls = reply.text, []  # as the whole-reply path: all content
        # The streamed items (and their ids) are what the client saw: the stored response is them.
        result = await _finish(engine, metrics, responses, started, reply, body, response_id, model_name, scope,
                               output)
        kind = "response.incomplete" if result["status"] == "incomplete" else "response.completed"
        yield event(kind, response=result)
        finished = True
    finally:
        if not finished:
            started.cancel.set()  # the client went away mid-stream: stop the turn
            metrics.cancelled.inc()
