"""Issue 46's "done when", with the bundled SmolLM2 served as `attnstore serve --chat-template
examples/templates/chatml_tools.jinja --response-template examples/templates/hermes_response.json` builds it, through
the real `openai` client: a named ``tool_choice`` returns a schema-valid call of that function, ``"required"`` at
least one valid call, sending the call and its result back reuses at least 90% of the previous prompt (chat
completions and a Responses chain), and streamed calls arrive as deltas that add up to the final arguments."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from hf_attnstore.cli import build_parser, build_server

pytestmark = pytest.mark.integration  # the bundled model's weights

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "templates"
UNITS = {"type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": UNITS},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client():
    args = build_parser().parse_args(["serve", "--max-tokens", "96",
                                      "--chat-template", str(EXAMPLES / "chatml_tools.jinja"),
                                      "--response-template", str(EXAMPLES / "hermes_response.json")])
    server = build_server(args)
    try:
        with TestClient(server.app) as http:
            yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0), \
                server.name
    finally:
        server.close()


def valid(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "get_weather":
        return set(args) == {"city", "unit"} and args["unit"] in UNITS["enum"] and len(args["city"]) <= 20
    return name == "get_time" and set(args) == {"city"} and len(args["city"]) <= 20


def test_named_and_required_calls_and_the_round_trip_reuse(client):
    api, model = client
    named = api.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and valid(call.function.name, call.function.arguments)
    required = api.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                           tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert calls and all(valid(c.function.name, c.function.arguments) for c in calls)
    messages = ASK + [required.choices[0].message.model_dump(exclude_none=True)] + \
        [{"role": "tool", "tool_call_id": c.id, "content": "18 C, sunny"} for c in calls]
    answer = api.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], temperature=0,
                                         max_tokens=16)
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.9 * required.usage.prompt_tokens  # the bar
    assert cached >= required.usage.prompt_tokens + required.usage.completion_tokens - 1  # in fact: all of it


def test_a_responses_chain_reuses_the_kv_through_the_tool_pause(client):
    api, model = client
    tools = [{"type": "function", **WEATHER["function"]}]
    first = api.responses.create(model=model, input=ASK[0]["content"], tools=tools, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"})
    [call] = [i for i in first.output if i.type == "function_call"]
    assert valid(call.name, call.arguments)
    second = api.responses.create(model=model, previous_response_id=first.id, tools=tools, temperature=0,
                                  max_output_tokens=16,
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": "18 C, sunny"}])
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 0.9 * first.usage.input_tokens  # the bar
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 1  # in fact: all of it


def test_streamed_calls_add_up_to_the_final_arguments(client):
    api, model = client
    ask = dict(model=model, messages=ASK, tools=[WEATHER], temperature=0, tool_choice="required",
               parallel_tool_calls=False)
    first, arguments, pieces = None, "", 0
    for chunk in api.chat.completions.create(**ask, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.id is not None:
                first = delta
            else:
                arguments += delta.function.arguments
                pieces += 1
    whole = api.chat.completions.create(**ask).choices[0].message.tool_calls[0]
    assert first.function.name == whole.function.name and pieces > 1
    assert arguments == whole.function.arguments and valid(whole.function.name, arguments)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Count from 1 to 5."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "x"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
])
def test_the_tools_template_renders_a_chat_without_tools_as_the_models_own(smollm2, messages):
    """Without tools, chatml_tools.jinja is SmolLM2's own template, its default system prompt included (without it
    the 135M model ran "Count from 1 to 5." on to the token cap: the compliance suite's streaming test)."""
    _, tokenizer = smollm2
    template = (EXAMPLES / "chatml_tools.jinja").read_text()
    own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=template) == own
