"""A fault of the shared remote tier is a remote miss: it never costs a store its own durable copy.

Store A (lossless, its own disk) has flushed 30 tokens of a session; another store extends the session in
Redis to 60. When A resumes it, the longer remote copy replaces A's local copy only once it has been
verified (codec, fingerprint, chain) and loaded; any failure on the way (a codec A does not serve, a foreign
or replaced chunk, damaged bytes, Redis killed mid-lookup or mid-load) leaves A's copy where it was: reused
now, or at the next lookup, and still there after A's folder is reopened. Also: a store starts while Redis
is down (the remote tier marked down, retried in the background) unless told to fail fast.
"""

from __future__ import annotations

import threading
import time

import pytest

from hf_attnstore.store import AttnStore
from hf_attnstore.store.tiers import redis as remote_module
from hf_attnstore.store.buffer import LoadError
from hf_attnstore.lab.redis_server import RedisServer, free_port
from hf_attnstore.store.tiers.redis import RemoteChunk, RemoteTier, RemoteUnavailableError

from .test_faults import disk_usage  # measured while the save thread deletes files: tolerates that
from .test_remote import redis_server  # noqa: F401 (the fixture)
from .kvdata import BYTES_PER_TOKEN, FP, LAYERS, expect, layer_of, write_turn

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=4, remote_timeout_s=2)
LOCAL, REMOTE = list(range(30)), list(range(60))


def make(path, server, **kw):
    return AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(path), "remote": server.url, **FAST, **kw})


def extended_elsewhere(tmp_path, server, where="disk", a_options=None, **other) -> AttnStore:
    """Store A with 30 tokens of session "s" flushed to its disk (and kept in host memory, or evicted to
    disk), after another store (`other`: its options) extended the session in Redis to 60 tokens."""
    a = make(tmp_path / "a", server, **(a_options or {}))
    write_turn(a, "s", LOCAL)
    a.flush()
    if where == "disk":
        a.evict("s")
    assert a.tier_of("s", FP) == where
    with make(tmp_path / "b", server, **other) as b:
        snap = b.lookup("s", FP)
        assert snap.tier == "remote"
        expect(snap, LOCAL)  # A's lossless chunks: exact for any store
        write_turn(b, "s", REMOTE[30:], keep_from=snap)
    assert a._remote.manifest((FP, "s")).length == 60
    return a


def reopened_has_local_copy(tmp_path, a: AttnStore) -> None:
    """A's folder, reopened (without the remote tier), still serves exactly the 30 tokens A flushed."""
    a.close()
    with AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(tmp_path / "a"), **FAST}) as again:
        snap = again.lookup("s", FP)
        assert snap is not None and snap.tier == "disk"
        expect(snap, LOCAL)


def kill_redis_on_first(monkeypatch, server, cls, name) -> threading.Event:
    """Kills the server (SIGKILL) the first time `cls.name` is called, just before that call runs: a
    deterministic point in the middle of a lookup or a load, whichever thread it is on."""
    original, fired = getattr(cls, name), threading.Event()

    def wrapper(*args, **kwargs):
        if not fired.is_set():
            fired.set()
            server.stop()
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)
    return fired


# -- (a) a remote copy of a codec this store does not serve --------------------------------------------
@pytest.mark.parametrize("where", ["host", "disk"])
def test_a_longer_remote_copy_of_a_lossier_codec_leaves_the_local_copy_in_use(tmp_path, redis_server, where):
    a = extended_elsewhere(tmp_path, redis_server, where, kv_codec="int4")
    snap = a.lookup("s", FP)
    assert snap is not None and snap.tier == where  # the int4 copy is a remote miss: A's own copy is reused
    expect(snap, LOCAL)
    s = a.stats()
    assert (s.hits_remote, s.load_errors, s.remote_errors, s.misses) == (0, 0, 0, 0)
    # Asked again, the refused copy is not read again (nothing changed in Redis): still the local copy.
    expect(a.lookup("s", FP), LOCAL)
    assert a.stats().hits_remote == 0
    reopened_has_local_copy(tmp_path, a)


