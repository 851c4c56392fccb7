"""OpenAI's prompt-cache fields with the real `openai` client: ``prompt_cache_key`` names the session of the first
conversation under it (a key several conversations may share), within the request's ``cache_salt``, on chat
completions and the Responses API;
``prompt_cache_retention`` is checked, and both are counted in ``/metrics``."""

from __future__ import annotations

import openai
import pytest

from .test_tools import Server

ASK = [{"role": "user", "content": "Tell me about caches."}]


@pytest.fixture(scope="module")
def server():
    srv = Server()
    srv.answer("Caches keep things.")
    yield srv
    srv.close()


def chat(server, messages, **extra):
    raw = server.client.chat.completions.with_raw_response.create(model="tiny", messages=messages, **extra)
    return raw.headers["x-session-id"], raw.parse()


def test_the_key_names_the_session_and_the_next_turn_continues_it(server):
    session, first = chat(server, ASK, prompt_cache_key="agent-7")
    assert session == "agent-7" == first.model_extra["attnstore"]["session_id"]
    follow = ASK + [{"role": "assistant", "content": "Caches keep things."}, {"role": "user", "content": "More?"}]
    session, second = chat(server, follow, prompt_cache_key="agent-7")
    assert session == "agent-7"
    assert second.usage.prompt_tokens_details.cached_tokens >= \
        first.usage.prompt_tokens + first.usage.completion_tokens - 1
    # The header still names the session first; `user` comes after the key.
    session, _ = chat(server, ASK, prompt_cache_key="agent-7", user="someone",
                      extra_headers={"X-Session-ID": "from-header"})
    assert session == "from-header"
    session, _ = chat(server, ASK, prompt_cache_key="agent-8", user="someone")
    assert session == "agent-8"


def test_conversations_sharing_a_key_each_continue_their_own_session(server):
    # OpenAI's key is as often one per app or per user as one per conversation. Two conversations under one key,
    # turn by turn: each continues its own KV (the first names the key's session, the other is found by its ids),
    # instead of each overwriting the session the other left.
    conversations = [[{"role": "user", "content": f"Conversation {i}: tell me about caches, {i}."}] for i in (1, 2)]
    sessions = [[], []]
    for turn in range(3):
        for i, messages in enumerate(conversations):
            session, reply = chat(server, messages, prompt_cache_key="one-app", user="someone")
            sessions[i].append(session)
            if turn:  # the whole previous prompt and reply are reused, but the end-of-turn token
                assert reply.usage.prompt_tokens_details.cached_tokens >= last[i] - 1, (turn, i)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"More, {turn}?"}]
            last = last if turn else [0, 0]
            last[i] = reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert sessions[0] == ["one-app"] * 3  # the first conversation under the key has its session
    assert len(set(sessions[1])) == 1 and sessions[1][0] != "one-app"


def test_the_key_is_scoped_by_the_salt(server):
    _, first = chat(server, ASK, prompt_cache_key="shared", extra_body={"cache_salt": "tenant-a"})
    _, same = chat(server, ASK, prompt_cache_key="shared", extra_body={"cache_salt": "tenant-a"})
    _, other = chat(server, ASK, prompt_cache_key="shared", extra_body={"cache_salt": "tenant-b"})
    assert same.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_the_key_names_the_session_of_a_response(server):
    raw = server.client.responses.with_raw_response.create(model="tiny", input="hi", prompt_cache_key="resp-agent",
                                                           prompt_cache_retention="24h")
    assert raw.headers["x-session-id"] == "resp-agent"


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"prompt_cache_key": "x" * 10_000}, "prompt_cache_key"),
    ("/v1/chat/completions", {"prompt_cache_key": "tab\tinside"}, "prompt_cache_key"),
    ("/v1/chat/completions", {"prompt_cache_key": 7}, "prompt_cache_key"),
    ("/v1/chat/completions", {"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ("/v1/responses", {"prompt_cache_key": "x" * 10_000}, "prompt_cache_key"),
    ("/v1/responses", {"prompt_cache_retention": "1h"}, "prompt_cache_retention"),
])
def test_bad_prompt_cache_fields_are_400s_naming_them(server, path, extra, param):
    body = {"model": "tiny", **({"messages": ASK} if "chat" in path else {"input": "hi"}), **extra}
    r = server.http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_both_fields_are_counted_in_metrics(server):
    def scrape() -> dict[str, float]:
        lines = server.http.get("/metrics").text.splitlines()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
                if line.startswith(("attnstore_prompt_cache", "attnstore_store_retained")) and not line.startswith("#")}

    before = scrape()
    chat(server, ASK, prompt_cache_key="counted", prompt_cache_retention="24h")
    chat(server, ASK, prompt_cache_retention="in_memory")
    after = scrape()
    key, day = "attnstore_prompt_cache_key_requests_total", 'attnstore_prompt_cache_retention_requests_total{retention="24h"}'
    mem = 'attnstore_prompt_cache_retention_requests_total{retention="in_memory"}'
    assert after[key] - before.get(key, 0) == 1
    assert after[day] - before.get(day, 0) == 1 and after[mem] - before.get(mem, 0) == 1
    # "24h" kept the session from expiring by idleness; nothing took it since.
    assert after["attnstore_store_retained_sessions"] >= 1 and after["attnstore_store_retained_dropped_total"] == 0
