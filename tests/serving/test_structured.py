"""Structured output with llguidance over HTTP (the real `openai` client, SmolLM2's tokenizer and weights): replies
that are valid JSON for the schema by construction, the same alone and batched, in chat completions and the
Responses API; formats the compiler refuses are 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from hf_attnstore import AttnStore
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.serving.pipeline import ChatPipeline

pytestmark = pytest.mark.integration  # llguidance needs a real tokenizer (a byte-level one): SmolLM2's

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Invent a person. Answer in JSON with their name and age."}]


@pytest.fixture(scope="module")
def servers(smollm2):
    model, tok = smollm2
    out = {}
    for batch in (1, 4):
        store = AttnStore("64MiB")
        pipe = ChatPipeline(model, tok, store, max_new_tokens=48, max_batch_size=batch)
        http = TestClient(create_app(ChatEngine(pipe), "smol", default_max_tokens=48))
        out[batch] = (openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                                    max_retries=0), http)
        out[(batch, "close")] = (pipe, store)
    yield out
    for batch in (1, 4):
        pipe, store = out[(batch, "close")]
        pipe.close(timeout=60)
        store.close()


def test_a_json_schema_reply_is_valid_and_the_same_batched(servers):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    replies = []
    for batch in (1, 4):
        client = servers[batch][0]
        r = client.chat.completions.create(model="smol", messages=ASK, temperature=0, response_format=fmt)
        replies.append(r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop"  # the grammar completed, then the end of turn
    person = json.loads(replies[0])
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 16
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
    assert replies[0] == replies[1]
    # Unconstrained, the model answers otherwise (prose, or JSON of its own shape).
    free = servers[1][0].chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=48)
    assert free.choices[0].message.content != replies[0]


def test_json_object_and_the_responses_text_format(servers):
    client = servers[1][0]
    r = client.chat.completions.create(model="smol", messages=ASK, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    resp = client.responses.create(model="smol", input=ASK[0]["content"], temperature=0,
                                   text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    person = json.loads(resp.output_text)
    assert set(person) == {"name", "age"}
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": 7}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}}}},
     "response_format"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}},
     "text.format"),
])
def test_formats_the_compiler_refuses_are_400s(servers, path, extra, param):
    http = servers[1][1]
    body = {"model": "smol", **({"messages": ASK} if "chat" in path else {"input": "hi"}), **extra}
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_allowed_tokens_reads_llguidance_bitmask_bit_by_bit():
    """Token 32*i + j is allowed exactly when bit j of word i is set, the sign bit included (llguidance's layout);
    the vocabulary's tail past `width` is cut."""
    import torch

    from hf_attnstore.serving.structured import allowed_tokens

    words = torch.randint(-2**31, 2**31 - 1, (1, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    words[0, 4] = -2**31  # only the sign bit: token 159
    got = allowed_tokens(words, 150)
    want = [bool((int(words[0, k // 32]) & 0xFFFFFFFF) >> (k % 32) & 1) for k in range(150)]
    assert got.shape == (1, 150) and got[0].tolist() == want
    assert allowed_tokens(words, 160)[0, 128:].nonzero().flatten().tolist() == [31]
