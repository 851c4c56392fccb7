"""Forced tool calls (``tool_choice`` "required" or a named function) with the real `openai` client: a random tiny
model, which never calls a tool by itself, is constrained by llguidance to calls of offered functions whose
arguments fit their schema, in the template's own format; sent back, the call is reused exactly."""

from __future__ import annotations

import json

import openai
import pytest

from .test_tools import TOOL_RESPONSE, TOOL_TEMPLATE, Server

# The tools by name only: the tiny model has 512 positions, and a character tokenizer spends one per character.
NAMES_TEMPLATE = TOOL_TEMPLATE.replace("tools: {{ tools | tojson }}",
                                       "tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}")

CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": CITY},
                                                           "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time",
                                         "parameters": {"type": "object",
                                                        "properties": {"hours": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 23}},
                                                        "required": ["hours"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    srv = Server(template=NAMES_TEMPLATE, force=False)
    yield srv
    srv.close()


def valid(call) -> bool:
    """Whether `call` is a call of WEATHER or TIME with arguments that fit its schema."""
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        return set(args) == {"city"} and args["city"] in CITY["enum"]
    return call.function.name == "get_time" and set(args) == {"hours"} and isinstance(args["hours"], int) \
        and 0 <= args["hours"] <= 23


def test_a_named_tool_choice_returns_a_schema_valid_call_of_that_function(server):
    for name in ("get_weather", "get_time"):
        r = server.client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                                  tool_choice={"type": "function", "function": {"name": name}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == name and valid(call), call
    # Unforced, the same model answers in text.
    free = server.client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                                 max_tokens=20)
    assert not free.choices[0].message.tool_calls


def test_required_returns_valid_calls(server):
    for parallel in (False, None):
        r = server.client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                                  tool_choice="required", parallel_tool_calls=parallel)
        calls = r.choices[0].message.tool_calls
        assert calls and all(valid(c) for c in calls), calls
        assert r.choices[0].finish_reason == "tool_calls"
        if parallel is False:
            assert len(calls) == 1


def test_the_forced_call_and_its_result_sent_back_reuse_the_prompt(server):
    messages = list(ASK)
    first = server.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], temperature=0,
                                                  tool_choice="required")
    [call] = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = server.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], temperature=0,
                                                   max_tokens=4)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The previous prompt and the call, as generated (the memo gives its ids back): all of it.
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert cached >= 0.9 * first.usage.prompt_tokens


def test_forced_calls_through_the_responses_api(server):
    resp = server.client.responses.create(model="tiny", input="Weather in Paris?", temperature=0,
                                          tools=[{"type": "function", **WEATHER["function"]}],
                                          tool_choice={"type": "function", "name": "get_weather"})
    [item] = [i for i in resp.output if i.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments)["city"] in CITY["enum"]


@pytest.mark.parametrize("extra, param", [
    # A schema llguidance cannot compile.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
                                                                                {"a": {"type": 7}}}}}],
      "tool_choice": "required"}, "tools"),
    # Parameters that are not an object's schema (OpenAI's rule): refused, not forced into calls nobody can take.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    # A forced function that is not offered.
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
])
def test_what_cannot_be_forced_is_a_400_and_the_server_keeps_serving(server, extra, param):
    body = {"model": "tiny", "messages": ASK, **extra}
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = server.client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required")
    assert valid(ok.choices[0].message.tool_calls[0])


def test_a_template_without_tools_or_a_format_that_cannot_be_forced_is_a_400():
    from ..conftest import char_tokenizer

    plain = Server(template=char_tokenizer().chat_template, force=False)
    named_in_tag = dict(TOOL_RESPONSE, fields={**TOOL_RESPONSE["fields"], "tool_calls": {
        "open_pattern": r"<call=(?P<name>\w+)>", "close": "</call>", "content": "json",
        "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}}})
    other = Server(template=NAMES_TEMPLATE, response=named_in_tag, force=False)
    try:
        for srv, param in ((plain, "tools"), (other, "tool_choice")):
            with pytest.raises(openai.BadRequestError) as err:
                srv.client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                                   tool_choice="required")
            assert err.value.body["param"] == param, err.value.body
    finally:
        plain.close()
        other.close()


def test_a_responses_chain_keeps_the_calls_and_their_outputs_and_reuses_the_kv(server):
    """An agent loop over `previous_response_id`: each step's call and its output stay in the context (the prompt
    is the one the whole conversation gives through chat completions, token for token), and each step reuses all
    of the previous one, through the tool pause."""
    tools = [{"type": "function", **WEATHER["function"]}, {"type": "function", **TIME["function"]}]
    chat_tools = [WEATHER, TIME]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    previous = server.client.responses.create(model="tiny", input=messages[0]["content"], tools=tools,
                                              temperature=0, tool_choice={"type": "function", "name": "get_weather"},
                                              parallel_tool_calls=False)
    for step, (choice, result) in enumerate([("required", "18 C"), ("auto", "13:00")]):
        [call] = [i for i in previous.output if i.type == "function_call"]
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result}]
        current = server.client.responses.create(
            model="tiny", previous_response_id=previous.id, tools=tools, temperature=0, tool_choice=choice,
            parallel_tool_calls=False,
            max_output_tokens=120, input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])
        # (Under a salt of its own: it neither continues nor feeds the chain's session.)
        whole = server.client.chat.completions.create(model="tiny", messages=messages, tools=chat_tools,
                                                      max_tokens=1, extra_body={"cache_salt": "check"})
        assert current.usage.input_tokens == whole.usage.prompt_tokens, step  # nothing of the chain lost
        reused = current.usage.input_tokens_details.cached_tokens
        assert reused >= previous.usage.input_tokens + previous.usage.output_tokens - 1, step
        previous = current


