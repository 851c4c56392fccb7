"""Two replicas (two pipelines, each over its own store and engine) sharing one real redis-server: the stored
responses, where each session stands and the memo of generated replies are shared, so a Responses chain and a
resent conversation continue whole on either replica; what Redis holds is validated on every read, and a dead
Redis is a miss, never an error."""

from __future__ import annotations

import json
import signal
import time

import pytest
import redis
from fastapi.testclient import TestClient
from transformers import LogitsProcessorList

from hf_attnstore import AttnStore
from hf_attnstore.serving import ChatEngine, create_app
from hf_attnstore.serving.conversation import ReplyMemo, SessionIndex
from hf_attnstore.serving.pipeline import ChatPipeline
from hf_attnstore.serving.response_store_redis import RedisResponseStore
from hf_attnstore.serving import shared_state
from hf_attnstore.serving.shared_state import SharedState, tokenizer_digest
from hf_attnstore.lab.redis_server import RedisClusterServers, RedisServer

from ..conftest import VOCAB, char_tokenizer, make_tiny
from .helpers import ForceReply, bpe_tokenizer

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=16, remote_timeout_s=2)
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server


class Replica:
    """A pipeline, its store (Redis below host memory) and an app, with the shared state."""

    def __init__(self, model, tok, url: str, **generate):
        self.store = AttnStore("16MiB", remote=url, **FAST)
        self.pipe = ChatPipeline(model, tok, self.store, max_new_tokens=8, max_batch_size=1, **generate)
        self.shared = SharedState(url, namespace=tokenizer_digest(tok), vocab_size=VOCAB)
        self.client = TestClient(create_app(ChatEngine(self.pipe, shared=self.shared), "tiny", default_max_tokens=8))

    def post(self, path: str, body: dict) -> dict:
        r = self.client.post(path, json={"model": "tiny", **body})
        assert r.status_code == 200, r.text
        self.store.flush()  # the turn is in Redis before the next one (a user's think time)
        return r.json()

    def close(self):
        self.pipe.close(timeout=60)
        self.store.close()
        self.shared.close()


def replicas(url, tok, **generate):
    model = make_tiny("llama")  # one model: the replicas serve the same weights
    return [Replica(model, tok, url, **generate) for _ in range(2)]


def test_a_reply_generated_on_one_replica_is_reused_whole_on_the_other(redis_server):
    tok = bpe_tokenizer()
    a = tok.convert_tokens_to_ids("a")
    pair = replicas(redis_server.url, tok, logits_processor=LogitsProcessorList([ForceReply(tok, [a, a, a, a])]))
    messages = [{"role": "user", "content": "say aaaa"}]
    first = pair[0].post("/v1/chat/completions", {"messages": messages, **GREEDY})
    assert first["choices"][0]["message"]["content"] == "aaaa"
    assert len(tok("aaaa", add_special_tokens=False)["input_ids"]) == 2  # re-tokenized: two merged tokens
    messages += [{"role": "assistant", "content": "aaaa"}, {"role": "user", "content": "again"}]
    second = pair[1].post("/v1/chat/completions", {"messages": messages, **GREEDY})
    # The other replica found the session by its messages and gave the reply its four generated ids back.
    assert second["attnstore"]["session_id"] == first["attnstore"]["session_id"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] + 4
    for replica in pair:
        replica.close()


