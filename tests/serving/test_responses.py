"""The Responses API with the real `openai` client (in-process): chains by `previous_response_id` that reuse the
session's KV and answer as the whole conversation would, branches, streaming events, tools, GET/DELETE,
`store: false`, a restart with a disk tier, and bad ids and fields as 4xx."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient
from transformers import LogitsProcessor, LogitsProcessorList

from hf_attnstore import AttnStore
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.serving.pipeline import ChatPipeline

from ..conftest import char_tokenizer, make_tiny
from .helpers import ForceReply
from .test_tools import CALL, TOOL_RESPONSE, TOOL_TEMPLATE

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


class Forced(LogitsProcessor):
    """Forces `reply` (text) while it is set; the model's own tokens otherwise."""

    def __init__(self, tok):
        self.tok, self.reply = tok, None

    def __call__(self, input_ids, scores):
        if self.reply is None:
            return scores
        return ForceReply(self.tok, self.tok(self.reply, add_special_tokens=False)["input_ids"])(input_ids, scores)


class Server:
    def __init__(self, disk_dir=None, force=False):
        tok = char_tokenizer()
        tok.chat_template, tok.response_template = TOOL_TEMPLATE, TOOL_RESPONSE
        self.tok = tok
        self.force = Forced(tok)
        self.store = AttnStore("16MiB", disk_dir=disk_dir)
        self.pipe = ChatPipeline(make_tiny("llama"), tok, self.store, max_new_tokens=12,
                                 logits_processor=LogitsProcessorList([self.force]))
        self.http = TestClient(create_app(ChatEngine(self.pipe), "tiny", default_max_tokens=12))
        self.client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=self.http,
                                    max_retries=0)

    def answer(self, text):
        self.force.reply = text

    def close(self):
        self.pipe.close(timeout=60)
        self.store.close()


@pytest.fixture
def server():
    srv = Server()
    yield srv
    srv.close()


def ask(srv, **kw):
    return srv.client.responses.create(model="tiny", temperature=0, **kw)


def chat_text(srv, messages):
    r = srv.client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12)
    return r.choices[0].message.content


def test_a_chain_reuses_the_session_and_answers_as_the_whole_conversation(server):
    first = ask(server, input="hello there", instructions="be brief")
    second = ask(server, input="and then?", instructions="be brief", previous_response_id=first.id)
    third = ask(server, input="why?", instructions="be brief", previous_response_id=second.id)
    assert first.output_text
    cut = first.usage.output_tokens == 12  # max_output_tokens unset: the server's default, 12 here
    assert first.status == ("incomplete" if cut else "completed")
    assert (first.incomplete_details is not None and first.incomplete_details.reason == "max_output_tokens") == cut
    assert first.usage.input_tokens_details.cached_tokens == 0
    for before, after in ((first, second), (second, third)):
        # The previous prompt and its reply are all reused (the reply's ids exactly as generated).
        assert after.usage.input_tokens_details.cached_tokens >= \
            before.usage.input_tokens + before.usage.output_tokens - 1
        assert after.previous_response_id == before.id
    # Same answer as the whole conversation sent to chat completions on a fresh server (recomputation).
    fresh = Server()
    try:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
                    {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "and then?"},
                    {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "why?"}]
        assert chat_text(fresh, messages) == third.output_text
    finally:
        fresh.close()


