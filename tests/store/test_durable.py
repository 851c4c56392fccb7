"""Nothing acknowledged is lost (issue 43): a session's durable copy stays until its successor is durable, a
refusal loses nothing else, a restarted Redis is noticed and re-filled, and `disk_bytes` is hard in every mode.

Each test reproduces a way a flushed session used to be lost; each failed before its fix.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hf_attnstore.store import AttnStore, StoreIOError
from hf_attnstore.store.tiers import disk as disk_module
from hf_attnstore.lab.redis_server import RedisServer

from .kvdata import FP, expect, kv, layer_of, write_turn
from .test_faults import disk_usage

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=4, remote_timeout_s=2)


def local(path, **kw):
    return AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(path), **FAST, **kw})


def reused(store, session, ids) -> int:
    """How many leading tokens of `ids` the store serves for the session (0: a miss), checked value by value."""
    snap = store.lookup(session, FP)
    if snap is None:
        return 0
    stored = snap.token_ids.tolist()
    assert stored == ids[: len(stored)], "the store serves another history"
    expect(snap, stored)
    return len(stored)


# -- 1. the durable copy stays until its successor is durable --------------------------------------------
def test_a_new_history_while_a_save_is_in_flight_keeps_the_flushed_copy(tmp_path, monkeypatch):
    """A flushed at 100 tokens, extended to 150 with that save held mid-write, then given a new history (token 0
    edited); the new history is never written (every later write fails, as if the process died first). The
    reopened store serves the acknowledged 100 tokens (or what the save in flight made durable), never
    nothing."""
    from hf_attnstore.store.saver import SavePlanner

    kvdir = tmp_path / "kv"
    store = local(kvdir, idle_flush_s=60)
    old = list(range(1, 101))
    write_turn(store, "a", old)
    store.flush()
    gate, entered, broken = threading.Event(), threading.Event(), threading.Event()
    real_write, real_finish = disk_module._write_bytes, SavePlanner.finish_save

    def held(fd, data):
        entered.set()
        assert gate.wait(10)
        if broken.is_set():
            raise OSError(5, "Input/output error")
        real_write(fd, data)

    def finish(self, job, result):
        real_finish(self, job, result)
        broken.set()  # the save in flight is done: nothing after it lands (the process "dies")

    monkeypatch.setattr(disk_module, "_write_bytes", held)
    monkeypatch.setattr(SavePlanner, "finish_save", finish)
    extended = old + list(range(101, 151))
    write_turn(store, "a", extended[100:], keep_from=store.lookup("a", FP))
    errors = []
    flusher = threading.Thread(target=lambda: errors.append(_raises(store.flush)))
    flusher.start()  # the save of tokens 100..150 starts, held in its first write
    assert entered.wait(10)
    write_turn(store, "a", [999] + old[1:])  # another history replaces the session while the save is in flight
    gate.set()
    flusher.join(20)
    assert errors == [StoreIOError], "the new history must not be durable (its writes fail)"
    store.close(flush=False)
    monkeypatch.undo()
    with local(kvdir) as again:
        got = reused(again, "a", extended)
        assert 100 <= got <= 150, f"the acknowledged 100 tokens were lost (reused {got})"


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts which
        return type(exc)
    return None


def test_a_new_history_that_does_not_fit_next_to_the_old_copy_keeps_the_old_copy(tmp_path):
    """Room for one copy only: the new history is refused (a StoreIOError from flush) rather than the acknowledged
    copy deleted before its successor is durable."""
    limit = 12 * 4096  # 30 tokens in chunks of 4: 8 chunk files and a manifest; two copies: 18 blocks
    kvdir = tmp_path / "kv"
    first = list(range(1, 31))
    with local(kvdir, disk_bytes=limit) as store:
        write_turn(store, "s", first)
    with local(kvdir, disk_bytes=limit) as store:
        write_turn(store, "s", list(range(100, 130)))
        with pytest.raises(StoreIOError):
            store.flush()
        assert disk_usage(kvdir) <= limit
        store.close(flush=False)
    with local(kvdir, disk_bytes=limit) as store:
        assert reused(store, "s", first) == 30


# -- 3. a refusal loses nothing else -------------------------------------------------------------------------
@pytest.mark.parametrize("share", [False, True])
def test_a_session_larger_than_the_disk_tier_is_refused_before_anything_is_evicted(tmp_path, share):
    kvdir = tmp_path / "kv"
    a = list(range(1, 61))
    b = list(range(1000, 1400))
    with local(kvdir, disk_bytes=120_000, share_prefixes=share) as store:
        write_turn(store, "a", a)
        store.flush()
        write_turn(store, "b", b)  # 100 chunk files of 4 KiB blocks: larger than the whole tier
        with pytest.raises(StoreIOError, match="larger than the disk tier"):
            store.flush()
        assert store.stats().rejected_too_large >= 1 and store.stats().disk_drops == 0
        assert reused(store, "b", b) == 400  # still served from host memory
        store.close(flush=False)
    with local(kvdir, disk_bytes=120_000) as store:
        assert reused(store, "a", a) == 60


def test_an_extension_larger_than_the_disk_tier_keeps_the_durable_prefix(tmp_path):
    kvdir = tmp_path / "kv"
    ids = list(range(1, 401))
    with local(kvdir, disk_bytes=120_000) as store:
        write_turn(store, "a", ids[:40])
        store.flush()
        write_turn(store, "a", ids[40:], keep_from=store.lookup("a", FP))
        with pytest.raises(StoreIOError):
            store.flush()
        store.close(flush=False)
    with local(kvdir, disk_bytes=120_000) as store:
        assert reused(store, "a", ids) == 40


# -- 4. disk_bytes is hard with partial eviction ---------------------------------------------------------------
def test_disk_bytes_holds_at_every_write_with_partial_eviction(tmp_path, monkeypatch):
    kvdir = tmp_path / "kv"
    limit = 250_000
    peak, real = [0], disk_module._write_bytes

    def measured(fd, data):
        real(fd, data)
        peak[0] = max(peak[0], disk_usage(kvdir))

    monkeypatch.setattr(disk_module, "_write_bytes", measured)
    with local(kvdir, disk_bytes=limit, partial_eviction=True, chunk_tokens=8) as store:
        for i in range(12):
            ids = list(range(i * 1000, i * 1000 + 90))
            write_turn(store, f"s{i}", ids)
            store.flush()
        assert store.stats().head_drops > 0, "the run must drop heads to test their manifests"
    assert 0 < peak[0] <= limit, f"the folder reached {peak[0]} bytes with a {limit} limit"


# -- 2. a restarted Redis is noticed ------------------------------------------------------------------------
def _restart_empty(server: RedisServer) -> None:
    server.stop()
    server.start()


def test_a_redis_restart_does_not_leave_a_remote_only_session_flushed_but_gone(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        ids = list(range(1, 141))
        kw = dict(FAST, remote=server.url)
        kw.pop("chunk_tokens")
        a = AttnStore(host_bytes="64MiB", chunk_tokens=4, **kw)
        write_turn(a, "s", ids[:100])
        a.flush()
        _restart_empty(server)
        write_turn(a, "s", ids[100:], keep_from=a.lookup("s", FP))
        a.flush()  # must make the whole session durable again, or raise
        with AttnStore(host_bytes="64MiB", chunk_tokens=4, **kw) as b:
            assert reused(b, "s", ids) == 140
        a.close()


def test_a_redis_restart_is_refilled_from_disk_for_other_replicas(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        ids = list(range(1, 181))
        a = local(tmp_path / "a", remote=server.url)
        write_turn(a, "s", ids[:100])
        a.flush()
        _restart_empty(server)
        write_turn(a, "s", ids[100:140], keep_from=a.lookup("s", FP))
        a.flush()
        write_turn(a, "s", ids[140:], keep_from=a.lookup("s", FP))
        a.flush()
        with local(tmp_path / "b", remote=server.url) as b:
            assert reused(b, "s", ids) == 180
        assert a.stats().remote_restarts >= 1
        a.close()


def test_a_redis_restart_between_turns_is_refilled_without_a_new_turn(tmp_path):
    """Sessions nobody is writing are re-mirrored too: noticed at the next flush, copied from disk."""
    with RedisServer(tmp_path / "redis") as server:
        ids = list(range(1, 61))
        a = local(tmp_path / "a", remote=server.url)
        write_turn(a, "s", ids)
        a.flush()
        a.evict("s")
        _restart_empty(server)
        a.flush()
        with local(tmp_path / "b", remote=server.url) as b:
            assert reused(b, "s", ids) == 60
        a.close()


# -- found by an adversarial review of the above -----------------------------------------------------------------
def test_a_cut_session_whose_next_save_fails_keeps_the_copy_on_disk(tmp_path, monkeypatch):
    """A regenerated reply cuts a session flushed at 100 tokens to 50, and the next save fails: the chunks the
    manifest on disk still names stay (they were collected as no longer the session's, and a reopen found the
    copy damaged)."""
    kvdir = tmp_path / "kv"
    ids = list(range(1, 101))
    store = local(kvdir)
    write_turn(store, "a", ids)
    store.flush()
    base = store.lookup("a", FP)

    def enospc(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_module, "_write_bytes", enospc)
    with store.open_turn("a", FP, base, torch.arange(50)) as writer:
        writer.append(torch.tensor([7000, 7001]), *kv([7000, 7001]))
    with pytest.raises(StoreIOError):
        store.flush()
    monkeypatch.undo()
    store.close(flush=False)
    with local(kvdir) as again:
        assert reused(again, "a", ids) == 100


def test_a_refused_save_of_a_replaced_entry_leaves_the_new_history_to_be_written(tmp_path, monkeypatch):
    """A save refused as too large finishes after its session was replaced by a new history that fits: the new
    entry stays pending (flush() writes it), not forgotten as the refused one."""
    from hf_attnstore.store.saver import SavePlanner

    kvdir = tmp_path / "kv"
    store = local(kvdir, disk_bytes=30 * 4096, idle_flush_s=60, chunk_tokens=64)
    gate, entered, real = threading.Event(), threading.Event(), SavePlanner.reserve

    def held(self, *args, **kwargs):
        entered.set()
        assert gate.wait(10)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SavePlanner, "reserve", held)
    write_turn(store, "a", list(range(1, 2001)))  # far larger than 30 blocks
    errors = []
    flusher = threading.Thread(target=lambda: errors.append(_raises(lambda: store.flush(timeout=5))))
    flusher.start()
    assert entered.wait(10)
    new = list(range(9000, 9040))
    write_turn(store, "a", new)
    gate.set()
    flusher.join(20)
    monkeypatch.undo()
    store.flush()
    store.close(flush=False)
    with local(kvdir, disk_bytes=30 * 4096, chunk_tokens=64) as again:
        assert reused(again, "a", new) == 40


def test_a_session_deleted_and_started_again_during_a_save_inherits_nothing(tmp_path, monkeypatch):
    kvdir = tmp_path / "kv"
    store = local(kvdir, idle_flush_s=60, chunk_tokens=64)
    gate, entered, real = threading.Event(), threading.Event(), disk_module._write_bytes

    def held(fd, data):
        entered.set()
        assert gate.wait(10)
        real(fd, data)

    monkeypatch.setattr(disk_module, "_write_bytes", held)
    old = list(range(1, 201))
    write_turn(store, "a", old)
    flusher = threading.Thread(target=lambda: _raises(store.flush))  # (it may see the failed writes below)
    flusher.start()
    assert entered.wait(10)
    store.delete("a")
    write_turn(store, "a", [7, 8, 9])  # another session under the same id
    gate.set()
    flusher.join(20)

    def eio(fd, data):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(disk_module, "_write_bytes", eio)
    store.evict("a")  # its demotion fails: the host copy goes, and nothing of the deleted session comes back
    deadline = time.monotonic() + 10
    while store.tier_of("a", FP) == "host" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.token_ids("a", FP) is None
    assert store.stats().disk_bytes_used == disk_usage(kvdir)
    monkeypatch.undo()
    write_turn(store, "a", [7, 8, 9])
    store.flush()
    store.close()
    with local(kvdir, chunk_tokens=64) as again:
        assert reused(again, "a", [7, 8, 9]) == 3


def test_a_session_deleted_while_its_mirror_copy_is_written_is_not_resurrected(tmp_path, monkeypatch):
    with RedisServer(tmp_path / "redis") as server:
        ids = list(range(1, 61))
        a = local(tmp_path / "a", remote=server.url)
        entered, real = threading.Event(), disk_module._write_bytes

        def slow(fd, data):
            entered.set()
            time.sleep(0.05)
            real(fd, data)

        monkeypatch.setattr(disk_module, "_write_bytes", slow)
        write_turn(a, "s", ids)
        flusher = threading.Thread(target=lambda: _raises(a.flush))
        flusher.start()
        assert entered.wait(10)
        assert a.delete("s")
        flusher.join(30)
        monkeypatch.undo()
        a.flush()
        with local(tmp_path / "b", remote=server.url) as b:
            assert reused(b, "s", ids) == 0
        a.close()


def test_a_remote_copy_adopted_over_a_new_history_that_fails_to_load_keeps_the_older_copy(tmp_path, monkeypatch):
    from hf_attnstore.store.tiers import redis as remote_module
    from hf_attnstore.store.format import FormatError
    from hf_attnstore.store.buffer import LoadError

    with RedisServer(tmp_path / "redis") as server:
        old = list(range(1, 101))
        a = local(tmp_path / "a", remote=server.url, idle_flush_s=60, chunk_tokens=64)
        write_turn(a, "s", old)
        a.flush()
        write_turn(a, "s", [999] + old[1:20])  # a new history, not written yet
        with local(tmp_path / "b", remote=server.url) as b:  # another replica writes a longer copy
            write_turn(b, "s", list(range(5000, 5200)), seed=7.0)
        real = remote_module.RemoteTier.get

        def get(self, key, chunk, owner=""):
            if threading.current_thread().name == "attnstore-load":
                raise FormatError("evicted between the lookup and the load")
            return real(self, key, chunk, owner)

        monkeypatch.setattr(remote_module.RemoteTier, "get", get)
        snap = a.lookup("s", FP)
        assert snap is not None and snap.tier == "remote"
        with pytest.raises(LoadError):
            layer_of(snap, 0)
        monkeypatch.undo()
        a.close(flush=False)
    with local(tmp_path / "a", chunk_tokens=64) as again:
        assert reused(again, "s", old) == 100


def test_another_sessions_replaced_copy_makes_room_before_a_new_history_is_refused(tmp_path):
    """Room for two copies: a and b are flushed, then both get new histories. The first new history to be written
    does not fit next to both old copies; b's old copy, a replaced history, goes for room (a capacity eviction),
    never a's own: both new histories become durable."""
    kvdir = tmp_path / "kv"
    limit = 21 * 4096  # 30 tokens in chunks of 4: 8 chunk files and a manifest; two copies: 18 blocks
    with local(kvdir, disk_bytes=limit) as store:
        write_turn(store, "a", list(range(1, 31)))
        write_turn(store, "b", list(range(101, 131)))
    new_a, new_b = list(range(200, 230)), list(range(300, 330))
    with local(kvdir, disk_bytes=limit, idle_flush_s=60) as store:
        write_turn(store, "a", new_a)
        write_turn(store, "b", new_b)
        store.flush()
        assert store.stats().disk_drops >= 1 and store.stats().rejected_too_large == 0
        assert store.stats().disk_bytes_used == disk_usage(kvdir) <= limit
    with local(kvdir, disk_bytes=limit) as store:
        assert reused(store, "a", new_a) == 30 and reused(store, "b", new_b) == 30
