"""Requests are typed as OpenAI types them (the `openai` client's own TypedDicts are the reference): an explicit
``null`` for an optional field is "not given" (an OpenAI-compatible router sends ``"stream": null`` on every
request), no value is coerced to another type (``"5"`` is not an int, ``true`` is not a number), and a
``tool_choice`` that names no offered tool is a 400 naming it. Every route: chat completions, completions,
Responses."""

from __future__ import annotations

import typing

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from hf_attnstore import AttnStore
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.serving.pipeline import ChatPipeline
from hf_attnstore.serving.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest

from ..conftest import char_tokenizer, make_tiny
from .test_tools import TOOL_RESPONSE, TOOL_TEMPLATE, WEATHER

RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses form: flat


@pytest.fixture(scope="module")
def server():
    """The model's own greedy replies (not forced): a field that changed the answer would show."""
    tok = char_tokenizer()
    tok.chat_template, tok.response_template = TOOL_TEMPLATE, TOOL_RESPONSE
    store = AttnStore("16MiB")
    pipe = ChatPipeline(make_tiny("llama"), tok, store, max_new_tokens=8)
    http = TestClient(create_app(ChatEngine(pipe), "tiny", default_max_tokens=8))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    yield http, client
    pipe.close(timeout=60)
    store.close()


# route: (path, the smallest valid body, the openai client's params, our request model)
ROUTES = {
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 4, "temperature": 0},
             chat_create_params.CompletionCreateParamsNonStreaming, ChatCompletionRequest),
    "completions": ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0},
                    completion_create_params.CompletionCreateParamsNonStreaming, CompletionRequest),
    "responses": ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0},
                  response_create_params.ResponseCreateParamsNonStreaming, ResponsesRequest),
}


def nullable(params: type) -> set[str]:
    """The fields the openai client's TypedDict `params` (and its bases) types as optional and nullable."""
    out = set()
    for cls in reversed(params.__mro__):
        for name, annotation in getattr(cls, "__annotations__", {}).items():
            text = annotation.__forward_arg__ if isinstance(annotation, typing.ForwardRef) else str(annotation)
            if text.startswith("Required["):
                continue
            if text.startswith("Optional[") or text.endswith(", None]"):
                out.add(name)
    return out


def optional_fields(route: str) -> list[str]:
    """Every optional field of a route: the client's nullable ones and our model's (its extensions included)."""
    _, _, params, model = ROUTES[route]
    ours = {name for name, field in model.model_fields.items() if not field.is_required()}
    return sorted(nullable(params) | ours)


