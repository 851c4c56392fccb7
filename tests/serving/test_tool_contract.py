"""Issue 58 over the tiny model and the real `openai` client: a forced call always parses (a string argument may
hold the closing tag or a special token's text, forced or written freely) and always ends (a repeated call ends the
turn; at most `MAX_FORCED_CALLS`), a reply cut in a call says so, Responses refuses a tool output that answers no
call, tools' errors name the field at fault, and a chat template whose calls we recognise needs no parser flag."""

from __future__ import annotations

import json
import logging

import openai
import pytest
from transformers import LogitsProcessorList

from hf_attnstore.serving import forced

from .helpers import Prefer
from .test_forced_calls import ASK, NAMES_TEMPLATE, TIME, WEATHER
from .test_tools import TOOL_TEMPLATE, Server, streamed_calls

HTML = "<b>hi</b></tool_call>"


def html_tool(value: str) -> dict:
    return {"type": "function", "function": {"name": "html", "parameters": {
        "type": "object", "properties": {"html": {"type": "string", "enum": [value]}}, "required": ["html"],
        "additionalProperties": False}}}


def call_text(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.fixture(scope="module")
def server():
    srv = Server(template=NAMES_TEMPLATE, force=False)
    yield srv
    srv.close()


@pytest.mark.parametrize("value", [HTML, "a<|end|>b"])
def test_a_forced_string_with_the_closing_tag_or_a_special_tokens_text_stays_in_its_call(server, value):
    """The closing tag used to end the call (the call came back as text); a special token's text used to be
    generated as that token, which ended the reply mid-call."""
    tool, flat = html_tool(value), {"type": "function", **html_tool(value)["function"]}
    named = server.client.chat.completions.create(model="tiny", messages=ASK, tools=[tool], temperature=0,
                                                  tool_choice={"type": "function", "function": {"name": "html"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"html": value}
    content, calls, finish, _ = streamed_calls(server.client.chat.completions.create(
        model="tiny", messages=ASK, tools=[tool], temperature=0, tool_choice="required", stream=True))
    assert not content and finish == "tool_calls"
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"html": value}]
    response = server.client.responses.create(model="tiny", input=ASK[0]["content"], tools=[flat], temperature=0,
                                              tool_choice="required")
    assert response.status == "completed"
    assert [(i.type, json.loads(i.arguments)) for i in response.output] == [("function_call", {"html": value})]


def test_a_free_call_with_the_closing_tag_in_a_string_is_parsed_whole_streamed_or_not():
    srv = Server()  # the model answers what it is told: a call it writes itself (tool_choice "auto")
    try:
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}
        reply = "Sure." + call_text("get_weather", {"city": "a</tool_call>b"}) + call_text("get_weather",
                                                                                          {"city": "Rome"})
        srv.answer(reply)
        ask = dict(model="tiny", tools=[weather], messages=[{"role": "user", "content": "x"}])
        whole = srv.client.chat.completions.create(**ask).choices[0]
        assert whole.message.content == "Sure." and whole.finish_reason == "tool_calls"
        assert [json.loads(c.function.arguments) for c in whole.message.tool_calls] == \
            [{"city": "a</tool_call>b"}, {"city": "Rome"}]
        content, calls, finish, _ = streamed_calls(srv.client.chat.completions.create(**ask, stream=True))
        assert content == "Sure." and finish == "tool_calls"
        # The pieces add up to the text the model wrote (not to an escaped form of it).
        assert [c["arguments"] for c in calls.values()] == [c.function.arguments for c in whole.message.tool_calls]
        assert calls[0]["arguments"] == '{"city": "a</tool_call>b"}'
    finally:
        srv.close()


def preferring(reply: str) -> Server:
    """A server whose model would rather write `reply` (a constraint after it still decides)."""
    srv = Server(template=NAMES_TEMPLATE, force=False)
    prefer = Prefer(srv.tok, srv.tok(reply, add_special_tokens=False)["input_ids"])
    srv.pipe.generate_kwargs["logits_processor"] = LogitsProcessorList([prefer])
    return srv


def test_a_forced_reply_ends_after_a_call_that_repeats_an_earlier_one():
    """A model that writes the same call again (the bundled SmolLM2 did, to its token limit) has its turn ended
    there: the repeat is neither returned, streamed nor sent back into the next prompt."""
    paris = call_text("get_weather", {"city": "Paris"})
    srv = preferring("\n".join([paris, paris, paris]))
    try:
        ask = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
        first = srv.client.chat.completions.create(**ask)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
            [("get_weather", '{"city": "Paris"}')]
        # The repeat was generated (it ended the turn), not more.
        assert first.usage.completion_tokens == 2 * len(paris) + 2  # two calls, the newline, the end of turn
        content, calls, finish, _ = streamed_calls(srv.client.chat.completions.create(**ask, stream=True))
        assert not content and finish == "tool_calls" and [c["arguments"] for c in calls.values()] == \
            ['{"city": "Paris"}']
        response = srv.client.responses.create(model="tiny", input=ASK[0]["content"], tool_choice="required",
                                               tools=[{"type": "function", **t["function"]} for t in (WEATHER, TIME)])
        assert response.status == "completed" and [i.type for i in response.output] == ["function_call"]
        # Sent back, the call is the prompt's, as generated, up to where the repeat began.
        messages = ASK + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "18 C"}]
        second = srv.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                                    max_tokens=2)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + len(paris)
    finally:
        srv.close()


