"""The Responses API as the Open Responses spec has it, over HTTP (the `openai` client's transport, in-process): the
response object's every field with the value used, one ``created_at``, item statuses, assistant-first input,
``function_call_output`` checked against the calls, image parts refused by name, ``truncation`` and ``POST
/v1/responses/compact``. Each checks a behaviour the public compliance suite (openresponses' bin/compliance-test.ts)
checks, in our words; the WebSocket mode is in test_responses_ws.py."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from transformers import LogitsProcessorList

from hf_attnstore import AttnStore
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.serving.pipeline import ChatPipeline

from ..conftest import char_tokenizer, make_tiny
from .test_responses import WEATHER, Forced, Server
from .test_tools import TOOL_RESPONSE, TOOL_TEMPLATE

# The fields the spec's ResponseResource requires (public/openapi/openapi.json), every one present.
REQUIRED = {"id", "object", "created_at", "completed_at", "status", "incomplete_details", "model",
            "previous_response_id", "instructions", "output", "error", "tools", "tool_choice", "truncation",
            "parallel_tool_calls", "text", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
            "temperature", "reasoning", "usage", "max_output_tokens", "max_tool_calls", "store", "background",
            "service_tier", "metadata", "safety_identifier", "prompt_cache_key"}
NUMBERS = ("top_p", "presence_penalty", "frequency_penalty", "temperature")


@pytest.fixture
def server():
    srv = Server()
    yield srv
    srv.close()


def post(srv, path="/v1/responses", **body):
    return srv.http.post(path, json={"model": "tiny", **body})


def events_of(response) -> list[dict]:
    out = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            event = json.loads(lines["data"])
            assert lines["event"] == event["type"]  # the spec's rule: the SSE event name is the body's type
            out.append(event)
    return out


def test_every_field_of_the_response_object_is_there_with_the_value_used(server):
    server.answer("hi")
    r = post(server, input="hello", tools=[WEATHER]).json()
    assert REQUIRED <= set(r)
    assert isinstance(r["created_at"], int) and isinstance(r["completed_at"], int)
    assert r["completed_at"] >= r["created_at"]
    assert all(isinstance(r[name], float) for name in NUMBERS)  # never null: the defaults used
    # No temperature given: the pipeline decodes greedily, which the response says; no cap given: the server's.
    assert (r["temperature"], r["top_p"], r["max_output_tokens"]) == (0.0, 1.0, 12)
    assert (r["presence_penalty"], r["frequency_penalty"], r["top_logprobs"]) == (0.0, 0.0, 0)
    assert r["reasoning"] == {"effort": None, "summary": None}
    assert (r["background"], r["service_tier"], r["max_tool_calls"], r["truncation"]) == (False, "default", None,
                                                                                          "disabled")
    assert (r["safety_identifier"], r["prompt_cache_key"]) == (None, None)
    assert r["tools"] == [{**WEATHER, "strict": None}]  # the spec's FunctionTool: `strict` is there, null
    given = post(server, input="hello", temperature=0.5, top_p=0.9, max_output_tokens=5, presence_penalty=0.5,
                 frequency_penalty=0.25, safety_identifier="user-1", prompt_cache_key="app").json()
    assert (given["temperature"], given["top_p"], given["max_output_tokens"]) == (0.5, 0.9, 5)
    assert (given["presence_penalty"], given["frequency_penalty"]) == (0.5, 0.25)
    assert (given["safety_identifier"], given["prompt_cache_key"]) == ("user-1", "app")


def test_created_at_is_fixed_at_creation_in_every_event_and_the_stored_copy(server, monkeypatch):
    import hf_attnstore.serving.responses_api as api

    clock = iter(range(1_000_000, 2_000_000, 7))  # every reading of the clock is later than the one before
    monkeypatch.setattr(api.time, "time", lambda: next(clock))
    server.answer("hi")
    events = events_of(post(server, input="hello", stream=True))
    created, progress, done = events[0], events[1], events[-1]
    assert [created["type"], progress["type"], done["type"]] == ["response.created", "response.in_progress",
                                                                  "response.completed"]
    at = created["response"]["created_at"]
    assert progress["response"]["created_at"] == done["response"]["created_at"] == at
    assert created["response"]["completed_at"] is None and done["response"]["completed_at"] > at
    assert REQUIRED <= set(created["response"]) and REQUIRED <= set(done["response"])
    stored = server.http.get(f"/v1/responses/{done['response']['id']}").json()
    assert (stored["created_at"], stored["completed_at"]) == (at, done["response"]["completed_at"])


def test_a_reply_cut_by_its_cap_is_an_incomplete_message_streamed_or_not(server):
    server.answer("a long answer")
    r = post(server, input="hello", max_output_tokens=3).json()
    assert (r["status"], r["incomplete_details"], r["max_output_tokens"]) == ("incomplete",
                                                                              {"reason": "max_output_tokens"}, 3)
    assert r["output"][0]["status"] == "incomplete"
    events = events_of(post(server, input="hello", max_output_tokens=3, stream=True))
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["item"]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    server.answer("ok")
    whole = post(server, input="hello").json()
    assert whole["status"] == "completed" and whole["output"][0]["status"] == "completed"


def test_an_input_that_begins_with_an_assistant_message_is_rendered_as_after_any_history(server):
    server.answer("four")
    history = [{"type": "message", "role": "assistant", "phase": "commentary", "content": "I check."},
               {"type": "message", "role": "assistant", "phase": "final_answer", "content": "It is four."},
               {"type": "message", "role": "user", "content": "Repeat it."}]
    r = post(server, input=history)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed" and body["output"][0]["content"][0]["text"] == "four"
    # The prompt is the template's rendering of the conversation, token for token.
    messages = [{"role": m["role"], "content": m["content"]} for m in history]
    expected = server.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["usage"]["input_tokens"] == len(server.tok(expected, add_special_tokens=False)["input_ids"])
    # Chat completions take it too, and the same conversation continued reuses it whole.
    chat = server.http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "temperature": 0})
    assert chat.status_code == 200, chat.text
    again = server.http.post("/v1/chat/completions", json={
        "model": "tiny", "temperature": 0, "messages": [*messages, {"role": "assistant", "content": "four"},
                                                        {"role": "user", "content": "And?"}]}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == body["usage"]["input_tokens"] + len("four")


def test_a_function_call_output_that_answers_no_call_is_a_400_naming_input(server):
    server.answer("hi")
    first = post(server, input="hello").json()
    r = post(server, previous_response_id=first["id"],
             input=[{"type": "function_call_output", "call_id": "call_missing", "output": "12"}])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input" and "call_missing" in r.json()["error"]["message"]
    answered = post(server, input=[
        {"type": "message", "role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}], tools=[WEATHER])
    assert answered.status_code == 200, answered.text


def test_image_input_is_a_400_naming_the_part_and_saying_the_model_reads_text(server):
    r = post(server, input=[{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input" and "reads text only" in error["message"]
    assert "input.0.content.1 is `input_image`" in error["message"]


def test_reasoning_is_refused_by_name_and_an_empty_one_is_served(server):
    server.answer("hi")
    r = post(server, input="hello", reasoning={"effort": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning"
    assert post(server, input="hello", reasoning={"effort": None}).status_code == 200


def window_server(window: int) -> tuple[TestClient, ChatPipeline, AttnStore]:
    tok = char_tokenizer()
    tok.chat_template, tok.response_template = TOOL_TEMPLATE, TOOL_RESPONSE
    store = AttnStore("16MiB")
    force = Forced(tok)
    force.reply = "ok"
    pipe = ChatPipeline(make_tiny("llama"), tok, store, max_new_tokens=4, context_window=window,
                        logits_processor=LogitsProcessorList([force]))
    return TestClient(create_app(ChatEngine(pipe), "tiny", default_max_tokens=4)), pipe, store


def test_truncation_disabled_refuses_a_conversation_over_the_window_and_auto_truncates_it():
    http, pipe, store = window_server(48)
    try:
        long = "x" * 60  # over the window alone
        r = http.post("/v1/responses", json={"model": "tiny", "input": long})
        assert r.status_code == 400
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("input", "context_length_exceeded")
        auto = http.post("/v1/responses", json={"model": "tiny", "input": long, "truncation": "auto"})
        assert auto.status_code == 200, auto.text
        assert auto.json()["truncation"] == "auto" and auto.json()["attnstore"]["dropped_tokens"] > 0
        short = http.post("/v1/responses", json={"model": "tiny", "input": "hi"}).json()
        assert short["truncation"] == "disabled" and short["attnstore"]["dropped_tokens"] == 0
    finally:
        pipe.close(timeout=60)
        store.close()


LAUNCH = "We launch on Tuesday. " * 8  # long enough for whole blocks of stored KV to be shared (64 tokens each)
CONVERSATION = [{"type": "message", "role": "user", "content": LAUNCH},
                {"type": "message", "role": "assistant", "content": "Tuesday it is."},
                {"type": "message", "role": "user", "content": "Notify support first."}]


def test_compact_keeps_the_user_messages_and_summarizes_the_rest_into_a_compaction_item(server):
    from hf_attnstore.serving.protocol import compaction_content

    server.answer("Tuesday")  # the reply the conversation had, served first: its KV is stored
    served = post(server, input=CONVERSATION).json()
    server.answer("launch tue")
    r = post(server, "/v1/responses/compact", input=CONVERSATION, prompt_cache_key="k")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response.compaction" and isinstance(body["created_at"], int)
    users, compaction = body["output"][:-1], body["output"][-1]
    assert [u["content"][0]["text"] for u in users] == [LAUNCH, "Notify support first."]
    assert all((u["type"], u["role"], u["status"]) == ("message", "user", "completed") for u in users)
    assert compaction["type"] == "compaction" and compaction["encrypted_content"] == compaction_content("launch tue")
    assert set(body["usage"]) >= {"input_tokens", "output_tokens", "total_tokens", "input_tokens_details",
                                  "output_tokens_details"}
    # The compaction turn read the conversation's KV from the store (a session of its own: prefix sharing), all
    # of the conversation's prompt but its generation prompt's token.
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == served["usage"]["input_tokens"] - 1
    # The compacted window starts a new chain: the summary comes back as an assistant message.
    server.answer("done")
    follow = post(server, input=[*body["output"], {"type": "message", "role": "user", "content": "Go on."}])
    assert follow.status_code == 200, follow.text
    rendered = server.tok.apply_chat_template(
        [{"role": "user", "content": LAUNCH}, {"role": "user", "content": "Notify support first."},
         {"role": "assistant", "content": "launch tue"}, {"role": "user", "content": "Go on."}],
        tokenize=False, add_generation_prompt=True)
    assert follow.json()["usage"]["input_tokens"] == len(server.tok(rendered, add_special_tokens=False)["input_ids"])
    # The conversation's own session did not move: continued whole, it reuses all of its previous turn.
    server.answer("ok")
    on = post(server, previous_response_id=served["id"], input="And then?").json()
    assert on["usage"]["input_tokens_details"]["cached_tokens"] >= served["usage"]["total_tokens"] - 1


def test_compact_continues_a_chain_and_refuses_what_it_cannot_compact(server):
    server.answer("Tuesday")
    served = post(server, input=CONVERSATION).json()
    server.answer("sum")
    chained = post(server, "/v1/responses/compact", previous_response_id=served["id"], input="Also email them.")
    assert chained.status_code == 200, chained.text
    texts = [i["content"][0]["text"] for i in chained.json()["output"] if i["type"] == "message"]
    assert texts == [LAUNCH, "Notify support first.", "Also email them."]
    missing = server.http.post("/v1/responses/compact", json={"input": "hi"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    nothing = post(server, "/v1/responses/compact")
    assert nothing.status_code == 400 and nothing.json()["error"]["param"] == "input"
    foreign = post(server, input=[{"type": "compaction", "encrypted_content": "gAAAAB-not-ours"},
                                  {"type": "message", "role": "user", "content": "hi"}])
    assert foreign.status_code == 400 and foreign.json()["error"]["param"] == "input"
    assert "not made by this server" in foreign.json()["error"]["message"]


def test_an_assistant_first_conversation_renders_under_a_template_that_opens_with_its_own_system_prompt():
    from hf_attnstore.serving.conversation import MessageTokens, ReplyMemo

    tok = char_tokenizer()
    # SmolLM2's habit: a default system prompt when the conversation does not begin with one.
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}<|system|>default<|end|>{% endif %}"
                         "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    memo = ReplyMemo()
    memo.add("four", [7, 7, 7])  # a reply this server generated: its ids come back, after the template's own text
    messages = [{"role": "assistant", "content": "four"}, {"role": "user", "content": "again"}]
    ids = MessageTokens(tok, memo).prompt_ids(messages)
    head = tok("<|system|>default<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    rest = tok("<|end|><|user|>again<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    assert ids == head + [7, 7, 7] + rest
