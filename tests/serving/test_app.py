"""The HTTP API in-process (FastAPI's TestClient): multi-turn reuse, streaming, errors, overload, metrics."""

from __future__ import annotations

import json
import threading

from fastapi.testclient import TestClient
from transformers import LogitsProcessor, LogitsProcessorList

from hf_attnstore import AttnStore
from hf_attnstore.serving.pipeline import ChatPipeline
from hf_attnstore.serving import ChatEngine, create_app

from ..conftest import char_tokenizer, make_tiny
from .helpers import ForceReply, bpe_tokenizer

GREEDY = {"temperature": 0, "max_tokens": 6}


def make_client(store=True, tokenizer=None, max_pending=64, context_window=None, max_batch_size=1, **generate):
    model, tok = make_tiny("llama"), tokenizer or char_tokenizer()
    store = AttnStore("16MiB") if store else None
    pipe = ChatPipeline(model, tok, store, max_new_tokens=8, context_window=context_window,
                        max_batch_size=max_batch_size, **generate)
    engine = ChatEngine(pipe, max_pending=max_pending)
    return TestClient(create_app(engine, "tiny", default_max_tokens=8)), pipe, store


def close(pipe, store):
    pipe.close(timeout=60)
    if store is not None:
        store.close()


def chat(client, messages, headers=None, **extra):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, **GREEDY, **extra},
                    headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_conversation_resent_by_the_client_reuses_everything_and_matches_recomputation():
    client, pipe, store = make_client()
    plain, plain_pipe, _ = make_client(store=False)
    messages, previous = [{"role": "system", "content": "short answers"}], None
    for k in range(4):
        messages.append({"role": "user", "content": f"question {k}: " + "why " * k})
        got, expected = chat(client, messages), chat(plain, messages)
        assert got["choices"][0]["message"] == expected["choices"][0]["message"], k
        usage = got["usage"]
        assert usage["prompt_tokens"] == expected["usage"]["prompt_tokens"]
        if previous is None:
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and got["attnstore"]["kv_source"] == "miss"
            session = got["attnstore"]["session_id"]
        else:
            # Found without a session id; all of the previous prompt and reply reused (a reply cut by
            # max_tokens has its last token stored too; one that ended on <|end|> gets it from the template).
            stop = previous["choices"][0]["finish_reason"] == "stop"
            assert got["attnstore"]["session_id"] == session and got["attnstore"]["kv_source"] == "host"
            assert usage["prompt_tokens_details"]["cached_tokens"] == (
                previous["usage"]["prompt_tokens"] + previous["usage"]["completion_tokens"] - stop)
        messages.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})
        previous = got
    close(pipe, store)
    close(plain_pipe, None)


def test_a_reply_that_re_tokenizes_differently_is_still_reused_whole():
    tok = bpe_tokenizer()
    a = tok.convert_tokens_to_ids("a")
    client, pipe, store = make_client(tokenizer=tok,
                                      logits_processor=LogitsProcessorList([ForceReply(tok, [a, a, a, a])]))
    messages = [{"role": "user", "content": "say aaaa"}]
    first = chat(client, messages)
    assert first["choices"][0]["message"]["content"] == "aaaa" and first["usage"]["completion_tokens"] == 5
    assert len(tok("aaaa", add_special_tokens=False)["input_ids"]) == 2  # re-tokenized: two merged tokens
    messages += [{"role": "assistant", "content": "aaaa"}, {"role": "user", "content": "again"}]
    second = chat(client, messages)
    # The prompt, the four generated "a" and <|end|>: everything before the new user message.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] + 4
    close(pipe, store)


def test_streaming_sends_the_same_reply_and_ends_with_done():
    client, pipe, store = make_client()
    messages = [{"role": "user", "content": "stream me"}]
    whole = chat(client, messages, headers={"X-Session-ID": "one"})
    assert whole["attnstore"]["session_id"] == "one"
    body = {"model": "tiny", "messages": messages, "stream": True, "stream_options": {"include_usage": True}, **GREEDY}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-ID": "two"}) as r:
        assert r.status_code == 200 and r.headers["x-session-id"] == "two"
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    close(pipe, store)