def test_a_responses_chain_continues_on_either_replica_and_is_deleted_on_both(redis_server):
    pair = replicas(redis_server.url, char_tokenizer())
    previous, before = None, None
    for turn in range(4):  # replicas 0, 1, 0, 1: each turn continues what the other one wrote
        body = {"input": f"question {turn}: why is the sky blue? " * 3, "max_output_tokens": 6, "temperature": 0}
        if previous is not None:
            body["previous_response_id"] = previous["id"]
        got = pair[turn % 2].post("/v1/responses", body)
        if previous is not None:
            # Everything before this turn's input: the previous input and its reply (but the reply's last token,
            # whose KV the turn that generated it never computed).
            assert got["attnstore"]["session_id"] == previous["attnstore"]["session_id"]
            assert got["usage"]["input_tokens_details"]["cached_tokens"] >= before - 1, (turn, got["usage"])
        before = got["usage"]["input_tokens"] + got["usage"]["output_tokens"]
        previous = got
    assert pair[0].client.get(f"/v1/responses/{previous['id']}").json()["id"] == previous["id"]
    assert pair[1].client.delete(f"/v1/responses/{previous['id']}").status_code == 200
    assert pair[0].client.get(f"/v1/responses/{previous['id']}").status_code == 404
    for replica in pair:
        replica.close()


def test_what_redis_holds_is_checked_on_every_read(redis_server):
    shared = SharedState(redis_server.url, namespace="n", vocab_size=100)
    memo = ReplyMemo(shared=shared)
    shared.put_reply("", "too big", [5, 100])  # ids another model's tokenizer made
    assert memo.get("too big") is None
    responses = RedisResponseStore(shared)
    raw = redis.Redis.from_url(redis_server.url)
    memo_key = "m:" + shared_state._digest("", "damaged")
    for damaged in (b"{not json", b'{"a": 1}', b"[1, true]", b"[-1]", b"\xff"):
        raw.set(shared.prefix + memo_key, damaged)
        raw.set(shared.prefix + "r:resp_" + "1" * 32, damaged)
        assert memo.get("damaged") is None, damaged
        if damaged != b"\xff":  # valid UTF-8: the response store checks the JSON itself
            continue
        assert responses.get("resp_" + "1" * 32) is None
    assert responses.get("not an id") is None
    raw.close()
    # Another namespace (another tokenizer) never sees these.
    ReplyMemo(shared=shared).add("hi", [1, 2])
    assert ReplyMemo(shared=SharedState(redis_server.url, namespace="m")).get("hi") is None
    assert ReplyMemo(shared=shared).get("hi") == [1, 2] and ReplyMemo(shared=shared).get("hi", scope="s") is None
    shared.close()


def test_a_dead_redis_is_a_miss_and_never_an_error(redis_server):
    shared = SharedState(redis_server.url, namespace="n", timeout_s=1)
    memo = ReplyMemo(shared=shared)
    memo.add("kept here", [3, 4])
    redis_server.stop()
    memo.add("not shared", [5])  # the write is skipped...
    assert memo.get("kept here") == [3, 4] and memo.get("not shared") == [5]  # ...this process still knows both
    assert ReplyMemo(shared=shared).get("kept here") is None  # a miss
    responses = RedisResponseStore(shared)
    assert responses.get("resp_" + "2" * 32) is None and responses.delete("resp_" + "2" * 32) is False
    assert shared.find_session("", [1, 2, 3], [b"x"], 16) is None and shared.get_session("", "s") is None
    shared.close()


def test_on_a_redis_cluster_keys_spread_over_the_nodes_and_every_lookup_finds_them(tmp_path):
    # The shared state's keys carry no hash tag, so a session's digests lie in several slots: a plain MGET of them
    # is refused by a cluster (CROSSSLOT), and a plain client is MOVED away from other nodes' keys.
    with RedisClusterServers(tmp_path / "cluster", nodes=3) as servers:
        shared = SharedState(servers.url, namespace="c", vocab_size=VOCAB)
        ids = list(range(40))
        digests = [bytes([k]) * 16 for k in range(5)]  # five blocks of 8
        shared.put_session("", "alice", ids, ids, digests[-1])
        shared.put_reply("", "hello", [3, 4])
        assert shared.cluster
        assert shared.get_session("", "alice") == (tuple(ids), ids)
        assert ReplyMemo(shared=shared).get("hello") == [3, 4]
        assert shared.find_session("", ids + [41], digests, 8) == ("alice", tuple(ids), ids)
        assert shared.put_response("resp_" + "3" * 32, '{"id": 1}')
        assert shared.get_response("resp_" + "3" * 32) == '{"id": 1}'
        raw = redis.Redis.from_url(servers.url)
        slots = {raw.cluster("keyslot", shared.prefix + "d:" + d.hex()) for d in digests}
        raw.close()
        assert len(slots) > 1  # the lookup above read keys of several slots in one call
        shared.close()