def test_a_local_copy_is_replaced_once_a_valid_longer_remote_copy_has_loaded(tmp_path, redis_server):
    """The good path is unchanged: lossless and longer in Redis, so A takes it, and writes it to its disk."""
    a = extended_elsewhere(tmp_path, redis_server)
    snap = a.lookup("s", FP)
    assert snap.tier == "remote"
    expect(snap, REMOTE)
    a.flush()
    assert a.tier_of("s", FP) in ("host", "disk") and a.stats().load_errors == 0
    a.close()
    with AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(tmp_path / "a"), **FAST}) as again:
        expect(again.lookup("s", FP), REMOTE)
        # The old copy's chunk files were collected once the new manifest was written: 15 chunks of 4 tokens.
        assert len(list((tmp_path / "a").rglob("*.safetensors"))) == 15
        assert again.stats().disk_bytes_used == disk_usage(tmp_path / "a")


# -- (b) Redis killed in the middle of a lookup or a load -----------------------------------------------
def test_redis_killed_while_a_longer_remote_copy_loads_keeps_the_local_copy(tmp_path, redis_server, monkeypatch):
    a = extended_elsewhere(tmp_path, redis_server)
    fired = kill_redis_on_first(monkeypatch, redis_server, RemoteChunk, "read_layer_into")
    snap = a.lookup("s", FP)  # verified while Redis was up: the load starts, and Redis dies at its first layer
    assert snap.tier == "remote"
    with pytest.raises(LoadError):
        layer_of(snap, 0)
    assert fired.is_set() and a.stats().load_errors == 1 and a.stats().remote_errors >= 1
    assert a.stats().remote_restores == 1
    snap = a.lookup("s", FP)  # the remote tier is down now: a remote miss, and the local copy is back
    assert snap is not None and snap.tier == "disk"
    expect(snap, LOCAL)
    reopened_has_local_copy(tmp_path, a)


def test_redis_killed_while_a_longer_remote_copy_is_verified_is_a_remote_miss(tmp_path, redis_server, monkeypatch):
    a = extended_elsewhere(tmp_path, redis_server)
    fired = kill_redis_on_first(monkeypatch, redis_server, RemoteTier, "get")  # the first chunk header read
    snap = a.lookup("s", FP)
    assert fired.is_set()
    assert snap is not None and snap.tier == "disk"  # this very lookup serves the local copy
    expect(snap, LOCAL)
    assert a.stats().remote_errors == 1 and a.stats().load_errors == 0
    reopened_has_local_copy(tmp_path, a)


def test_a_longer_remote_copy_too_large_for_host_memory_leaves_the_local_copy_in_use(tmp_path, redis_server):
    a = extended_elsewhere(tmp_path, redis_server, a_options=dict(host_bytes=45 * BYTES_PER_TOKEN))
    snap = a.lookup("s", FP)  # verified, but 60 tokens do not fit this host tier: the 30 local ones are served
    assert snap is not None and snap.tier == "disk"
    expect(snap, LOCAL)
    s = a.stats()
    assert (s.hits_remote, s.hits_disk, s.remote_restores, s.load_errors) == (0, 1, 1, 0)
    a.evict("s")
    expect(a.lookup("s", FP), LOCAL)  # refused until the remote copy changes: not adopted again
    assert a.stats().remote_restores == 1
    reopened_has_local_copy(tmp_path, a)


# -- (c) a remote copy that is foreign, replaced or damaged -----------------------------------------------
def _chunk_key(store, index=-1):
    remote = store._remote
    manifest = remote.manifest((FP, "s"))
    return remote.key_of((FP, "s"), "c:" + manifest.spans[index].chunk), manifest


def test_a_chunk_of_another_model_in_the_remote_copy_is_a_remote_miss(tmp_path, redis_server):
    a = extended_elsewhere(tmp_path, redis_server)
    other = "e" * 64  # another model's (or namespace's) fingerprint
    with make(tmp_path / "c", redis_server) as c:
        write_turn(c, "s", REMOTE[-4:], fp=other)
    remote = a._remote
    target, _ = _chunk_key(a)
    foreign = remote.manifest((other, "s"))
    remote.client.set(target, remote.client.get(remote.key_of((other, "s"), "c:" + foreign.spans[0].chunk)))
    snap = a.lookup("s", FP)
    assert snap is not None and snap.tier == "disk"
    expect(snap, LOCAL)
    assert a.stats().remote_errors == 1 and a.stats().hits_remote == 0
    expect(a.lookup("s", FP), LOCAL)  # refused once: not read again until the remote copy changes
    assert a.stats().remote_errors == 1
    reopened_has_local_copy(tmp_path, a)


