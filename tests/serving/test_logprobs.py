"""Log-probabilities over HTTP with the real `openai` client: the raw model distribution's (vLLM's default),
the same alone and batched, streamed with the last chunk, in chat completions and completions."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from hf_attnstore import AttnStore
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.serving.pipeline import ChatPipeline

from ..conftest import char_tokenizer, make_tiny

MESSAGES = [{"role": "user", "content": "say something"}]


def serve(batch: int):
    tok, store = char_tokenizer(), AttnStore("16MiB")
    pipe = ChatPipeline(make_tiny("llama"), tok, store, max_new_tokens=8, max_batch_size=batch)
    http = TestClient(create_app(ChatEngine(pipe), "tiny", default_max_tokens=8))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    return client, http, tok, pipe, store


@pytest.fixture
def server():
    out = serve(1)
    yield out
    out[3].close(timeout=60)
    out[4].close()


def test_chat_logprobs_are_the_models_and_agree_with_the_content(server):
    client, _, tok, pipe, _ = server
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode())
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)  # greedy: the most likely token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    # The first token's log-probability from the model itself, on the same prompt.
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        logits = pipe.model(prompt["input_ids"]).logits[0, -1]
    want = torch.log_softmax(logits.float(), -1)[tok.convert_tokens_to_ids(content[0].token)].item()
    assert math.isclose(content[0].logprob, want, abs_tol=1e-4)


def test_logprobs_are_the_same_alone_batched_and_streamed(server):
    client = server[0]
    ask = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
    alone = client.chat.completions.create(**ask).choices[0].logprobs.content
    batched_server = serve(4)
    try:
        batched = batched_server[0].chat.completions.create(**ask).choices[0].logprobs.content
    finally:
        batched_server[3].close(timeout=60)
        batched_server[4].close()
    assert [t.token for t in alone] == [t.token for t in batched]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(alone, batched))
    streamed = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices and c.choices[0].logprobs]
    assert len(streamed) == 1  # all of them with the last chunk
    assert [t.token for t in streamed[0].choices[0].logprobs.content] == [t.token for t in alone]
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=6)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs(server):
    client = server[0]
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text[len("Hello"):]
    assert lp.text_offset[0] == len("Hello") if lp.tokens else True
    assert all(len(top) <= 2 for top in lp.top_logprobs) and len(lp.token_logprobs) == len(lp.tokens)


def test_bad_logprobs_requests_are_400s(server):
    http = server[1]
    for path, body, param in [
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ]:
        r = http.post(path, json={"model": "tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