def answer(http, route: str, body: dict):
    path = ROUTES[route][0]
    r = http.post(path, json=body)
    if r.status_code != 200:
        return r.status_code, r.json()["error"]
    out = r.json()
    if route == "chat":
        return 200, (out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"])
    if route == "completions":
        return 200, (out["choices"][0]["text"], out["usage"]["completion_tokens"])
    return 200, ([item.get("content") for item in out["output"]], out["usage"]["output_tokens"])


def test_the_openai_types_have_the_nullable_fields_the_issue_names():
    """The derivation follows the client's types: the fields real clients send as null are among them."""
    assert {"stream", "store", "temperature", "max_tokens", "n", "logprobs"} <= nullable(
        chat_create_params.CompletionCreateParamsNonStreaming)
    assert {"stream", "echo", "logprobs", "best_of", "suffix"} <= nullable(
        completion_create_params.CompletionCreateParamsNonStreaming)
    assert {"stream", "store", "background", "include", "max_output_tokens"} <= nullable(
        response_create_params.ResponseCreateParamsNonStreaming)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_an_explicit_null_is_the_field_not_given(server, route):
    http, _ = server
    base = ROUTES[route][1]
    wrong = {}
    for name in optional_fields(route):
        omitted = {k: v for k, v in base.items() if k != name}
        expected = answer(http, route, omitted)
        assert expected[0] == 200, (name, expected)
        got = answer(http, route, {**omitted, name: None})
        if got != expected:
            wrong[name] = got
    assert not wrong, wrong
    # All of them null at once, too.
    every = {**base, **{name: None for name in optional_fields(route)}}
    required = {k: v for k, v in base.items() if k in ("model", "messages", "prompt", "input")}
    assert answer(http, route, every) == answer(http, route, required)


NESTED_NULLS = {
    "chat": [{"messages": [{"role": "user", "content": "hi", "name": None, "tool_calls": None,
                            "tool_call_id": None}]},
             {"stream_options": {"include_usage": None}},
             {"tools": [{"type": "function", "function": {**WEATHER["function"], "description": None,
                                                          "parameters": None}}]}],
    "completions": [{"stream_options": {"include_usage": None}}],
    "responses": [{"tools": [{**RESPONSES_WEATHER, "description": None, "strict": None}]},
                  {"input": [{"role": "user", "content": "hi", "type": None}]}],
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_null_inside_a_nested_object_is_not_given_either(server, route):
    http, _ = server
    for extra in NESTED_NULLS[route]:
        status, got = answer(http, route, {**ROUTES[route][1], **extra})
        assert status == 200, (extra, got)


# (route, fields, the param named): values OpenAI refuses that a lax parser would coerce.
COERCED = [
    ("chat", {"max_tokens": "5"}, "max_tokens"),
    ("chat", {"max_tokens": 5.0}, "max_tokens"),
    ("chat", {"max_completion_tokens": "5"}, "max_completion_tokens"),
    ("chat", {"temperature": True}, "temperature"),
    ("chat", {"temperature": "0.5"}, "temperature"),
    ("chat", {"top_p": True}, "top_p"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("chat", {"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
    ("chat", {"stream": "false"}, "stream"),
    ("chat", {"stream": 0}, "stream"),
    ("chat", {"n": "1"}, "n"),
    ("chat", {"n": True}, "n"),
    ("chat", {"seed": "7"}, "seed"),
    ("chat", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("chat", {"presence_penalty": False}, "presence_penalty"),
    ("chat", {"logit_bias": {"5": True}}, "logit_bias.5"),
    ("chat", {"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ("chat", {"parallel_tool_calls": "false", "tools": [WEATHER]}, "parallel_tool_calls"),
    ("chat", {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("chat", {"user": 5}, "user"),
    ("chat", {"stop": 5}, "stop"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("completions", {"prompt": [True]}, "prompt"),
    ("completions", {"prompt": [[1, False]]}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"max_tokens": "5"}, "max_tokens"),
    ("completions", {"temperature": True}, "temperature"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"logprobs": "2"}, "logprobs"),
    ("completions", {"echo": "yes"}, "echo"),
    ("completions", {"stream": "no"}, "stream"),
    ("completions", {"n": "1"}, "n"),
    ("completions", {"best_of": True}, "best_of"),
    ("completions", {"seed": 1.5}, "seed"),
    ("completions", {"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("responses", {"max_output_tokens": "5"}, "max_output_tokens"),
    ("responses", {"temperature": True}, "temperature"),
    ("responses", {"top_p": "1"}, "top_p"),
    ("responses", {"store": "no"}, "store"),
    ("responses", {"stream": 1}, "stream"),
    ("responses", {"parallel_tool_calls": "yes", "tools": [RESPONSES_WEATHER]}, "parallel_tool_calls"),
    ("responses", {"background": "false"}, "background"),
    ("responses", {"metadata": {"k": 1}}, "metadata.k"),
    ("responses", {"instructions": 5}, "instructions"),
    ("responses", {"user": True}, "user"),
    ("responses", {"input": [{"role": "user", "content": 5}]}, "input"),
]


@pytest.mark.parametrize("route, fields, param", COERCED, ids=[f"{r}-{next(iter(f))}-{f[next(iter(f))]!r}"
                                                               for r, f, _ in COERCED])
def test_a_value_of_the_wrong_type_is_a_400_naming_the_field(server, route, fields, param):
    http, _ = server
    path, base, _, _ = ROUTES[route]
    r = http.post(path, json={**base, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_whole_number_is_a_valid_number(server, route):
    """JSON has one number type: 1 is a valid `temperature` (OpenAI's `number`), as 1.0 is."""
    http, _ = server
    path, base, _, _ = ROUTES[route]
    for value in (1, 1.0, 0):
        r = http.post(path, json={**base, "temperature": value, "top_p": 1, "seed": 3})
        assert r.status_code == 200, (value, r.text)


CHAT_NAMED = {"type": "function", "function": {"name": "get_weather"}}
RESPONSES_NAMED = {"type": "function", "name": "get_weather"}


@pytest.mark.parametrize("route, fields, words", [
    ("chat", {"tool_choice": "required"}, ["`tools`"]),
    ("chat", {"tool_choice": CHAT_NAMED}, ["`tools`"]),
    ("chat", {"tool_choice": "required", "tools": []}, ["`tools`"]),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "other"}}, "tools": [WEATHER]},
     ["'other'", "get_weather"]),
    ("chat", {"tool_choice": {"type": "function"}, "tools": [WEATHER]}, ["function"]),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": 5}}, "tools": [WEATHER]}, []),
    ("chat", {"tool_choice": "sometimes", "tools": [WEATHER]}, []),
    ("chat", {"tool_choice": 1, "tools": [WEATHER]}, []),
    ("responses", {"tool_choice": "required"}, ["`tools`"]),
    ("responses", {"tool_choice": RESPONSES_NAMED}, ["`tools`"]),
    ("responses", {"tool_choice": {"type": "function", "name": "other"}, "tools": [RESPONSES_WEATHER]},
     ["'other'", "get_weather"]),
    ("responses", {"tool_choice": {"type": "function"}, "tools": [RESPONSES_WEATHER]}, ["name"]),
])
def test_a_tool_choice_that_names_no_offered_tool_is_a_400_naming_it(server, route, fields, words):
    http, _ = server
    path, base, _, _ = ROUTES[route]
    r = http.post(path, json={**base, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice", error
    for word in words:
        assert word in error["message"], (word, error)


ALLOWED = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}


@pytest.mark.parametrize("route, fields", [
    ("chat", {"tool_choice": {"type": "allowed_tools", "allowed_tools": ALLOWED}, "tools": [WEATHER]}),
    ("chat", {"tool_choice": {"type": "custom", "custom": {"name": "get_weather"}}, "tools": [WEATHER]}),
    ("responses", {"tool_choice": ALLOWED, "tools": [RESPONSES_WEATHER]}),
    ("responses", {"tool_choice": {"type": "web_search_preview"}, "tools": [RESPONSES_WEATHER]}),
])
def test_a_tool_choice_object_other_than_a_function_is_refused_as_unsupported(server, route, fields):
    """"required" and a named function are forced by constrained decoding (test_forced_calls.py); allowed tools and
    choices of tools this server does not have are refused by name."""
    http, _ = server
    path, base, _, _ = ROUTES[route]
    r = http.post(path, json={**base, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_auto_and_none_ask_for_nothing_without_tools(server, route):
    """`auto` and `none` without tools ask for what the request gets anyway (no calls); the Responses API's own
    response objects say `"tool_choice": "auto"` with `"tools": []`, which clients send back."""
    http, _ = server
    path, base, _, _ = ROUTES[route]
    for choice in ("auto", "none"):
        for tools in ({}, {"tools": []}, {"tools": None}):
            r = http.post(path, json={**base, "tool_choice": choice, **tools})
            assert r.status_code == 200, (choice, tools, r.text)


def test_the_openai_client_sends_explicit_nulls_and_is_answered(server):
    """What a router in front of the server sends: the client passes None through as null."""
    _, client = server
    response = client.responses.create(model="tiny", input="hi", stream=None, store=None, temperature=None,
                                       max_output_tokens=None, top_p=None, tools=None, tool_choice=None,
                                       parallel_tool_calls=None, instructions=None, previous_response_id=None,
                                       metadata=None, background=None, include=None, truncation=None)
    assert response.status in ("completed", "incomplete") and response.store is True and response.output
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=None,
                                          store=None, temperature=None, max_tokens=None, n=None, logprobs=None,
                                          top_logprobs=None, seed=None, stop=None, stream_options=None,
                                          frequency_penalty=None, presence_penalty=None, logit_bias=None,
                                          top_p=None, metadata=None, service_tier=None)
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    completion = client.completions.create(model="tiny", prompt="hi", stream=None, echo=None, n=None,
                                           best_of=None, logprobs=None, suffix=None, max_tokens=None,
                                           temperature=None, stop=None, seed=None)
    assert completion.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"max_tokens": "5"})
    assert err.value.body["param"] == "max_tokens", err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="hi", tool_choice="required")
    assert err.value.body["param"] == "tool_choice", err.value.body


@pytest.mark.parametrize("fields, param", [
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": {"name": "get_weather"}}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
])
def test_openai_fields_that_would_change_the_answer_are_refused_not_ignored(server, fields, param):
    """Deprecated function calling and audio output were ignored: the client got a text reply it did not ask
    for. Null, empty or "none"/"auto" ask for nothing and are served."""
    http, _ = server
    path, base, _, _ = ROUTES["chat"]
    r = http.post(path, json={**base, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "not supported" in r.json()["error"]["message"]
    for harmless in ({"functions": []}, {"function_call": "none"}, {"function_call": "auto"}, {"modalities": ["text"]},
                     {"audio": None, "modalities": None, "functions": None, "function_call": None}):
        r = http.post(path, json={**base, **harmless})
        assert r.status_code == 200, (harmless, r.text)
