"""Every OpenAI route goes through the shared base (serving/base.py): the same model check, unsupported-field
check and admission, once per request, with the same OpenAI-style error objects and statuses."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from hf_attnstore import AttnStore
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.serving.base import OpenAIServing
from hf_attnstore.serving.pipeline import ChatPipeline

from ..conftest import char_tokenizer, make_tiny

# One request per route that the server runs, and one field each that it refuses.
ROUTES = {
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0},
                             {"functions": [{"name": "f"}]}, "functions"),
    "/v1/completions": ({"prompt": "hi", "max_tokens": 2, "temperature": 0}, {"suffix": "!"}, "suffix"),
    "/v1/responses": ({"input": "hi", "max_output_tokens": 2, "temperature": 0}, {"background": True},
                      "background"),
}


@pytest.fixture(scope="module")
def server():
    model, tok = make_tiny("llama"), char_tokenizer()
    store = AttnStore("16MiB")
    pipe = ChatPipeline(model, tok, store, max_new_tokens=4)
    engine = ChatEngine(pipe, max_pending=1)
    client = TestClient(create_app(engine, "tiny", default_max_tokens=4, request_timeout_s=20))
    yield client, engine
    pipe.close(timeout=60)
    store.close()


@pytest.fixture
def calls(monkeypatch):
    """How many times each route's request went through the base's checks and admission."""
    counted = {"check_request": 0, "admit": 0}
    for name in counted:
        original = getattr(OpenAIServing, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            counted[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(OpenAIServing, name, spy)
    return counted


@pytest.mark.parametrize("path", ROUTES)
def test_each_route_checks_and_admits_once_through_the_base(server, calls, path):
    client, _ = server
    body, _, _ = ROUTES[path]
    r = client.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    assert calls == {"check_request": 1, "admit": 1}  # once per request: Responses no longer checks twice


def test_a_wrong_model_is_the_same_404_on_every_route(server, calls):
    client, _ = server
    errors = {path: client.post(path, json={"model": "other", **body}) for path, (body, _, _) in ROUTES.items()}
    assert {r.status_code for r in errors.values()} == {404}
    assert len({str(r.json()) for r in errors.values()}) == 1, {p: r.json() for p, r in errors.items()}
    assert next(iter(errors.values())).json()["error"] == {
        "message": "model 'other' is not served here; this server serves 'tiny' (GET /v1/models)",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert calls == {"check_request": 3, "admit": 0}


def test_an_unsupported_field_is_the_same_400_on_every_route(server, calls):
    client, _ = server
    for path, (body, unsupported, field) in ROUTES.items():
        r = client.post(path, json={"model": "tiny", **body, **unsupported})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error" and error["code"] is None
        assert error["message"].endswith(" is not supported by this server"), error
    assert calls == {"check_request": 3, "admit": 0}


def test_a_full_engine_is_the_same_429_on_every_route(server, calls):
    client, engine = server
    engine.admit()  # the engine's one place taken: every route must refuse
    try:
        answers = [client.post(path, json={"model": "tiny", **body}) for path, (body, _, _) in ROUTES.items()]
    finally:
        engine.release()
    for r in answers:
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json() == answers[0].json()
    assert answers[0].json()["error"]["code"] == "overloaded"
    assert answers[0].json()["error"]["type"] == "rate_limit_error"
    assert calls == {"check_request": 3, "admit": 3}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ROUTES)
def test_recording_a_finished_turn_does_not_hold_up_other_requests(server, monkeypatch, path, stream):
    # With replicas, recording a turn writes to the shared Redis; a slow one must not stall the event loop (every
    # other stream, and the /health the router polls). The recording here waits until /health has answered: on
    # the event loop it would wait in vain (/health could not run) and give up after 10 s.
    client, engine = server
    entered, answered = threading.Event(), threading.Event()
    waited_in_vain = []
    original = engine.finish

    def slow_finish(*args, **kwargs):
        entered.set()
        waited_in_vain.append(not answered.wait(10))
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "finish", slow_finish)
    results = []
    with TestClient(client.app) as one_loop:  # one event loop for both requests, as a server has
        worker = threading.Thread(target=lambda: results.append(
            one_loop.post(path, json={"model": "tiny", "stream": stream, **ROUTES[path][0]})))
        worker.start()
        assert entered.wait(30)
        assert one_loop.get("/health").status_code == 200
        answered.set()
        worker.join(30)
    assert waited_in_vain == [False]
    assert results[0].status_code == 200, results[0].text
