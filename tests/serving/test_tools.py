"""Tools in chat completions with the real `openai` client (in-process): calls parsed with transformers' response
parsing, streamed and not, sent back and reused exactly; what cannot be taken is a 400 naming its field."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient
from transformers import LogitsProcessorList

from hf_attnstore import AttnStore
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.serving.pipeline import ChatPipeline

from ..conftest import char_tokenizer, make_tiny
from .helpers import ForceReply

# A tool-capable chat template (Hermes-style calls) and the response template that parses it.
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.get('tool_calls') %}{{ m['content'] or '' }}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOL_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|end\|>", "content": "text"},
    },
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class Server:
    """A tiny model behind the app, answering what `force.reply` says; `client` is the openai client."""

    def __init__(self, template=TOOL_TEMPLATE, response=TOOL_RESPONSE, engine_template=None, force=True):
        tok = char_tokenizer()
        tok.chat_template = template
        if response is not None:
            tok.response_template = response
        self.tok = tok
        self.force = ForceReply(tok, [])
        self.store = AttnStore("16MiB")
        # Without `force`, the random model answers itself (constrained decoding decides what it may say).
        self.pipe = ChatPipeline(make_tiny("llama"), tok, self.store, max_new_tokens=200,
                                 logits_processor=LogitsProcessorList([self.force] if force else []))
        app = create_app(ChatEngine(self.pipe, response_template=engine_template), "tiny", default_max_tokens=200)
        self.http = TestClient(app)
        self.client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=self.http,
                                    max_retries=0)

    def answer(self, text: str) -> None:
        self.force.reply = self.tok(text, add_special_tokens=False)["input_ids"]

    def close(self):
        self.pipe.close(timeout=60)
        self.store.close()


@pytest.fixture
def server():
    srv = Server()
    yield srv
    srv.close()


def test_a_tool_call_round_trip_is_parsed_sent_back_and_reused_exactly(server):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    server.answer(CALL)
    first = server.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    # The agent runs the tool and sends everything back, with the result.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    server.answer("It is sunny.")
    second = server.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    assert second.choices[0].message.content == "It is sunny."
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    # The whole first turn (its prompt and the call, as generated) is reused: the template renders the call as
    # the model wrote it, and the memo gives back its exact ids.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + len(CALL)
    assert first.usage.prompt_tokens_details.cached_tokens == 0


def streamed_calls(stream) -> tuple[str, dict[int, dict], str | None, int]:
    """A chat stream's content, calls by index (id, name, arguments concatenated), finish reason, and how many
    chunks carried argument text."""
    content, calls, finish, pieces = "", {}, None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:  # the first chunk of a call: its id, type and name, no arguments yet
                assert call.index not in calls and call.type == "function" and call.function.arguments == ""
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
                pieces += 1
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish, pieces


def test_a_streamed_reply_gives_content_then_the_call_name_first_then_argument_deltas(server):
    server.answer("Let me look." + CALL + CALL.replace("Paris", "Rome"))
    ask = dict(model="tiny", tools=[WEATHER], messages=[{"role": "user", "content": "Paris?"}])
    content, calls, finish, pieces = streamed_calls(server.client.chat.completions.create(**ask, stream=True))
    assert content == "Let me look."
    assert [(i, c["name"], json.loads(c["arguments"])) for i, c in sorted(calls.items())] == \
        [(0, "get_weather", {"city": "Paris"}), (1, "get_weather", {"city": "Rome"})]
    assert pieces > 2  # the arguments came as they were written, not whole
    assert finish == "tool_calls"
    # The deltas add up to the arguments the whole reply returns: the text the model wrote.
    whole = server.client.chat.completions.create(**ask).choices[0].message.tool_calls
    assert [c["arguments"] for _, c in sorted(calls.items())] == [c.function.arguments for c in whole]
    assert whole[0].function.arguments == '{"city": "Paris"}'


def test_parallel_calls_and_parallel_tool_calls_false(server):
    server.answer(CALL + CALL.replace("Paris", "Rome"))
    ask = dict(model="tiny", tools=[WEATHER], messages=[{"role": "user", "content": "Paris and Rome?"}])
    both = server.client.chat.completions.create(**ask).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in both] == ["Paris", "Rome"]
    assert len({c.id for c in both}) == 2
    one = server.client.chat.completions.create(**ask, parallel_tool_calls=False).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in one] == ["Paris"]


def test_what_the_parser_cannot_take_stays_content(server):
    ask = dict(model="tiny", tools=[WEATHER], messages=[{"role": "user", "content": "x"}])
    for text in ('<tool_call>{"name": "get_weather", "arguments": {broken</tool_call>',
                 '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                 '<tool_call>[1, 2]</tool_call>'):
        server.answer(text)
        choice = server.client.chat.completions.create(**ask).choices[0]
        assert not choice.message.tool_calls and choice.finish_reason == "stop", text
        assert choice.message.content == text
        content, calls, finish, _ = streamed_calls(server.client.chat.completions.create(**ask, stream=True))
        assert content == text and finish == "stop", text
        # Streamed, a call whose JSON breaks after its name was sent was only begun (its arguments never
        # complete, `finish_reason` is "stop"); a call to a function not offered is never begun.
        assert all(c["name"] == "get_weather" and c["arguments"] in ("", "{") for c in calls.values()), calls


def test_tool_choice_none_renders_the_tools_and_parses_nothing(server):
    server.answer(CALL)
    choice = server.client.chat.completions.create(model="tiny", tools=[WEATHER], tool_choice="none",
                                                   messages=[{"role": "user", "content": "x"}]).choices[0]
    assert choice.message.content == CALL and not choice.message.tool_calls


def test_the_engines_response_template_serves_a_tokenizer_without_one():
    srv = Server(response=None, engine_template=TOOL_RESPONSE)
    try:
        srv.answer(CALL)
        choice = srv.client.chat.completions.create(model="tiny", tools=[WEATHER],
                                                    messages=[{"role": "user", "content": "x"}]).choices[0]
        assert choice.message.tool_calls[0].function.name == "get_weather"
    finally:
        srv.close()


def test_tools_a_model_cannot_take_are_refused_naming_tools():
    plain = Server(template=char_tokenizer().chat_template)  # a template that ignores tools
    # A llama with no response template anywhere, and calls in a format none recognises.
    no_parser = Server(template=TOOL_TEMPLATE.replace("tool_call>", "call>"), response=None)
    try:
        for srv in (plain, no_parser):
            with pytest.raises(openai.BadRequestError) as err:
                srv.client.chat.completions.create(model="tiny", tools=[WEATHER],
                                                   messages=[{"role": "user", "content": "x"}])
            assert err.value.body["param"] == "tools", err.value.body
        # Without tools, both serve as before.
        plain.answer("hi")
        assert plain.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}]).choices[0].message.content == "hi"
    finally:
        plain.close()
        no_parser.close()


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER] * 129}, "tools"),
    # Over the request's size limit: the tools' definitions are what is large, so the error names them.
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "description": "x" * 20_000}}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x" * 20_000}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]},
                   {"role": "user", "content": "y"}]}, "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                         "function": {"name": "f", "arguments": "[" * 100_000}}]},
                   {"role": "user", "content": "y"}]}, "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, extra, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], **extra}
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_broken_response_template_is_refused_when_the_server_starts():
    pipe = ChatPipeline(make_tiny("llama"), char_tokenizer(), None, max_new_tokens=4)
    try:
        with pytest.raises(ValueError, match="response template"):
            ChatEngine(pipe, response_template={"fields": {}})  # no start_anchor
    finally:
        pipe.close(timeout=60)
