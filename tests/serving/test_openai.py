"""`attnstore serve`'s app over real HTTP (uvicorn on a free port) with the `openai` client: multi-turn reuse,
streaming, and a client that disconnects mid-stream (its turn is cancelled, the store stays consistent)."""

from __future__ import annotations

import threading
import time
import urllib.request

import openai
import pytest
import uvicorn
from transformers import LogitsProcessor, LogitsProcessorList

from hf_attnstore import AttnStore
from hf_attnstore.serving.pipeline import ChatPipeline
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.lab.redis_server import free_port

from ..conftest import char_tokenizer, make_tiny


class Slow(LogitsProcessor):
    """Each decoding step takes `delay` seconds (time for a client to go away mid-reply); counts the steps."""

    def __init__(self, delay: float):
        self.delay, self.steps = delay, 0

    def __call__(self, input_ids, scores):
        self.steps += 1
        time.sleep(self.delay)
        return scores


@pytest.fixture
def server():
    """A live server; yields (base_url, pipeline, store, slow-step processor)."""
    slow = Slow(0.0)
    model, tok = make_tiny("llama"), char_tokenizer()
    store = AttnStore("16MiB")
    pipe = ChatPipeline(model, tok, store, max_new_tokens=8, logits_processor=LogitsProcessorList([slow]))
    app = create_app(ChatEngine(pipe), "tiny")
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", pipe, store, slow
    srv.should_exit = True
    thread.join(30)
    pipe.close(timeout=60)
    store.close()


def test_the_openai_client_chats_over_several_turns_with_reuse(server):
    url, pipe, store, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
    assert [m.id for m in client.models.list()] == ["tiny"]
    messages = [{"role": "user", "content": "first question"}]
    cached = []
    for k in range(3):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"follow-up {k}"}]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                           extra_headers={"X-Session-ID": "explicit"})
    assert text == again.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=messages)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])


def test_a_client_that_disconnects_mid_stream_cancels_its_turn(server):
    url, pipe, store, slow = server
    slow.delay = 0.2  # 8 steps would take 1.6 s
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
    messages = [{"role": "user", "content": "tell me a long story"}]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
                                            extra_headers={"X-Session-ID": "gone"})
    next(iter(stream))  # the first event (the role: it may come before the prompt is computed)
    deadline = time.monotonic() + 30
    while slow.steps < 1:  # the first step's logits: the prompt's KV has been computed
        assert time.monotonic() < deadline, "no step was generated"
        time.sleep(0.01)
    stream.close()  # then the client goes away

    def cancelled() -> bool:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        return "attnstore_cancelled_turns_total 1.0" in text

    deadline = time.monotonic() + 30
    while not cancelled():
        assert time.monotonic() < deadline, "the turn was not cancelled"
        time.sleep(0.1)
    assert slow.steps < 8  # stopped early
    slow.delay = 0.0
    # The store is consistent: the session serves its next turn, reusing what the cancelled turn computed.
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                           extra_headers={"X-Session-ID": "gone"})
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
