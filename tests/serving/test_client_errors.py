"""Client errors are 4xx OpenAI error objects naming the field, and no request can stop the server.

Regression tests for two faults of an adversarial run: a huge `max_tokens` at batch 8 killed the batch
runner (every later request timed out), and bad session ids got 503 "shutting_down" (a NUL: no answer).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hf_attnstore import AttnStore
from hf_attnstore.serving.pipeline import ChatPipeline
from hf_attnstore.serving import ChatEngine, create_app

from ..conftest import char_tokenizer, make_tiny

OK = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "max_tokens": 4}


def make(max_batch_size=8, context_window=None, limits=None, **generate):
    """A server with a short request timeout: a request that hangs fails the test in seconds, not minutes."""
    model, tok = make_tiny("llama"), char_tokenizer()
    store = AttnStore("16MiB")
    pipe = ChatPipeline(model, tok, store, max_new_tokens=8, context_window=context_window,
                        max_batch_size=max_batch_size, **generate)
    extra = {} if limits is None else {"limits": limits}
    app = create_app(ChatEngine(pipe), "tiny", default_max_tokens=8, request_timeout_s=20, **extra)
    return TestClient(app), pipe, store


def limits(**kwargs):
    from hf_attnstore.serving.protocol import RequestLimits

    return RequestLimits(**kwargs)


def close(pipe, store):
    pipe.close(timeout=60)
    store.close()


def post(client, headers=None, content=None, **fields):
    if content is not None:
        return client.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    body = {"model": "tiny", "messages": OK, **GREEDY, **fields}
    return client.post("/v1/chat/completions", json=body, headers=headers or {})


def assert_error(r, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error"), error
    assert error["param"] == param, error
    for w in words:
        assert w in error["message"], (w, error)
    return error


def assert_serving(client):
    r = post(client)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0


# -- fault 2: sizes a client gives ------------------------------------------------------------------------

@pytest.mark.parametrize("huge", [10**12, 2**63])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_huge_max_tokens_gets_400_and_the_batching_server_keeps_serving(huge, field):
    client, pipe, store = make(max_batch_size=8)
    fields = {"max_tokens": None, field: huge}
    r = post(client, **fields)
    error = assert_error(r, 400, field, "context window")
    assert f"at most {pipe.max_reply_tokens}" in error["message"]
    assert_serving(client)  # the batch runner is alive: later requests are answered
    assert pipe._worker.is_alive()
    close(pipe, store)


def test_max_tokens_is_bounded_by_the_context_window():
    client, pipe, store = make(max_batch_size=8, context_window=64)
    from hf_attnstore.serving.protocol import RequestLimits

    limit = pipe.max_reply_tokens
    assert limit == 64 - pipe.truncation.keep_first - 1 == RequestLimits.for_pipeline(pipe).max_tokens
    assert_error(post(client, max_tokens=limit + 1), 400, "max_tokens", "context window", str(limit))
    r = post(client, max_tokens=limit)  # the longest reply the window allows is served
    assert r.status_code == 200, r.text
    close(pipe, store)


def test_a_default_reply_longer_than_the_window_is_refused_at_startup():
    pipe = ChatPipeline(make_tiny("llama"), char_tokenizer(), None, context_window=32)
    with pytest.raises(ValueError, match="default_max_tokens"):
        create_app(ChatEngine(pipe), "tiny", default_max_tokens=64)
    pipe.close(timeout=60)


def test_stop_strings_are_bounded():
    limits_ = limits(max_tokens=100, max_stop_chars=16)
    client, pipe, store = make(limits=limits_)
    assert_error(post(client, stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4")
    assert_error(post(client, stop="x" * 17), 400, "stop", "16 characters")
    assert_error(post(client, stop=["ok", ""]), 400, "stop", "empty")
    r = post(client, content='{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}')
    assert_error(r, 400, "stop", "surrogate")
    assert post(client, stop=["a", "b", "c", "x" * 16]).status_code == 200
    close(pipe, store)


def test_message_count_and_size_are_bounded():
    limits_ = limits(max_tokens=100, max_messages=5, max_request_chars=100)
    client, pipe, store = make(limits=limits_)
    many = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 3 + OK
    assert_error(post(client, messages=many), 400, "messages", "7 messages", "at most 5")
    big = [{"role": "user", "content": "x" * 101}]
    assert_error(post(client, messages=big), 400, "messages", "101 characters", "at most 100")
    parts = [{"role": "user", "content": [{"type": "text", "text": "x" * 60}] * 2}]
    assert_error(post(client, messages=parts), 400, "messages", "120 characters")
    assert post(client, messages=many[-5:]).status_code == 200
    close(pipe, store)


def test_the_default_limits_come_from_the_context_window():
    from hf_attnstore.serving.protocol import RequestLimits

    pipe = ChatPipeline(make_tiny("llama"), char_tokenizer(), None, context_window=100, keep_first=4)
    limits = RequestLimits.for_pipeline(pipe)
    assert limits.max_tokens == 95 and limits.max_request_chars >= 32 * 100 and limits.max_stop == 4
    pipe.close(timeout=60)
    unbounded = ChatPipeline(make_tiny("llama"), char_tokenizer(), None)  # no window: the model's positions
    assert RequestLimits.for_pipeline(unbounded).max_tokens == 512 - 4 - 1
    unbounded.close(timeout=60)


def test_an_oversized_body_gets_413_before_it_is_parsed():
    limits_ = limits(max_tokens=100, max_request_chars=100, max_body_bytes=2000)
    client, pipe, store = make(limits=limits_)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]})
    assert_error(post(client, content=body), 413, "messages", "2000 bytes")
    assert_serving(client)
    close(pipe, store)


# -- fault 4: session ids and bodies ----------------------------------------------------------------------

BAD_IDS = {"long": "x" * 5000, "nul": "a\x00b", "control": "a\nb", "non-ascii": "日本", "padded": " a"}


@pytest.mark.parametrize("kind", sorted(BAD_IDS))
def test_a_bad_user_gets_400_naming_user(kind):
    client, pipe, store = make(max_batch_size=1)
    assert_error(post(client, user=BAD_IDS[kind]), 400, "user", "`user`")
    assert_serving(client)
    close(pipe, store)


def test_a_lone_surrogate_in_user_gets_400_naming_user():
    client, pipe, store = make(max_batch_size=1)
    r = post(client, content='{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "user": "\\ud800"}')
    assert_error(r, 400, "user", "`user`", "surrogate")
    close(pipe, store)


@pytest.mark.parametrize("kind", ["long", "non-ascii", "nul"])
def test_a_bad_session_header_gets_400_naming_it(kind):
    client, pipe, store = make(max_batch_size=1)
    value = BAD_IDS[kind].encode("utf-8")  # a header is bytes (the server reads non-ASCII ones as Latin-1)
    assert_error(post(client, headers={"X-Session-ID": value}), 400, "X-Session-ID", "`X-Session-ID`")
    close(pipe, store)


def test_valid_explicit_session_ids_are_served_and_echoed():
    client, pipe, store = make(max_batch_size=1)
    for sid, headers, fields in (("user-1", {}, {"user": "user-1"}), ("a b~!", {"X-Session-ID": "a b~!"}, {}),
                                 ("h" * 4096, {"X-Session-ID": "h" * 4096}, {"user": "ignored"})):
        r = post(client, headers=headers, **fields)
        assert r.status_code == 200, r.text
        assert r.headers["x-session-id"] == sid and r.json()["attnstore"]["session_id"] == sid
    r = post(client, user="")  # an empty id names no session: one is found or made
    assert r.status_code == 200 and r.json()["attnstore"]["session_id"].startswith("chat-")
    close(pipe, store)


def test_an_invalid_utf8_body_gets_an_openai_error():
    client, pipe, store = make(max_batch_size=1)
    r = post(client, content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}')
    assert_error(r, 400, None, "UTF-8")
    close(pipe, store)


def test_unknown_routes_and_methods_get_openai_errors():
    client, pipe, store = make(max_batch_size=1)
    assert_error(client.get("/v1/nothing"), 404, None, "/v1/nothing")
    assert_error(client.get("/v1/chat/completions"), 405, None, "GET")
    close(pipe, store)


def test_a_server_that_is_shutting_down_answers_503():
    client, pipe, store = make(max_batch_size=8)
    assert_serving(client)
    pipe.close(timeout=60)
    r = post(client)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "shutting_down" and r.json()["error"]["type"] == "server_error"
    assert client.get("/health").json()["pending"] == 0
    store.close()


@pytest.mark.parametrize("batch", [1, 8])
def test_a_reply_stops_where_the_models_positions_end_and_says_length(batch):
    """A prompt near the model's positions (512) and a reply that would run past them: the reply is cut at
    the last position (finish_reason "length"), as vLLM does at max_model_len."""
    client, pipe, store = make(max_batch_size=batch, eos_token_id=None)
    messages = [{"role": "user", "content": "y" * 497}]  # 500 prompt tokens with the template's
    r = post(client, messages=messages, max_tokens=100)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["usage"]["prompt_tokens"] == 500
    assert got["usage"]["completion_tokens"] == 12 and got["choices"][0]["finish_reason"] == "length"
    assert_serving(client)
    close(pipe, store)


def test_a_failure_of_the_server_itself_is_a_500_openai_error(monkeypatch):
    client, pipe, store = make(max_batch_size=1)
    client = TestClient(client.app, raise_server_exceptions=False)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(client.app.state.engine, "prepare", broken)
    assert_error(post(client), 500, None, "RuntimeError")
    close(pipe, store)


def test_over_real_http_a_nul_in_user_gets_a_400_not_a_closed_connection():
    """Through uvicorn (h11 refuses to send a header with a NUL: the connection used to close unanswered)."""
    import http.client
    import threading
    import time

    import uvicorn

    from hf_attnstore.lab.redis_server import free_port

    client, pipe, store = make(max_batch_size=8)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(client.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        def request(body: bytes, headers=None) -> tuple[int, dict]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            status, data = r.status, json.loads(r.read())
            conn.close()
            return status, data

        for body in ({"user": "a\x00b"}, {"user": "日本"}, {"max_tokens": 2**63}):
            status, data = request(json.dumps({"model": "tiny", "messages": OK, **body}).encode())
            assert status == 400 and data["error"]["param"] == next(iter(body)), (body, data)
        status, data = request(b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}]}')
        assert status == 400 and data["error"]["type"] == "invalid_request_error", data
        status, data = request(json.dumps({"model": "tiny", "messages": OK, "max_tokens": 3}).encode())
        assert status == 200 and data["usage"]["completion_tokens"] > 0, data
    finally:
        server.should_exit = True
        thread.join(30)
        close(pipe, store)


@pytest.mark.parametrize("batch", [1, 4])
def test_a_tiny_temperature_or_top_p_samples_instead_of_failing(batch):
    """A temperature below float32's range divided the logits into NaN (500 at batch 1), a top_p below it kept
    no token (500 when batched): both are clamped (temperature to 1e-5, top_p keeps the likeliest token)."""
    client, pipe, store = make(max_batch_size=batch)
    for fields in ({"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1, "top_p": 1e-300}):
        r = post(client, **fields)
        assert r.status_code == 200, (fields, r.text)
    close(pipe, store)
