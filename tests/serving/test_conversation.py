"""Message lists to stable ids (and exact ids for generated replies); the session index."""

from __future__ import annotations

import pytest

from hf_attnstore.serving.conversation import MessageTokens, ReplyMemo, SessionIndex

from ..conftest import char_tokenizer
from .helpers import bpe_tokenizer


def conversation(n: int) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}]
    for k in range(n):
        msgs.append({"role": "user", "content": f"question {k}"})
        msgs.append({"role": "assistant", "content": f"answer {k}"})
    return msgs


@pytest.mark.parametrize("make", [char_tokenizer, bpe_tokenizer], ids=["chars", "bpe"])
def test_a_conversations_ids_are_a_prefix_of_its_continuations(make):
    tokens = MessageTokens(make())
    for n in range(1, 4):
        shorter = tokens.prompt_ids(conversation(n - 1) + [{"role": "user", "content": f"question {n - 1}"}])
        longer = tokens.prompt_ids(conversation(n) + [{"role": "user", "content": "next"}])
        assert longer[: len(shorter)] == shorter


def test_an_echoed_reply_gets_back_the_ids_it_was_generated_as():
    tok = bpe_tokenizer()
    a, aa = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("aa")
    tokens = MessageTokens(tok, ReplyMemo())
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "aa"},
            {"role": "user", "content": "ok"}]
    retokenized = tokens.prompt_ids(msgs)
    assert aa in retokenized and retokenized.count(a) == 0  # "aa" re-tokenizes as one merged token
    tokens.memo.add("aa", [a, a])  # ... but the model generated it as two
    exact = tokens.prompt_ids(msgs)
    assert exact.count(a) == 2 and aa not in exact and len(exact) == len(retokenized) + 1


def test_messages_the_template_cannot_render_are_a_value_error():
    tok = char_tokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        MessageTokens(tok).prompt_ids([{"role": "user", "content": "x"}])


def test_the_index_finds_the_longest_stored_prefix():
    index = SessionIndex(block=4)
    index.add("short", [1, 2, 3, 4, 5])
    index.add("long", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], extra="model ids")
    index.add("other", [9, 9, 9, 9, 9, 9])
    assert index.find([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]) == ("long", 10)
    assert index.find([1, 2, 3, 4, 5, 6, 7, 0]) == ("short", 5)
    assert index.find([1, 2, 3, 4, 5]) == ("short", 5)  # a retried request: all of it
    assert index.find([1, 2, 3]) is None and index.find([7, 7, 7, 7, 7]) is None
    assert index.get("long") == (tuple(range(1, 11)), "model ids")
    index.add("long", [1, 2])  # re-indexed: the old ids no longer match
    assert index.find([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]) == ("short", 5)
    index.remove("short")
    assert index.find([1, 2, 3, 4, 5, 6]) == ("long", 2)


def test_the_index_is_bounded_least_recently_used_first():
    index = SessionIndex(block=2, max_sessions=2)
    index.add("a", [1, 1, 1])
    index.add("b", [2, 2, 2])
    assert index.find([1, 1, 1, 5]) == ("a", 3)  # "a" is now the most recently used
    index.add("c", [3, 3, 3])
    assert len(index) == 2 and index.find([2, 2, 2, 5]) is None and index.find([1, 1, 1, 5]) == ("a", 3)


def test_the_session_index_is_scoped_and_prefers_the_most_recent_of_equal_conversations():
    index = SessionIndex(block=2)
    index.add("old", [1, 2, 3])
    index.add("new", [1, 2, 3])  # a regenerated turn that gave the same reply
    assert index.find([1, 2, 3, 4]) == ("new", 3)
    index.find([1, 2, 3])  # found: now the most recent is still "new"
    index.add("old", [1, 2, 3])  # the client went on with the first one
    assert index.find([1, 2, 3, 4]) == ("old", 3)
    # Another scope (a request's cache_salt) sees none of them, and names its own sessions.
    assert index.find([1, 2, 3, 4], scope="s") is None
    index.add("old", [1, 2], scope="s")
    assert index.find([1, 2, 3, 4], scope="s") == ("old", 2) and index.get("old", "s")[0] == (1, 2)
    assert index.get("old")[0] == (1, 2, 3)
    index.remove("old", scope="s")
    assert index.find([1, 2, 3, 4], scope="s") is None and len(index) == 2
