"""Issue 58's "done when": the OpenAI Agents SDK (`openai-agents`) runs a 3-step tool loop against `attnstore
serve` over real HTTP (uvicorn on a free port, the bundled SmolLM2 served with `--chat-template
examples/templates/chatml_tools.jinja` alone: its hermes calls are recognised, no parser flag), through the SDK's
chat-completions model and its Responses model, each with its default settings but for the agent forcing tool calls
(``tool_choice="required"``, parallel calls allowed: the setting whose replies used to run to the token limit), and
each step reuses the previous step's prompt (at least 90% of it cached)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import agents
import pytest
import uvicorn

from hf_attnstore.cli import build_parser, build_server
from hf_attnstore.lab.redis_server import free_port

pytestmark = pytest.mark.integration  # the bundled model's weights

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "templates"
ASK = "What is the weather in Paris, and the local time there?"


@pytest.fixture(scope="module")
def served():
    """(base URL, model name) of a live server."""
    server = build_server(build_parser().parse_args(["serve", "--max-tokens", "256",
                                                     "--chat-template", str(EXAMPLES / "chatml_tools.jinja")]))
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not http.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1", server.name
    finally:
        http.should_exit = True
        thread.join(60)
        server.close()


@pytest.mark.parametrize("model_class", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_an_agent_runs_a_three_step_tool_loop_and_each_step_reuses_the_last(served, model_class):
    from openai import AsyncOpenAI

    url, name = served
    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    called: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(("get_weather", city))
        return f"18 C and sunny in {city}"

    @agents.function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        called.append(("get_time", city))
        return "13:00"

    steps: list[list[str]] = []

    def after_three_steps(context, results) -> agents.ToolsToFinalOutputResult:
        """The loop's end: the third step's tool results are the agent's answer."""
        steps.append([r.tool.name for r in results])
        done = len(steps) == 3
        return agents.ToolsToFinalOutputResult(is_final_output=done, final_output=results[-1].output if done else None)

    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="You answer questions about the weather. Use the tools.",
        model=getattr(agents, model_class)(model=name, openai_client=client), tools=[get_weather, get_time],
        model_settings=agents.ModelSettings(tool_choice="required"), reset_tool_choice=False,
        tool_use_behavior=after_three_steps)
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=4))
    assert len(steps) == 3 and len(result.raw_responses) == 3 and all(steps), steps
    assert called and all(tool in ("get_weather", "get_time") and city for tool, city in called), called
    usage = [r.usage for r in result.raw_responses]
    for before, after in zip(usage, usage[1:]):
        # The previous step's prompt, its calls and their results are the next prompt's start.
        assert after.input_tokens > before.input_tokens
        assert after.input_tokens_details.cached_tokens >= 0.9 * before.input_tokens, usage
