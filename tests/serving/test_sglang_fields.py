"""What sglang-router (0.3.2) forwards to a worker, answered as the client meant it: SGLang's extensions at their
defaults are no-ops (the same reply as without them), a value that would change the answer is a 400 naming the
field, ``top_k: -1`` is "disabled", and the worker's model is discoverable at SGLang's info endpoints. The bodies
below are the ones the real router sent to a capturing worker (docs/remote.md, "Behind sglang-router")."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hf_attnstore import AttnStore
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.serving.pipeline import ChatPipeline

from ..conftest import char_tokenizer, make_tiny

# Added by the router to every chat request (at these values), and to every Responses request.
CHAT_EXTRAS = {"logprobs": False, "stream": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False}
RESPONSES_EXTRAS = {"store": True, "stream": None, "user": "u1", "priority": 0, "top_k": -1, "min_p": 0.0,
                    "repetition_penalty": 1.0, "top_p": 1.0}
CHANGES_THE_ANSWER = {"min_p": 0.1, "repetition_penalty": 1.3, "ignore_eos": True, "no_stop_trim": True,
                      "continue_final_message": True, "skip_special_tokens": False, "return_hidden_states": True}
ROUTES = {
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
                                      "max_completion_tokens": 6, "temperature": 0}),
    "completions": ("/v1/completions", {"model": "tiny", "prompt": "hello there", "max_tokens": 6, "temperature": 0}),
    "responses": ("/v1/responses", {"model": "tiny", "input": "hello there", "max_output_tokens": 6,
                                    "temperature": 0}),
}


@pytest.fixture(scope="module")
def client():
    store = AttnStore("16MiB")
    pipe = ChatPipeline(make_tiny("llama"), char_tokenizer(), store, max_new_tokens=6)
    with TestClient(create_app(ChatEngine(pipe), "tiny", default_max_tokens=6)) as http:
        yield http
    pipe.close(timeout=60)
    store.close()


def text_of(route: str, body: dict) -> str:
    if route == "chat":
        return body["choices"][0]["message"]["content"]
    if route == "completions":
        return body["choices"][0]["text"]
    return body["output"][0]["content"][0]["text"]


def post(client, route: str, extra: dict, status: int = 200) -> dict:
    path, body = ROUTES[route]
    r = client.post(path, json={**body, **extra})
    assert r.status_code == status, r.text
    return r.json()


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_what_the_router_adds_is_a_no_op(client, route):
    plain = text_of(route, post(client, route, {}))
    extras = CHAT_EXTRAS if route == "chat" else RESPONSES_EXTRAS
    assert text_of(route, post(client, route, extras)) == plain


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("extra", [{"separate_reasoning": False}, {"stream_reasoning": False}, {"priority": 7},
                                   {"top_k": -1}], ids=lambda e: next(iter(e)))
def test_fields_that_never_change_the_answer_here_are_accepted_at_any_value(client, route, extra):
    assert text_of(route, post(client, route, extra)) == text_of(route, post(client, route, {}))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field", CHANGES_THE_ANSWER)
def test_a_value_that_would_change_the_answer_is_refused_by_name(client, route, field):
    error = post(client, route, {field: CHANGES_THE_ANSWER[field]}, status=400)["error"]
    assert error["param"] == field and f"`{field}` other than" in error["message"], error


@pytest.mark.parametrize("route", ROUTES)
def test_types_are_openais_no_coercion(client, route):
    assert post(client, route, {"ignore_eos": "false"}, status=400)["error"]["param"] == "ignore_eos"
    assert post(client, route, {"top_k": 0}, status=400)["error"]["param"] == "top_k"


def test_top_k_is_honoured_in_responses(client):
    # top_k=1 sampling is greedy, whatever the temperature: the sampled reply is the greedy one.
    greedy = text_of("responses", post(client, "responses", {}))
    assert text_of("responses", post(client, "responses", {"temperature": 1.5, "top_k": 1, "top_p": None})) == greedy


@pytest.mark.parametrize("path", ["/server_info", "/model_info"])
def test_sglang_info_endpoints_name_the_served_model(client, path):
    r = client.get(path)
    assert r.status_code == 200 and r.json()["served_model_name"] == "tiny"
