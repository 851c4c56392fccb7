"""Prefix sharing over HTTP: a regenerated reply, an edited question and a new conversation over the same
system prompt reuse their common prefix with stored conversations (reported in ``cached_tokens``), exactly and
without touching those conversations; ``cache_salt`` scopes all of it."""

from __future__ import annotations

from .test_app import chat, close, make_client

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers briefly. " * 5}


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_regenerate_edit_and_a_new_conversation_reuse_the_common_prefix_exactly():
    client, pipe, store = make_client()
    plain, plain_pipe, _ = make_client(store=False)
    tokens = client.app.state.engine.tokens
    first = [SYSTEM, {"role": "user", "content": "what is a cache?"}]
    original = chat(client, first)
    session = original["attnstore"]["session_id"]
    assert original["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ids = tokens.prompt_ids(first)
    cases = {
        "regenerate": first,
        "edit": [SYSTEM, {"role": "user", "content": "what is a cache line?"}],
        "new conversation": [SYSTEM, {"role": "user", "content": "tell me about trees"}],
    }
    sessions = {}
    for name, messages in cases.items():
        got, expected = chat(client, messages), chat(plain, messages)
        sessions[name] = got["attnstore"]["session_id"]
        assert got["choices"][0]["message"] == expected["choices"][0]["message"], name  # exact reuse
        pipe_ids = tokens.prompt_ids(messages)
        # All of the prefix shared with the stored conversation, but the one token a turn must feed.
        shared = min(common(ids, pipe_ids), len(pipe_ids) - 1)
        assert shared > len(tokens.prompt_ids([SYSTEM])) - 8, name
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == shared, name
        assert got["attnstore"]["reused_tokens"] == shared and got["attnstore"]["kv_source"] == "host", name
        assert got["attnstore"]["session_id"] != session, name  # its own history: never the other's
    # The original conversation goes on, unchanged by the others: all of its prompt and reply reused.
    follow = first + [{"role": "assistant", "content": original["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "and then?"}]
    expected = chat(plain, follow)
    stop = original["choices"][0]["finish_reason"] == "stop"
    whole = original["usage"]["prompt_tokens"] + original["usage"]["completion_tokens"] - stop
    got = chat(client, follow, headers={"X-Session-ID": session})
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == whole
    # Without an id, another follow-up continues the regenerated conversation (greedy: its reply is the
    # original's; the original has moved on). It reuses all of it, and more: the start of the original's
    # follow-up ("and "), which the two share.
    then = tokens.prompt_ids(follow)
    follow[-1]["content"] = "and after that?"
    got, expected = chat(client, follow), chat(plain, follow)
    assert got["attnstore"]["session_id"] == sessions["regenerate"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == common(then, tokens.prompt_ids(follow)) > whole
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    close(pipe, store)
    close(plain_pipe, None)


def test_cache_salt_scopes_reuse_and_session_lookup():
    client, pipe, store = make_client()
    first = [SYSTEM, {"role": "user", "content": "a secret question"}]
    cached = lambda reply: reply["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    a = chat(client, first, cache_salt="tenant-a")
    assert cached(a) == 0
    # Another salt, or none, never reuses tenant a's KV, however long the common prefix.
    assert cached(chat(client, first, cache_salt="tenant-b")) == 0
    unsalted = chat(client, first)
    assert cached(unsalted) == 0
    # The same salt reuses it: a regenerate, and the next turn found without a session id.
    regenerated = chat(client, first, cache_salt="tenant-a")
    assert cached(regenerated) == a["usage"]["prompt_tokens"] - 1
    follow = first + [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "more"}]
    again = chat(client, follow, cache_salt="tenant-a")  # continues the latest of the two equal conversations
    assert again["attnstore"]["session_id"] == regenerated["attnstore"]["session_id"]
    assert cached(again) > a["usage"]["prompt_tokens"]
    # Without the salt, the follow-up continues the unsalted conversation (the same question got the same
    # greedy reply there), never tenant a's, which it cannot see.
    other = chat(client, follow)
    assert other["attnstore"]["session_id"] == unsalted["attnstore"]["session_id"]
    assert cached(other) == cached(again)
    # An explicit session id is scoped too: tenant c's "shared-id" is not tenant a's.
    chat(client, first, headers={"X-Session-ID": "shared-id"}, cache_salt="tenant-a")
    b = chat(client, follow, headers={"X-Session-ID": "shared-id"}, cache_salt="tenant-c")
    assert cached(b) == 0 and b["attnstore"]["kv_source"] == "miss"
    close(pipe, store)


def test_a_bad_cache_salt_is_a_400_naming_it():
    client, pipe, store = make_client()
    ok = [{"role": "user", "content": "hi"}]
    for salt in ["", "x" * 1025, 123, ["a"], "\ud800"]:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": ok, "cache_salt": salt}) \
            if salt != "\ud800" else client.post(
                "/v1/chat/completions", content=b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                b'"cache_salt": "\\ud800"}', headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (salt, r.text)
        assert r.json()["error"]["param"] == "cache_salt", (salt, r.json())
    assert chat(client, ok, cache_salt="x" * 1024)["choices"][0]["message"]["content"] is not None
    close(pipe, store)


def test_conversations_that_arrive_together_share_the_first_ones_prompt_while_it_runs():
    """A batch of new conversations over one system prompt, sent at once: the first is prefilled, and the
    others start from its prompt while its turn still decodes (offered as soon as it is stored)."""
    import threading

    from transformers import LogitsProcessorList

    from ..serving.test_openai import Slow

    # Each decoding step takes a while: the turns overlap, none has ended when the others are prefilled.
    client, pipe, store = make_client(max_batch_size=4, logits_processor=LogitsProcessorList([Slow(0.05)]))
    plain, plain_pipe, _ = make_client(store=False)
    system_ids = len(client.app.state.engine.tokens.prompt_ids([SYSTEM]))
    requests = [[SYSTEM, {"role": "user", "content": f"question number {k}"}] for k in range(4)]
    replies = [None] * 4

    def send(k):
        replies[k] = chat(client, requests[k], max_tokens=8)

    threads = [threading.Thread(target=send, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    cached = sorted(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies)
    assert cached[0] == 0 and all(c >= system_ids - 8 for c in cached[1:]), cached
    for k in range(4):
        assert replies[k]["choices"][0]["message"] == chat(plain, requests[k], max_tokens=8)["choices"][0]["message"]
    close(pipe, store)
    close(plain_pipe, None)