def test_a_branch_from_an_older_response_reuses_the_common_prefix_and_keeps_the_newer_chain(server):
    # A branch is a new session: it reuses the prefix it shares with the stored one in whole 64-token blocks
    # (the store's prefix table), so the first turn is longer than one block here.
    first = ask(server, input="hello there, " * 12)
    second = ask(server, input="and then?", previous_response_id=first.id)
    branch = ask(server, input="something else", previous_response_id=first.id)
    assert branch.usage.input_tokens_details.cached_tokens >= 64 * ((first.usage.input_tokens - 1) // 64)
    assert branch.attnstore["session_id"] != second.attnstore["session_id"]
    on = ask(server, input="go on", previous_response_id=second.id)  # the newer chain is still whole
    assert on.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens + second.usage.output_tokens - 1


def test_get_delete_and_store_false(server):
    first = ask(server, input="hello there")
    got = server.client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    assert server.http.delete(f"/v1/responses/{first.id}").json() == {"id": first.id, "object": "response",
                                                                        "deleted": True}
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as err:
        ask(server, input="x", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    unstored = ask(server, input="hello", store=False)
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError):
        ask(server, input="x", previous_response_id=unstored.id)


def test_streamed_events_and_the_stored_response_agree(server):
    events = list(server.client.responses.create(model="tiny", input="hello there", temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert done.output_text == text
    assert server.client.responses.retrieve(done.id).output_text == text
    plain = ask(server, input="hello there")
    assert plain.output_text == text  # streamed or not, the same greedy reply


def test_function_calls_round_trip_through_a_chain():
    srv = Server(force=True)
    try:
        srv.answer(CALL)
        first = ask(srv, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=200)
        [call] = [item for item in first.output if item.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert not [item for item in first.output if item.type == "message"]
        srv.answer("Sunny.")
        second = ask(srv, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=200,
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
        assert second.output_text == "Sunny."
        # The call, as generated, is reused exactly.
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + len(CALL)
        srv.answer("Again: " + CALL)
        events = list(srv.client.responses.create(model="tiny", input="again", tools=[WEATHER], stream=True,
                                                  previous_response_id=second.id, max_output_tokens=200))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    finally:
        srv.close()


def test_a_chain_survives_a_restart_with_a_disk_tier(tmp_path):
    srv = Server(disk_dir=tmp_path)
    try:
        srv.answer("Hi!")  # replies of text (a random model's may be special tokens only, which render as "")
        first = ask(srv, input="hello there")
        srv.answer("Then this.")
        second = ask(srv, input="and then?", previous_response_id=first.id)
    finally:
        srv.close()
    again = Server(disk_dir=tmp_path)
    try:
        third = ask(again, input="why?", previous_response_id=second.id)  # the model's own reply
        assert third.usage.input_tokens_details.cached_tokens >= \
            second.usage.input_tokens + second.usage.output_tokens - 1
        assert again.client.responses.retrieve(first.id).output_text == first.output_text
    finally:
        again.close()
    fresh = Server()
    try:
        messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "and then?"}, {"role": "assistant", "content": second.output_text},
                    {"role": "user", "content": "why?"}]
        assert chat_text(fresh, messages) == third.output_text
    finally:
        fresh.close()


def test_a_damaged_stored_response_is_unknown_not_a_crash(tmp_path):
    srv = Server(disk_dir=tmp_path)
    try:
        first = ask(srv, input="hello there")
    finally:
        srv.close()
    path = tmp_path / "responses" / f"{first.id}.json"
    data = json.loads(path.read_text())
    data["content_ids"] = ["not", "ids"]
    path.write_text(json.dumps(data))
    again = Server(disk_dir=tmp_path)
    try:
        with pytest.raises(openai.BadRequestError) as err:
            ask(again, input="x", previous_response_id=first.id)
        assert err.value.body["param"] == "previous_response_id"
        assert ask(again, input="hello there").output_text
    finally:
        again.close()


@pytest.mark.parametrize("extra, status, param", [
    ({"previous_response_id": "resp_../../etc/passwd"}, 400, "previous_response_id"),
    ({"previous_response_id": "resp_" + "0" * 32}, 400, "previous_response_id"),
    ({"background": True}, 400, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}}, 400, "text.format"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, 400, "tools"),
    ({"max_output_tokens": 10**9}, 400, "max_output_tokens"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}, 400, None),
    ({"input": []}, 400, "input"),
    ({"model": "other"}, 404, "model"),
    ({"cache_salt": ""}, 400, "cache_salt"),
])
def test_bad_requests_are_4xx_naming_the_field(server, extra, status, param):
    r = server.http.post("/v1/responses", json={"model": "tiny", "input": "hi", **extra})
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.json()


def test_unknown_ids_on_get_and_delete_are_404s(server):
    for rid in ("resp_" + "0" * 32, "nope", "..%2F..%2Fetc"):
        assert server.http.get(f"/v1/responses/{rid}").status_code == 404
        assert server.http.delete(f"/v1/responses/{rid}").status_code == 404


def test_a_response_of_another_salt_cannot_be_continued(server):
    first = server.client.responses.create(model="tiny", input="hello", extra_body={"cache_salt": "tenant-a"})
    with pytest.raises(openai.BadRequestError):
        server.client.responses.create(model="tiny", input="x", previous_response_id=first.id,
                                       extra_body={"cache_salt": "tenant-b"})
    ok = server.client.responses.create(model="tiny", input="x", previous_response_id=first.id,
                                        extra_body={"cache_salt": "tenant-a"})
    assert ok.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("extra, param", [
    ({"metadata": {"k": "\ud800"}}, "metadata"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "x": float("nan")}}]}, "tools"),
    ({"instructions": "a\udc00b"}, "instructions"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 100_000}]}, None),
])
def test_fields_echoed_back_that_json_cannot_carry_are_400s(server, extra, param):
    # As JSON text (escaped surrogates, NaN): what a client may send, though httpx would not encode it.
    r = server.http.post("/v1/responses", content=json.dumps({"model": "tiny", "input": "hi", **extra}),
                         headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.json()


def test_the_store_keeps_at_most_its_bytes_in_memory():
    srv = Server()
    try:
        srv.http.app.state.responses.max_memory_bytes = 1  # no disk tier: it holds the newest response only
        first = ask(srv, input="hello there")
        second = ask(srv, input="and then?", previous_response_id=first.id)  # first is still the newest: found
        assert second.previous_response_id == first.id
        with pytest.raises(openai.BadRequestError):  # pushed out by `second`: its chain cannot be rebuilt
            ask(srv, input="x", previous_response_id=first.id)
    finally:
        srv.close()
