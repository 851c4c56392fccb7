"""`POST /v1/completions` with the real `openai` client (in-process): text and token-id prompts, reuse of a
prompt that continues a stored one, streaming, echo, and bad requests as 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from hf_attnstore import AttnStore
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.serving.pipeline import ChatPipeline

from ..conftest import char_tokenizer, make_tiny


@pytest.fixture
def server():
    tok = char_tokenizer()
    store = AttnStore("16MiB")
    pipe = ChatPipeline(make_tiny("llama"), tok, store, max_new_tokens=8, context_window=200)
    http = TestClient(create_app(ChatEngine(pipe), "tiny", default_max_tokens=8))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    yield client, http, tok, pipe
    pipe.close(timeout=60)
    store.close()


def test_a_prompt_that_continues_a_stored_one_reuses_it_and_matches_recomputation(server):
    client, _, tok, pipe = server
    ids = tok("Once upon a time", add_special_tokens=False)["input_ids"]
    # A strong bias makes the reply text ("zzzzzz"; a random model's own may be special tokens, which its text
    # does not show), so that the client can append it and go on.
    bias = {str(tok.convert_tokens_to_ids("z")): 100}
    first = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logit_bias=bias)
    assert first.object == "text_completion" and first.usage.prompt_tokens == len(ids)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    generated = tok(first.choices[0].text, add_special_tokens=False)["input_ids"]
    more = ids + generated + tok(" then", add_special_tokens=False)["input_ids"]
    second = client.completions.create(model="tiny", prompt=more, max_tokens=6, temperature=0)
    assert first.choices[0].text == "zzzzzz"
    assert second.usage.prompt_tokens_details.cached_tokens == len(ids) + len(generated)
    # The same prompt with no store: the same completion (reuse is exact).
    plain = ChatPipeline(pipe.model, tok, None, max_new_tokens=8)
    try:
        http = TestClient(create_app(ChatEngine(plain), "tiny", default_max_tokens=8))
        fresh = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        assert fresh.completions.create(model="tiny", prompt=more, max_tokens=6,
                                        temperature=0).choices[0].text == second.choices[0].text
    finally:
        plain.close(timeout=60)


def test_text_prompts_streaming_and_echo(server):
    client, _, _, _ = server
    whole = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    echoed = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello" + whole.choices[0].text
    # A list of one prompt is that prompt.
    assert client.completions.create(model="tiny", prompt=["Hello"], max_tokens=5,
                                     temperature=0).choices[0].text == whole.choices[0].text


@pytest.mark.parametrize("extra, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": "x" * 190, "max_tokens": 20}, "prompt"),  # over the 200-token window together
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 6}, "logprobs"),
    ({"suffix": "end"}, "suffix"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"user": "bad\x00id"}, "user"),
])
def test_bad_requests_are_400s_naming_the_field(server, extra, param):
    _, http, _, _ = server
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_lone_surrogate_in_a_prompt_or_stop_is_a_400(server):
    _, http, _, _ = server
    for body, param in (({"prompt": "a\ud800"}, "prompt"), ({"prompt": "a", "stop": ["\udc00"]}, "stop")):
        r = http.post("/v1/completions", content=json.dumps({"model": "tiny", **body}),  # escaped: \ud800
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