def test_a_replaced_chunk_in_the_remote_copy_breaks_its_chain_and_is_a_remote_miss(tmp_path, redis_server):
    a = extended_elsewhere(tmp_path, redis_server)
    remote = a._remote
    target, manifest = _chunk_key(a)
    # A chunk of the same session and model, but not the one the manifest pinned (its digest differs).
    remote.client.set(target, remote.client.get(remote.key_of((FP, "s"), "c:" + manifest.spans[-2].chunk)))
    snap = a.lookup("s", FP)
    assert snap is not None and snap.tier == "disk"
    expect(snap, LOCAL)
    assert a.stats().remote_errors == 1 and a.stats().load_errors == 0
    reopened_has_local_copy(tmp_path, a)


def test_damaged_bytes_in_the_remote_copy_fail_its_load_and_keep_the_local_copy(tmp_path, redis_server):
    a = extended_elsewhere(tmp_path, redis_server)
    remote = a._remote
    target, _ = _chunk_key(a)
    value = bytearray(remote.client.get(target))
    value[-3] ^= 0x10  # in the last layer's values: the headers and the chain are intact, a checksum is not
    remote.client.set(target, bytes(value))
    snap = a.lookup("s", FP)
    assert snap.tier == "remote"
    with pytest.raises(LoadError):
        for layer in range(LAYERS):
            layer_of(snap, layer)
    assert a.stats().load_errors == 1 and a.stats().remote_restores == 1
    # Redis is up, and still holds the damaged copy: it is not tried again, the local copy is served.
    snap = a.lookup("s", FP)
    assert snap is not None and snap.tier == "disk"
    expect(snap, LOCAL)
    assert a.stats().load_errors == 1
    reopened_has_local_copy(tmp_path, a)


def test_a_longer_copy_written_after_a_refused_one_is_tried_again(tmp_path, redis_server):
    a = extended_elsewhere(tmp_path, redis_server, kv_codec="int4")
    expect(a.lookup("s", FP), LOCAL)  # refused: int4
    with make(tmp_path / "d", redis_server) as d:  # a lossless replica recomputes and extends the session
        write_turn(d, "s", list(range(70)))
    snap = a.lookup("s", FP)
    assert snap.tier == "remote"
    expect(snap, list(range(70)))
    a.close()


# -- the turn that recomputes after a failed remote load --------------------------------------------------
def test_the_recomputed_turn_after_a_failed_remote_load_keeps_the_local_copy_until_it_is_durable(
        tmp_path, redis_server, monkeypatch):
    """End to end, a failed load makes the turn recompute the whole prompt: a new history of the session
    (`open_turn` without a base). The local copy must survive until that history is durable: a crash
    before the write-behind (here: nothing due for a minute, then `close(flush=False)`) leaves the 30 tokens."""
    a = extended_elsewhere(tmp_path, redis_server)
    a.close()
    a = make(tmp_path / "a", redis_server, idle_flush_s=60, chunk_tokens=256)  # (no whole chunk to write early)
    kill_redis_on_first(monkeypatch, redis_server, RemoteChunk, "read_layer_into")
    snap = a.lookup("s", FP)
    assert snap.tier == "remote"
    with pytest.raises(LoadError):
        layer_of(snap, 0)
    write_turn(a, "s", REMOTE + [60])  # what AttnStoreCache's recompute stores: the whole prompt, from scratch
    expect(a.lookup("s", FP), REMOTE + [60])
    a.close(flush=False)  # a crash before the write-behind
    reopened_has_local_copy(tmp_path, a)


def local(path, **kw):
    return AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(path), **FAST, **kw})


def test_another_history_replacing_a_durable_session_leaves_its_copy_until_saved(tmp_path, monkeypatch):
    """Without any remote tier: a turn that starts the session over (another history) never deletes the
    durable copy before its own is durable; once it is, the old files are collected."""
    from hf_attnstore.store import StoreIOError
    from hf_attnstore.store.tiers import disk as disk_module

    with local(tmp_path / "kv") as store:
        write_turn(store, "s", LOCAL)
    store = local(tmp_path / "kv", idle_flush_s=60, chunk_tokens=256)
    write_turn(store, "s", [7, 8, 9])  # another history (no base): replaces the session
    store.close(flush=False)  # crashed before its write
    with local(tmp_path / "kv") as store:
        expect(store.lookup("s", FP), LOCAL)
        real = disk_module._write_bytes

        def enospc(fd, data):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(disk_module, "_write_bytes", enospc)
        write_turn(store, "s", [7, 8, 9])
        with pytest.raises(StoreIOError):
            store.flush()  # the new history's write fails: the old copy must still be whole on disk
        monkeypatch.setattr(disk_module, "_write_bytes", real)
        store.close(flush=False)
    with local(tmp_path / "kv") as store:
        expect(store.lookup("s", FP), LOCAL)
        write_turn(store, "s", [7, 8, 9])
        store.flush()
        assert store.stats().disk_bytes_used == disk_usage(tmp_path / "kv")  # the old chunks were collected
    with local(tmp_path / "kv") as store:
        expect(store.lookup("s", FP), [7, 8, 9])
        assert store.stats().disk_bytes_used == disk_usage(tmp_path / "kv") == 2 * 4096  # 1 chunk, 1 manifest