def test_a_streamed_forced_call_arrives_as_deltas_that_add_up_to_the_call(server):
    from .test_tools import streamed_calls

    ask = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=0, parallel_tool_calls=False,
               tool_choice={"type": "function", "function": {"name": "get_time"}})
    content, calls, finish, pieces = streamed_calls(server.client.chat.completions.create(**ask, stream=True))
    whole = server.client.chat.completions.create(**ask).choices[0].message.tool_calls
    assert not content and finish == "tool_calls" and pieces > 1
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert valid(whole[0])


def test_the_responses_event_stream_gives_the_call_then_argument_deltas(server):
    stream = server.client.responses.create(model="tiny", input="Weather in Paris?", temperature=0, stream=True,
                                            tools=[{"type": "function", **WEATHER["function"]}],
                                            tool_choice={"type": "function", "name": "get_weather"})
    events = list(stream)
    kinds = [e.type for e in events]
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather" and added.item.arguments == ""
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 1 and "".join(deltas) == done.arguments
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta") < \
        kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    [item] = events[-1].response.output
    assert events[-1].type == "response.completed" and item.arguments == done.arguments
    assert json.loads(item.arguments)["city"] in CITY["enum"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


# Qwen's templates write a call as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, a newline between
# calls: a forced call is generated so (forced.call_layout), or the template would render it back otherwise and
# reuse would end at the call.
QWEN_STYLE = (
    "{% if tools %}<|system|>tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.get('tool_calls') %}{{ m['content'] or '' }}{% for c in m['tool_calls'] %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}{{ '}' }}\n</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_calls_are_forced_in_the_templates_own_layout_and_reused_whole():
    srv = Server(template=QWEN_STYLE, force=False)
    try:
        messages = list(ASK)
        first = srv.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                                   temperature=0, tool_choice="required")
        calls = first.choices[0].message.tool_calls
        assert calls and all(valid(c) for c in calls), calls
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "18 C"} for c in calls]
        second = srv.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                                    temperature=0, max_tokens=4)
        # The template renders the calls back as they were generated: the previous prompt and all of the reply.
        assert second.usage.prompt_tokens_details.cached_tokens >= \
            first.usage.prompt_tokens + first.usage.completion_tokens - 1
    finally:
        srv.close()


def test_parameters_refs_resolve_within_each_functions_schema(server):
    """`$defs` (pydantic's nested models) and a recursive `#` resolve in the function's own parameters: the call
    wrapper is not their root."""
    city = {"$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}}, "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"], "additionalProperties": False}
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}, "v": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
            "required": ["v"], "additionalProperties": False}

    def fits_tree(value) -> bool:
        return (isinstance(value, dict) and set(value) <= {"child", "v"} and type(value.get("v")) is int
                and 0 <= value["v"] <= 9 and ("child" not in value or fits_tree(value["child"])))

    tools = [{"type": "function", "function": {"name": "pick", "parameters": city}},
             {"type": "function", "function": {"name": "tree", "parameters": tree}}]
    for name, fits in (("pick", lambda a: a.get("city") in ("Paris", "Rome") and set(a) == {"city"}),
                       ("tree", fits_tree)):
        for seed in range(3):
            r = server.client.chat.completions.create(
                model="tiny", messages=ASK, tools=tools, temperature=1.0, seed=seed, max_tokens=300,
                tool_choice={"type": "function", "function": {"name": name}})
            [call] = r.choices[0].message.tool_calls
            assert call.function.name == name and fits(json.loads(call.function.arguments)), call


def test_a_reply_cut_in_a_call_is_length_and_keeps_its_complete_calls(server):
    """A reply cut by `max_tokens` in its last call: "length" (not "tool_calls"), its complete calls returned as
    calls, streamed or not; through Responses, an incomplete response."""
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=3)
    calls, full = [], None
    for seed in range(20):  # a reply of at least two calls
        full = server.client.chat.completions.create(**{**kw, "seed": seed})
        if len(full.choices[0].message.tool_calls) >= 2:
            kw["seed"] = seed
            break
    calls = full.choices[0].message.tool_calls
    assert len(calls) >= 2, "no reply of two calls in 20 seeds"
    cut = server.client.chat.completions.create(**kw, max_tokens=full.usage.completion_tokens - 4)
    choice = cut.choices[0]
    assert choice.finish_reason == "length"
    assert [c.function.arguments for c in choice.message.tool_calls] == [c.function.arguments for c in calls[:-1]]
    finish, streamed = None, {}
    for chunk in server.client.chat.completions.create(**kw, max_tokens=full.usage.completion_tokens - 4,
                                                       stream=True):
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed[piece.index] = streamed.get(piece.index, "") + (piece.function.arguments or "")
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert finish == "length"
    assert [streamed[i] for i in sorted(streamed)][:len(calls) - 1] == [c.function.arguments for c in calls[:-1]]
    flat = [{"type": "function", **tool["function"]} for tool in (WEATHER, TIME)]
    response = server.client.responses.create(model="tiny", input=ASK[0]["content"], tools=flat, temperature=0,
                                              tool_choice={"type": "function", "name": "get_time"},
                                              max_output_tokens=20)  # in the call's name
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
