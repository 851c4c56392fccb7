"""A remote tier without a disk tier: sessions are saved to Redis directly and demoted to it."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore.store import AttnStore, StoreIOError
from hf_attnstore.lab.redis_server import RedisServer
from hf_attnstore.store.tiers.redis import RemoteUnavailableError

from .kvdata import BYTES_PER_TOKEN, FP, expect, kv, write_turn

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=4, remote_timeout_s=2)


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server


def make(server, **kw):
    return AttnStore(**{"host_bytes": "64MiB", "remote": server.url, **FAST, **kw})


def test_sessions_are_saved_to_redis_and_resumed_by_another_store(redis_server):
    a, b = make(redis_server), make(redis_server)
    write_turn(a, "s", list(range(10)))
    a.flush()  # durable in Redis: no disk tier to be durable on
    s = a.stats()
    assert s.remote_bytes_written > 0 and s.bytes_written == 0 and s.disk_bytes_used == 0 and s.disk_sessions == 0
    manifest = b._remote.manifest((FP, "s"))
    assert [span.chunk for span in manifest.spans] == [span.digest for span in manifest.spans]
    snap = b.lookup("s", FP)
    assert snap.tier == "remote" and b.stats().hits_remote == 1
    expect(snap, list(range(10)))
    write_turn(b, "s", list(range(10, 13)), keep_from=snap)
    b.flush()
    expect(a.lookup("s", FP), list(range(13)))  # a's own copy is shorter: it takes b's
    for store in (a, b):
        assert store.stats().remote_errors == 0 and store.stats().load_errors == 0
        store.close()


def test_a_session_evicted_from_host_is_demoted_to_redis_and_loaded_back(redis_server):
    # Room for one session of 40 tokens (and a little): the second pushes the first down to Redis.
    store = make(redis_server, host_bytes=60 * BYTES_PER_TOKEN)
    write_turn(store, "s", list(range(40)), seed=1.0)
    write_turn(store, "t", list(range(40)), seed=2.0)
    store.flush()
    assert store.tier_of("s", FP) == "remote" and store.tier_of("t", FP) == "host"
    assert store.stats().demotions == 1 and store.stats().host_drops == 0
    snap = store.lookup("s", FP)
    assert snap.tier == "remote"
    expect(snap, list(range(40)), seed=1.0)
    store.close()


def test_the_trailing_partial_chunk_is_rewritten_as_the_session_grows(redis_server):
    a = make(redis_server)
    write_turn(a, "s", list(range(6)))  # chunks of 4: one whole, one partial (2 tokens)
    a.flush()
    snap = a.lookup("s", FP)
    write_turn(a, "s", list(range(6, 9)), keep_from=snap)
    a.flush()
    manifest = a._remote.manifest((FP, "s"))
    assert [span.length for span in manifest.spans] == [4, 4, 1]
    b = make(redis_server)
    expect(b.lookup("s", FP), list(range(9)))
    for store in (a, b):
        store.close()


def test_a_dead_redis_fails_flush_clearly_and_loses_nothing_in_host_memory(redis_server):
    store = make(redis_server)
    redis_server.stop()
    write_turn(store, "s", [1, 2, 3])
    with pytest.raises(StoreIOError, match="remote tier"):
        store.flush()
    expect(store.lookup("s", FP), [1, 2, 3])  # still served from host memory
    assert store.stats().write_errors >= 1
    redis_server.start()
    store.flush()  # retried now: durable
    fresh = make(redis_server)
    expect(fresh.lookup("s", FP), [1, 2, 3])
    for s in (store, fresh):
        s.close()


def test_a_session_below_host_is_a_miss_while_redis_is_down(redis_server):
    store = make(redis_server, host_bytes=60 * BYTES_PER_TOKEN)
    write_turn(store, "s", list(range(40)))
    write_turn(store, "t", list(range(40)))
    store.flush()
    assert store.tier_of("s", FP) == "remote"
    redis_server.stop()
    with pytest.raises(RemoteUnavailableError):
        store._remote.manifest((FP, "s"))  # trips the circuit breaker
    assert store.lookup("s", FP) is None  # a miss at once, without waiting on the dead server
    assert store.tier_of("s", FP) == "remote"  # still indexed: used again once Redis is back
    store.close(flush=False)


def test_truncating_a_session_saved_in_redis_keeps_its_durable_prefix(redis_server):
    a = make(redis_server)
    write_turn(a, "s", list(range(10)))
    a.flush()
    snap = a.lookup("s", FP)
    # The next turn keeps only the first 5 tokens (a regenerated reply), then appends 2 others.
    with a.open_turn("s", FP, snap, torch.arange(5)) as writer:
        writer.append(torch.tensor([50, 51]), *kv([50, 51]))
    a.flush()
    b = make(redis_server)
    expect(b.lookup("s", FP), [0, 1, 2, 3, 4, 50, 51])  # KV depends on the id only: any mix-up shows
    for store in (a, b):
        store.close()