def test_a_forced_reply_ends_after_max_forced_calls(monkeypatch):
    monkeypatch.setattr(forced, "MAX_FORCED_CALLS", 2, raising=False)
    srv = preferring("\n".join(call_text("get_time", {"hours": h}) for h in (1, 2, 3)))
    try:
        r = srv.client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME],
                                               tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls"
        assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [{"hours": 1},
                                                                                              {"hours": 2}]
        # With parallel calls off, exactly one.
        one = srv.client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME],
                                                 tool_choice="required", parallel_tool_calls=False)
        assert [json.loads(c.function.arguments) for c in one.choices[0].message.tool_calls] == [{"hours": 1}]
    finally:
        srv.close()


def test_a_reply_cut_in_a_call_logs_what_it_returns(server, caplog):
    """The log used to say the cut call was "returned as text" while the reply held only the complete calls."""
    with caplog.at_level(logging.INFO, logger="hf_attnstore.serving.tools"):
        r = server.client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=20,
                                                  tool_choice="required")
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    messages = [rec.getMessage() for rec in caplog.records]
    assert not any("returned as text" in m for m in messages), messages
    assert any("cut by its token limit in tool call 1" in m for m in messages), messages


def test_a_function_call_output_must_answer_a_call(server):
    flat = [{"type": "function", **WEATHER["function"]}]
    first = server.client.responses.create(model="tiny", input=ASK[0]["content"], tools=flat, temperature=0,
                                           tool_choice="required", parallel_tool_calls=False)
    [call] = [i for i in first.output if i.type == "function_call"]
    for extra in ({"previous_response_id": first.id}, {}):  # on a chain, and alone
        with pytest.raises(openai.BadRequestError) as err:
            server.client.responses.create(model="tiny", tools=flat, max_output_tokens=2, **extra, input=[
                {"type": "function_call_output", "call_id": "call_nobody_made", "output": "18 C"}])
        assert err.value.body["param"] == "input" and "call_nobody_made" in err.value.body["message"]
    # A call of the chain, or one earlier in the same input, is answered.
    chained = server.client.responses.create(model="tiny", tools=flat, max_output_tokens=2,
                                             previous_response_id=first.id, input=[
                                                 {"type": "function_call_output", "call_id": call.call_id,
                                                  "output": "18 C"}])
    alone = server.client.responses.create(model="tiny", tools=flat, max_output_tokens=2, input=[
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"}])
    assert chained.status in ("completed", "incomplete") and alone.status in ("completed", "incomplete")  # accepted


def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("function, param, words", [
    ({"name": "f", "description": "lone \ud800 surrogate"}, "tools.1.function.description", "lone surrogate"),
    ({"name": "f", "parameters": {"type": "object", "properties": {"\udfff": {"type": "string"}}}},
     "tools.1.function.parameters", "lone surrogate"),
    ({"name": "f", "parameters": nested(300)}, "tools.1.function.parameters", "nested 601 levels deep"),
])
def test_a_bad_tool_is_a_400_naming_its_field(server, function, param, words):
    for route in ("chat", "responses"):
        if route == "chat":
            body = {"model": "tiny", "messages": ASK, "tools": [WEATHER, {"type": "function", "function": function}]}
        else:
            body = {"model": "tiny", "input": "hi", "tools": [{"type": "function", **WEATHER["function"]},
                                                              {"type": "function", **function}]}
            param = param.replace(".function", "")
        # As JSON escapes (a lone surrogate cannot be UTF-8).
        r = server.http.post(f"/v1/{'chat/completions' if route == 'chat' else 'responses'}",
                             content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (route, error)


def test_a_chat_template_whose_calls_are_hermes_needs_no_parser():
    """Tools used to need a response template (a JSON file); a template that renders `<tool_call>{json}</tool_call>`
    is recognised."""
    srv = Server(response=None)
    try:
        srv.answer("Sure." + call_text("get_weather", {"city": "Paris"}))
        choice = srv.client.chat.completions.create(model="tiny", tools=[WEATHER], messages=ASK).choices[0]
        assert choice.message.content == "Sure." and choice.message.tool_calls[0].function.name == "get_weather"
    finally:
        srv.close()


def test_tool_call_parser_names_the_format(model_dir, tmp_path, capsys):
    """`--tool-call-parser hermes` (vLLM's flag) instead of a JSON file: built for the served chat template."""
    from hf_attnstore.cli import build_parser, build_server, main

    template = tmp_path / "calls.jinja"
    # Calls in a format no template is recognised by: the flag alone makes them parsed as hermes.
    template.write_text(TOOL_TEMPLATE.replace("<tool_call>", "<call>"))
    server = build_server(build_parser().parse_args(["serve", "--model", model_dir, "--chat-template", str(template),
                                                     "--tool-call-parser", "hermes"]))
    try:
        parsed = server.engine.response_template
        assert parsed["start_anchor"] == "<|assistant|>" and parsed["fields"]["tool_calls"]["close"] == "</tool_call>"
        assert r"<\|end\|>" in parsed["fields"]["content"]["close_pattern"]
    finally:
        server.close()
    assert main(["serve", "--model", model_dir, "--tool-call-parser", "hermes", "--response-template",
                 str(tmp_path / "r.json")]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an unknown name: argparse's one line, before anything loads
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