def test_a_redis_down_at_start_is_connected_once_it_is_up(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_state, "BACKOFF_S", 0.2)
    server = RedisServer(tmp_path / "late")
    shared = SharedState(server.url, namespace="late", timeout_s=1)
    assert shared.get_reply("", "x") is None  # nothing listens yet: a miss, not an error
    with server:
        time.sleep(0.3)  # past the backoff
        shared.put_reply("", "x", [1])
        assert shared.get_reply("", "x") == [1]
    shared.close()


def test_a_digest_outlived_by_its_sessions_rewrite_finds_nothing(redis_server):
    # Session X held A, then its client edited an early message: X now holds B, of A's length and A's last block.
    # The digest under which A was indexed still names X, but X no longer begins with A.
    shared = SharedState(redis_server.url, namespace="n", vocab_size=100)
    index = SessionIndex(block=16)
    a = list(range(10, 42))
    b = [50] * 16 + list(range(26, 42))
    for ids in (a, b):
        shared.put_session("", "X", ids, ids, index.digests(ids, "")[-1])
    request = a + [60, 61]
    assert shared.find_session("", request, index.digests(request, ""), 16) is None
    resent = b + [60, 61]  # the edited conversation, continued: found
    assert shared.find_session("", resent, index.digests(resent, ""), 16) == ("X", tuple(b), b)
    shared.close()


def test_a_responses_chain_through_another_salts_response_is_not_followed(redis_server):
    tok = char_tokenizer()
    replica = Replica(make_tiny("llama"), tok, redis_server.url)
    try:
        alice = replica.post("/v1/responses", {"input": "hello", "max_output_tokens": 3, "cache_salt": "alice"})
        bob = replica.post("/v1/responses", {"input": "bob's secret", "max_output_tokens": 3, "cache_salt": "bob"})
        raw = redis.Redis.from_url(redis_server.url)
        record = json.loads(raw.get(replica.shared.prefix + "r:" + alice["id"]))
        planted = "resp_" + "3" * 32  # alice's scope, continuing bob's response: what a writer to the Redis could plant
        raw.set(replica.shared.prefix + "r:" + planted, json.dumps({**record, "id": planted, "previous_id": bob["id"]}))
        raw.close()
        r = replica.client.post("/v1/responses", json={"model": "tiny", "input": "x", "max_output_tokens": 2,
                                                       "previous_response_id": planted, "cache_salt": "alice"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found", r.text
    finally:
        replica.close()


def test_a_hung_cluster_node_costs_a_lookup_its_timeout_not_more(tmp_path):
    with RedisClusterServers(tmp_path / "cluster", nodes=3) as servers:
        shared = SharedState(servers.url, namespace="h", vocab_size=VOCAB, timeout_s=1)
        index = SessionIndex(block=4)
        ids = list(range(40))
        shared.put_session("", "S", ids, ids, index.digests(ids, "")[-1])
        request = ids + [1]
        assert shared.find_session("", request, index.digests(request, ""), 4) is not None
        servers.nodes[2].process.send_signal(signal.SIGSTOP)  # a hung host: its digests' MGET never answers
        try:
            start = time.monotonic()
            assert shared.find_session("", request, index.digests(request, ""), 4) is None  # a miss
            took = time.monotonic() - start
        finally:
            servers.nodes[2].process.send_signal(signal.SIGCONT)
        assert took < 1.9, f"a lookup took {took:.1f} s at a 1 s timeout"  # 3-14 s before the bound
        shared.close()