def test_bad_requests_get_openai_style_errors():
    client, pipe, store = make_client()
    ok = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(content=b"{not json", headers={"Content-Type": "application/json"}), 400, "not valid JSON"),
        (dict(content=b"plain text"), 400, "JSON object"),
        (dict(json={"model": "tiny"}), 400, "messages"),
        (dict(json={"model": "tiny", "messages": []}), 400, "messages"),
        (dict(json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}), 400, "role"),
        (dict(json={"model": "tiny", "messages": ok + [{"role": "assistant", "content": "x"}]}), 400, "last message"),
        (dict(json={"model": "tiny", "messages": ok, "n": 2, "stream": True}), 400, "`n`"),
        (dict(json={"model": "tiny", "messages": ok, "max_tokens": 0}), 400, "max_tokens"),
        (dict(json={"model": "tiny", "messages": ok, "temperature": 9}), 400, "temperature"),
        (dict(json={"model": "gpt-4", "messages": ok}), 404, "not served here"),
    ]
    for kwargs, status, words in cases:
        r = client.post("/v1/chat/completions", **kwargs)
        assert r.status_code == status, (kwargs, r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["type"], (kwargs, error)
    metrics = client.get("/metrics").text
    assert 'attnstore_request_errors_total{status="400"} 9.0' in metrics
    assert chat(client, ok)["choices"][0]["message"]["content"] is not None  # still serving
    close(pipe, store)


class Gate(LogitsProcessor):
    """Holds a turn at its first decoding step until released: a server that is busy, deterministically."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores):
        self.entered.set()
        assert self.release.wait(30), "the test never released the gate"
        return scores


def test_a_full_server_answers_429_and_recovers():
    gate = Gate()
    client, pipe, store = make_client(max_pending=1, logits_processor=LogitsProcessorList([gate]))
    results = []
    first = threading.Thread(target=lambda: results.append(chat(client, [{"role": "user", "content": "slow"}])))
    first.start()
    assert gate.entered.wait(30)
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
    gate.release.set()
    first.join(60)
    assert len(results) == 1
    assert client.get("/health").json()["pending"] == 0
    assert chat(client, [{"role": "user", "content": "now"}])  # room again
    close(pipe, store)


def test_concurrent_requests_on_one_session_are_serialized():
    client, pipe, store = make_client()
    messages = [{"role": "user", "content": "same session"}]
    results = []
    threads = [threading.Thread(target=lambda: results.append(chat(client, messages, headers={"X-Session-ID": "s"})))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    texts = {r["choices"][0]["message"]["content"] for r in results}
    assert len(results) == 3 and len(texts) == 1  # the same prompt, the same greedy reply, each turn whole
    assert sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in results) == 2
    close(pipe, store)


def test_a_conversation_over_the_context_window_is_truncated_and_reported():
    client, pipe, store = make_client(context_window=64)
    messages = [{"role": "user", "content": "long " * 10}]
    for _ in range(3):
        got = chat(client, messages)
        messages += [{"role": "assistant", "content": got["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "more " * 6}]
    got = chat(client, messages)
    info = got["attnstore"]
    assert got["usage"]["prompt_tokens"] > 64 and info["kv_source"] == "truncated" and info["dropped_tokens"] > 0
    assert info["reused_tokens"] > 0 and info["reused_tokens"] + info["prefilled_tokens"] <= 64  # the window
    close(pipe, store)


def test_models_health_and_metrics():
    client, pipe, store = make_client()
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/health").json()["status"] == "ok"
    messages = [{"role": "user", "content": "count me"}]
    first = chat(client, messages)
    chat(client, messages + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "again"}])
    text = client.get("/metrics").text
    for line in ('attnstore_turns_total{kv_source="miss"} 1.0', 'attnstore_turns_total{kv_source="host"} 1.0',
                 'attnstore_store_hits_total{tier="host"} 1.0', "attnstore_ttft_seconds_count 2.0",
                 'attnstore_store_bytes_limit{tier="host"}', "attnstore_queue_depth 0.0",
                 "attnstore_store_resume_decisions_total 0.0", 'attnstore_store_resume_last{value="chosen_s"} 0.0',
                 "attnstore_batch_members 0.0", 'attnstore_batch_kv_bytes{kind="live"} 0.0'):
        assert line in text, line
    reused = next(float(x.split()[-1]) for x in text.splitlines() if x.startswith('attnstore_tokens_total{kind="reused"}'))
    assert reused > 0
    close(pipe, store)


def test_concurrent_conversations_on_a_batching_server_match_one_at_a_time():
    client, pipe, store = make_client(max_batch_size=4)
    plain, plain_pipe, _ = make_client(store=False)

    def conversation(u: int, out: dict) -> None:
        messages = []
        for k in range(3):
            messages.append({"role": "user", "content": f"user {u} turn {k} " + "la " * (u + k)})
            got = chat(client, messages)
            out[(u, k)] = got
            messages.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})

    results: dict = {}
    threads = [threading.Thread(target=conversation, args=(u, results)) for u in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 12
    for u in range(4):
        messages = []
        for k in range(3):
            messages.append({"role": "user", "content": f"user {u} turn {k} " + "la " * (u + k)})
            expected = chat(plain, messages)["choices"][0]["message"]["content"]
            assert results[(u, k)]["choices"][0]["message"]["content"] == expected, (u, k)
            if k:
                assert results[(u, k)]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            messages.append({"role": "assistant", "content": expected})
    close(pipe, store)
    close(plain_pipe, None)


def test_metrics_count_the_remote_tier(tmp_path):
    from hf_attnstore.lab.redis_server import RedisServer

    with RedisServer(tmp_path / "redis") as server:
        model, tok = make_tiny("llama"), char_tokenizer()
        store = AttnStore("16MiB", remote=server.url, fsync=False)  # Redis below host memory
        pipe = ChatPipeline(model, tok, store, max_new_tokens=8)
        client = TestClient(create_app(ChatEngine(pipe), "tiny"))
        chat(client, [{"role": "user", "content": "remember me"}])
        store.flush()
        text = client.get("/metrics").text
        written = next(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith('attnstore_store_bytes_total{direction="write",tier="remote"}'))
        assert written > 0 and 'attnstore_store_errors_total{kind="remote"} 0.0' in text
        assert "attnstore_store_remote_up 1.0" in text and client.get("/health").json()["remote"] == "up"
        close(pipe, store)


def test_a_server_starts_while_redis_is_down_serves_and_says_so(tmp_path, monkeypatch):
    """A cache is an accelerator: with Redis down the server starts, answers (misses), and /health and
    /metrics say the remote tier is down until it is reconnected in the background."""
    import time

    from hf_attnstore.store.tiers import redis as remote_module
    from hf_attnstore.lab.redis_server import RedisServer

    monkeypatch.setattr(remote_module, "BACKOFF_S", 0.1)
    server = RedisServer(tmp_path / "redis")  # not started
    model, tok = make_tiny("llama"), char_tokenizer()
    store = AttnStore("16MiB", tmp_path / "kv", remote=server.url, fsync=False)
    pipe = ChatPipeline(model, tok, store, max_new_tokens=8)
    client = TestClient(create_app(ChatEngine(pipe), "tiny"))
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["remote"] == "down"
    assert chat(client, [{"role": "user", "content": "remember me"}])["choices"][0]["message"]["content"]
    text = client.get("/metrics").text
    assert "attnstore_store_remote_up 0.0" in text and 'attnstore_store_errors_total{kind="remote"} 1.0' in text
    with server:
        deadline = time.monotonic() + 20
        while client.get("/health").json()["remote"] != "up" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.get("/health").json()["remote"] == "up"
        assert "attnstore_store_remote_up 1.0" in client.get("/metrics").text
        close(pipe, store)


def test_a_seed_gives_the_same_sampled_reply_alone_or_batched():
    """OpenAI's `seed`: the same sampled reply for the same seed, on a batch-1 and a batching server (the turn's
    own random numbers, drawn as `generate` draws them), and another seed another reply."""
    messages = [{"role": "user", "content": "sample something for me"}]
    replies = {}
    for batch in (1, 4):
        client, pipe, store = make_client(max_batch_size=batch)
        for seed in (11, 12):
            replies[(batch, seed)] = chat(client, messages, temperature=1.5, seed=seed, max_tokens=8,
                                          user=f"u{seed}")["choices"][0]["message"]["content"]
        close(pipe, store)
    assert replies[(1, 11)] == replies[(4, 11)] and replies[(1, 12)] == replies[(4, 12)]
    assert replies[(1, 11)] != replies[(1, 12)]


def test_penalties_logit_bias_and_top_k_are_honoured_alone_and_batched():
    """OpenAI's `frequency_penalty`, `presence_penalty` and `logit_bias` change the reply, identically on a
    batch-1 and a batching server (their processors go through `generate`'s construction in both)."""
    messages = [{"role": "user", "content": "say something long"}]
    tok = char_tokenizer()
    z = tok.convert_tokens_to_ids("z")
    asks = {"plain": {}, "penalties": dict(frequency_penalty=2.0, presence_penalty=2.0),
            "bias": dict(logit_bias={str(z): 100}), "top_k": dict(temperature=1.0, top_k=1, seed=3)}
    got = {}
    for batch in (1, 4):
        client, pipe, store = make_client(max_batch_size=batch)
        for name, extra in asks.items():
            got[(batch, name)] = chat(client, messages, user=f"{name}-{batch}", max_tokens=8,
                                      **extra)["choices"][0]["message"]["content"]
        close(pipe, store)
    for name in asks:
        assert got[(1, name)] == got[(4, name)], name
    assert got[(1, "penalties")] != got[(1, "plain")]
    assert got[(1, "bias")] == "z" * 8  # +100 on one token: it wins every step
    assert got[(1, "top_k")] == got[(1, "plain")]  # top_k=1 sampling is greedy


def test_fields_that_would_change_the_answer_are_refused_by_name_when_not_implemented():
    client, pipe, store = make_client()
    ok = [{"role": "user", "content": "hi"}]
    cases = [
        # (json_object and json_schema are honoured, even with this character tokenizer: test_structured.py.)
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
         "response_format"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"top_k": 0}, "top_k"),
        ({"seed": 2**64}, "seed"),
    ]
    for extra, field in cases:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": ok, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == field, (extra, r.json())
    assert chat(client, ok, response_format={"type": "text"})["choices"][0]["message"]["content"] is not None
    close(pipe, store)