def test_another_history_while_the_old_copy_is_still_loading_keeps_it_until_saved(tmp_path, monkeypatch):
    from hf_attnstore.store.tiers.disk import DiskTier

    with local(tmp_path / "kv") as store:
        write_turn(store, "s", LOCAL)
    gate, real = threading.Event(), DiskTier.read_layer_into

    def held(self, *args, **kwargs):
        assert gate.wait(10)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "read_layer_into", held)
    store = local(tmp_path / "kv", idle_flush_s=60, chunk_tokens=256)
    assert store.lookup("s", FP).tier == "disk"  # a load starts, held before its first layer
    write_turn(store, "s", [7, 8, 9])  # another history replaces the session while the load is in flight
    gate.set()
    store.close(flush=False)  # crashed before the new history was written
    with local(tmp_path / "kv") as store:
        expect(store.lookup("s", FP), LOCAL)


# (A new history on a disk with room for one copy only: tests/store/test_durable.py, the old copy stays.)


# -- starting while Redis is down -----------------------------------------------------------------------
def _wait_until(condition, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_store_starts_with_redis_down_and_uses_it_once_it_is_up(tmp_path, monkeypatch):
    monkeypatch.setattr(remote_module, "BACKOFF_S", 0.1)  # the background reconnection's period
    server = RedisServer(tmp_path / "redis")  # not started yet
    store = AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(tmp_path / "a"), "remote": server.url, **FAST})
    assert store.stats().remote_down == 1
    write_turn(store, "s", LOCAL)
    store.flush()  # the disk copy is what flush() promises
    assert store.lookup("s", FP).tier == "host" and store.lookup("t", FP) is None
    with server:
        assert _wait_until(lambda: store.stats().remote_down == 0)  # reconnected in the background
        write_turn(store, "s", [99], keep_from=store.lookup("s", FP))
        store.flush()  # the session's copy in Redis, chunks written before Redis was up included
        with make(tmp_path / "b", server) as b:
            expect(b.lookup("s", FP), LOCAL + [99])
    store.close()


def test_a_remote_only_store_starts_with_redis_down_and_keeps_sessions_in_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(remote_module, "BACKOFF_S", 0.1)
    server = RedisServer(tmp_path / "redis")
    store = AttnStore(**{"host_bytes": "64MiB", "remote": server.url, **FAST})
    write_turn(store, "s", LOCAL)
    from hf_attnstore.store import StoreIOError

    with pytest.raises(StoreIOError, match="remote tier"):
        store.flush()
    expect(store.lookup("s", FP), LOCAL)  # still served from host memory
    with server:
        assert _wait_until(lambda: store.stats().remote_down == 0)
        store.flush()  # retried: durable in Redis now
        with AttnStore(**{"host_bytes": "64MiB", "remote": server.url, **FAST}) as b:
            expect(b.lookup("s", FP), LOCAL)
    store.close(flush=False)


def test_remote_required_fails_fast_when_redis_is_down(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RemoteUnavailableError, match="cannot be reached"):
        AttnStore("1MiB", tmp_path / "kv", remote=url, remote_required=True, fsync=False, remote_timeout_s=1)
    # The disk folder was released; without the option the same store starts, its remote tier down.
    with AttnStore("1MiB", tmp_path / "kv", remote=url, fsync=False, remote_timeout_s=1) as store:
        s = store.stats()
        assert s.remote_down == 1 and s.remote_errors == 1
    with AttnStore("1MiB", tmp_path / "kv", fsync=False) as store:
        assert store.stats().remote_down == 0  # no remote tier


def test_remote_required_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="remote_required"):
        AttnStore("1MiB", tmp_path / "kv", remote="redis://127.0.0.1:1/0", remote_required="yes")


def test_a_tier_that_went_down_is_reported_down(tmp_path, redis_server):
    store = make(tmp_path / "a", redis_server)
    assert store.stats().remote_down == 0
    redis_server.stop()
    assert store.lookup("s", FP) is None  # a failed call trips the circuit breaker
    assert store.stats().remote_down == 1
    store.close()
