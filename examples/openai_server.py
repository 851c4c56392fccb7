"""The OpenAI-compatible server with the `openai` client: a three-turn conversation, each turn resent whole; a
Responses API chain by `previous_response_id`; a reply constrained to a JSON schema.

    python examples/openai_server.py                          # starts `attnstore serve` itself
    python examples/openai_server.py --url http://127.0.0.1:8000/v1   # or talks to a running one

The client sends the whole message list each turn, as OpenAI clients do; the server finds the stored session
the messages continue and reports the reused tokens in `usage.prompt_tokens_details.cached_tokens`.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

import openai

parser = argparse.ArgumentParser()
parser.add_argument("--url", default=None, help="a running server's base URL (default: start one)")
parser.add_argument("--port", type=int, default=8765)
args = parser.parse_args()

server = None
url = args.url
if url is None:
    server = subprocess.Popen([sys.executable, "-m", "hf_attnstore", "serve", "--port", str(args.port)],
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{args.port}/v1"
    deadline = time.monotonic() + 300
    while True:  # wait until it answers /health
        try:
            urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
try:
    client = openai.OpenAI(base_url=url, api_key="not-needed")
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "You answer in one short sentence."}]
    for question in ["What is Redis?", "And what is a cache?", "Which one would you use for sessions?"]:
        messages.append({"role": "user", "content": question})
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        cached = usage.prompt_tokens_details.cached_tokens
        print(f"[cached {cached}/{usage.prompt_tokens} prompt tokens] {text!r}")
        messages.append({"role": "assistant", "content": text})
    assert cached > 0, "the last turn should reuse the conversation's KV"

    # The Responses API keeps the conversation on the server: each request sends only what is new.
    first = client.responses.create(model=model, input="Name a fruit.", instructions="Answer in one word.",
                                    max_output_tokens=16, temperature=0)
    then = client.responses.create(model=model, input="And a vegetable?", instructions="Answer in one word.",
                                   previous_response_id=first.id, max_output_tokens=16, temperature=0)
    details = then.usage.input_tokens_details
    print(f"[responses: cached {details.cached_tokens}/{then.usage.input_tokens}] {first.output_text!r} "
          f"-> {then.output_text!r}")
    assert details.cached_tokens > first.usage.input_tokens, "the chain should reuse the first response's KV"

    # Structured output (llguidance): the reply is JSON for the schema by construction.
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a capital city and its country."}], temperature=0,
        max_tokens=48, response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    place = json.loads(reply.choices[0].message.content)
    print(f"[json_schema] {place}")
    assert set(place) == {"city", "country"}
finally:
    if server is not None:
        server.terminate()
        server.wait(60)