def test_n_samples_share_the_prompt_and_each_can_be_continued():
    """`n` > 1: each sample is a turn of its own whose prompt comes from the first one's stored KV (batch 1: the
    whole prompt; batching: every whole 64-token block the first one stored before the others' prefill), seeded
    samples differ and repeat, and the client's next request continues the sample it kept."""
    long = [{"role": "user", "content": "tell me a story about " + "a long day at sea, " * 8}]
    for batch in (1, 4):
        client, pipe, store = make_client(max_batch_size=batch)
        body = {"model": "tiny", "messages": long, "temperature": 1.0, "seed": 7, "n": 3, "max_tokens": 6}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        texts = [c["message"]["content"] for c in out["choices"]]
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert len(set(texts)) > 1  # seeds 7, 8, 9
        assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == texts[0]
        prompt = out["usage"]["prompt_tokens"]
        shared = out["attnstore"]["samples_reused_tokens"]
        if batch == 1:
            assert shared == [prompt - 1, prompt - 1]  # all but the last token, which is recomputed for its logits
        else:
            assert all(n >= 64 * ((prompt - 1) // 64) for n in shared), shared
        assert out["usage"]["completion_tokens"] <= 18  # every sample's tokens, the prompt counted once
        # The client keeps the second sample and goes on: its session is found and reused whole.
        kept = long + [{"role": "assistant", "content": texts[1]}, {"role": "user", "content": "and then?"}]
        nxt = chat(client, kept)
        assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt + 1
        close(pipe, store)
    client, pipe, store = make_client()
    for extra in ({"n": 2, "stream": True}, {"n": 9}, {"n": 0}):
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": long, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", (extra, r.text)
    close(pipe, store)
