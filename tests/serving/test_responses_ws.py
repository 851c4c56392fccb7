"""The Responses API's WebSocket mode, with a real client (the `websockets` package) against the app under uvicorn
on a loopback port: the streamed events as JSON messages, several turns on one connection, a `store: false`
continuation on the connection that reuses the session's KV, what a reconnect and a failed continuation do to
the connection's state, errors as the spec's error envelope, and the connection's time limit."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from websockets.sync.client import connect

from .test_responses import Server
from .test_responses_spec import REQUIRED

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


@pytest.fixture
def server():
    srv = Server()
    yield srv
    srv.close()


@contextmanager
def listening(app):
    """`app` under uvicorn on a free loopback port, in a thread: the address of its WebSocket route."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws="auto", lifespan="off")
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not served.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = served.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"ws://127.0.0.1:{port}/v1/responses"
    finally:
        served.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def socket(server):
    with listening(server.http.app) as url:  # the same app the fixture's HTTP client reaches
        yield url


def turn(ws, **body) -> list[dict]:
    """Sends one ``response.create`` and reads its events up to the terminal one (or an error)."""
    ws.send(json.dumps({"type": "response.create", "model": "tiny", **body}))
    events = []
    while True:
        events.append(json.loads(ws.recv(timeout=120)))
        if events[-1]["type"] in TERMINAL:
            return events


def test_a_response_over_a_websocket_is_the_streamed_events_as_json_messages(server, socket):
    server.answer("hello")
    with connect(socket, open_timeout=30) as ws:
        events = turn(ws, input=[{"type": "message", "role": "user", "content": "Count to 3."}])
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert text == final["output"][0]["content"][0]["text"] == "hello"
    assert REQUIRED <= set(final) and final["created_at"] == events[0]["response"]["created_at"]


def test_turns_on_one_connection_run_one_after_another(server, socket):
    server.answer("one")
    with connect(socket, open_timeout=30) as ws:
        # Both sent before either is answered: the second is served after the first, never interleaved.
        ws.send(json.dumps({"type": "response.create", "model": "tiny", "store": False, "input": "first"}))
        ws.send(json.dumps({"type": "response.create", "model": "tiny", "store": False, "input": "second"}))
        events = []
        while sum(e["type"] == "response.completed" for e in events) < 2:
            events.append(json.loads(ws.recv(timeout=120)))
    ends = [i for i, e in enumerate(events) if e["type"] == "response.completed"]
    first, second = events[:ends[0] + 1], events[ends[0] + 1:]
    assert first[0]["type"] == second[0]["type"] == "response.created"
    assert first[0]["response"]["id"] != second[0]["response"]["id"]
    assert all(e["sequence_number"] == i for part in (first, second) for i, e in enumerate(part))


def test_a_store_false_continuation_on_the_connection_reuses_the_session(server, socket):
    server.answer("OK")
    with connect(socket, open_timeout=30) as ws:
        first = turn(ws, store=False, input="Remember cobalt.")[-1]["response"]
        server.answer("cobalt")
        second = turn(ws, store=False, previous_response_id=first["id"], input="The word?")[-1]["response"]
    assert second["status"] == "completed" and second["previous_response_id"] == first["id"]
    # The whole first turn (its prompt and reply) came from the store: only the new input was prefilled.
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["total_tokens"] - 1
    assert second["attnstore"]["session_id"] == first["attnstore"]["session_id"]
    # Nothing was stored: over HTTP the response is unknown.
    assert server.http.get(f"/v1/responses/{first['id']}").status_code == 404


def test_a_store_false_response_cannot_be_continued_after_a_reconnect(server, socket):
    server.answer("OK")
    with connect(socket, open_timeout=30) as ws:
        first = turn(ws, store=False, input="Remember copper.")[-1]["response"]
    with connect(socket, open_timeout=30) as ws:
        error = turn(ws, store=False, previous_response_id=first["id"], input="The word?")[-1]
        assert (error["type"], error["status"]) == ("error", 400)
        assert (error["error"]["code"], error["error"]["param"]) == ("previous_response_not_found",
                                                                     "previous_response_id")
        recovered = turn(ws, store=False, input="Start again.")[-1]  # the connection serves on
    assert recovered["type"] == "response.completed"


def test_a_stored_response_continues_on_another_connection(server, socket):
    server.answer("OK")
    with connect(socket, open_timeout=30) as ws:
        first = turn(ws, input="Remember iron.")[-1]["response"]
    with connect(socket, open_timeout=30) as ws:
        second = turn(ws, previous_response_id=first["id"], input="The word?")[-1]["response"]
    assert second["status"] == "completed"
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["total_tokens"] - 1


def test_a_failed_continuation_evicts_the_response_it_named(server, socket):
    server.answer("OK")
    with connect(socket, open_timeout=30) as ws:
        first = turn(ws, store=False, input="Remember ember.")[-1]["response"]
        failed = turn(ws, store=False, previous_response_id=first["id"], input=[
            {"type": "function_call_output", "call_id": "call_missing", "output": "no such call"}])[-1]
        assert (failed["type"], failed["status"], failed["error"]["param"]) == ("error", 400, "input")
        retry = turn(ws, store=False, previous_response_id=first["id"], input="Go on.")[-1]
    assert retry["type"] == "error" and retry["error"]["code"] == "previous_response_not_found"


def test_http_only_fields_and_bad_messages_are_error_events_and_the_connection_serves_on(server, socket):
    server.answer("OK")
    with connect(socket, open_timeout=30) as ws:
        for body, param in (({"stream": True}, "stream"), ({"background": False}, "background"),
                            ({"model": "other"}, "model"), ({"temperature": "hot"}, "temperature")):
            error = turn(ws, input="hi", **body)[-1]
            assert error["type"] == "error" and error["error"]["param"] == param, error
            assert 400 <= error["status"] < 500 and isinstance(error["error"]["code"], str)
        ws.send("not json")
        assert json.loads(ws.recv(timeout=60))["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"type": "response.cancel"}))
        assert json.loads(ws.recv(timeout=60))["error"]["param"] == "type"
        assert turn(ws, input="hi")[-1]["type"] == "response.completed"


def test_a_connection_past_its_time_limit_gets_the_limit_error_and_is_closed(server, socket):
    server.http.app.state.responses_socket.max_connection_s = 0  # every connection is already past it
    with connect(socket, open_timeout=30) as ws:
        error = json.loads(ws.recv(timeout=60))
        assert error["type"] == "error" and error["error"]["code"] == "websocket_connection_limit_reached"
        with pytest.raises(Exception):
            ws.recv(timeout=60)  # closed by the server
