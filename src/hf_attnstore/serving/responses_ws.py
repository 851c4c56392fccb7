"""The Responses API's WebSocket mode (the Open Responses spec's "WebSocket Transport"): a WebSocket on
``/v1/responses`` takes ``response.create`` messages (a Responses request with ``type`` and without ``stream``,
``stream_options`` or ``background``), one at a time, and answers each with the events a streamed response has,
each one JSON message; a failure is one ``error`` message with its HTTP status (`error_event`).

The connection keeps its most recent response (`responses_api.LocalResponse`, the spec's connection-local state):
a continuation on the connection (``previous_response_id`` of that response, new input only) is rebuilt from it
without a lookup, continues its session (the session's KV stays hot in the store, so the turn prefills only the
new input), and works for ``store: false`` responses, which nothing else keeps. A continuation that fails (4xx or
5xx) evicts the response it named: continuing it again is ``previous_response_not_found`` (unless it is stored).
A connection lasts at most `max_connection_s` (the spec's 60 minutes): then an error
``websocket_connection_limit_reached`` and the connection closes.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from .errors import APIError, validation_message
from .protocol import ResponsesRequest
from .responses_api import LocalResponse, ResponsesServing

CONNECTION_LIMIT_S = 3600.0  # the spec's: "WebSocket connections are limited to 60 minutes"
HTTP_ONLY = ("stream", "stream_options", "background")  # the spec's: MUST NOT be sent on a WebSocket


def error_event(status: int, message: str, code: str, param: str | None = None,
                kind: str = "invalid_request_error") -> str:
    """A WebSocket ``error`` message (the spec's WebSocketErrorEvent), as JSON text.

    Example:
        >>> json.loads(error_event(400, "no", "previous_response_not_found"))["error"]["code"]
        'previous_response_not_found'
    """
    return json.dumps({"type": "error", "status": status,
                       "error": {"type": kind, "code": code, "message": message, "param": param}})


class ResponsesSocket:
    """The handler of WebSocket connections to ``/v1/responses`` (see the module's docstring), over the Responses
    route's handler (`ResponsesServing`: the same checks, turns and events as HTTP).

    Example:
        >>> app.websocket("/v1/responses")(ResponsesSocket(responses))  # doctest: +SKIP
    """

    def __init__(self, responses: ResponsesServing, max_connection_s: float = CONNECTION_LIMIT_S):
        self.responses, self.max_connection_s = responses, max_connection_s

    async def __call__(self, websocket: WebSocket):
        await websocket.accept()
        opened = time.monotonic()
        local = LocalResponse()
        try:
            while True:
                left = self.max_connection_s - (time.monotonic() - opened)
                try:  # the wait for the client's next message ends with the connection's lifetime
                    if left <= 0:
                        raise asyncio.TimeoutError
                    message = await asyncio.wait_for(websocket.receive(), left)
                except asyncio.TimeoutError:
                    await websocket.send_text(error_event(
                        400, f"this connection reached its limit of {self.max_connection_s:g} s: open a new one",
                        "websocket_connection_limit_reached"))
                    await websocket.close()
                    return
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    text = (message.get("bytes") or b"").decode("utf-8", "replace")
                await self.turn(websocket, text, local)
        except (WebSocketDisconnect, OSError):  # uvicorn's ClientDisconnected is an OSError
            return  # the client went away: its turn (if one ran) was cancelled by the stream's loop

    def _failed(self, status: int) -> None:
        self.responses.metrics.errors.labels(str(status)).inc()

    async def turn(self, websocket: WebSocket, text: str, local: LocalResponse) -> None:
        """Answers one client message: a ``response.create`` runs a turn and sends its events; anything else is an
        ``error`` message. A failed continuation evicts the response it named from `local`."""
        limit = self.responses.limits.body_bytes
        if len(text) > limit:
            self._failed(413)
            return await websocket.send_text(error_event(413, f"the message is larger than {limit} bytes",
                                                         "request_too_large"))
        try:
            data = json.loads(text)
        except ValueError as exc:
            self._failed(400)
            return await websocket.send_text(error_event(400, f"the message is not valid JSON ({exc})",
                                                         "invalid_json"))
        if not isinstance(data, dict) or data.get("type") != "response.create":
            self._failed(400)
            return await websocket.send_text(error_event(
                400, 'a message is a JSON object of `type` "response.create" (a Responses request)',
                "invalid_request_error", "type"))
        previous = data.get("previous_response_id")
        previous = previous if isinstance(previous, str) else None
        try:
            for name in HTTP_ONLY:
                if data.get(name) is not None:
                    raise APIError(400, f"`{name}` is not sent over a WebSocket (every response streams its events "
                                   "here): leave it out", param=name)
            try:
                body = ResponsesRequest.model_validate({**data, "stream": True})
            except ValidationError as exc:
                message, param = validation_message(exc.errors())
                raise APIError(400, message, param=param)
            begun = await self.responses.begin(body, websocket, local)
        except APIError as exc:
            local.evict(previous)
            self._failed(exc.status)
            return await websocket.send_text(error_event(exc.status, str(exc), exc.code or exc.kind, exc.param,
                                                         exc.kind))
        events, lines = self.responses.socket_events(begun, local)
        try:
            async for line in lines:
                await websocket.send_text(line)
        finally:
            await lines.aclose()  # a client gone mid-turn: the loop's own cleanup cancels the turn
        if events.status == "failed":
            local.evict(previous)
