"""AttnStore with a disk tier: persistence, chunk layout, placement between tiers, faults."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from hf_attnstore.store import AttnStore, LoadError, StoreIOError
from hf_attnstore.store.tiers import disk as disk_module
from hf_attnstore.store.format import FORMAT, session_dirname

from ..kvdata import BYTES_PER_TOKEN, FP, expect, layer_of, write_turn

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10)


@pytest.fixture
def kvdir(tmp_path):
    return tmp_path / "kv"


def make(kvdir, **kw):
    return AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(kvdir), "chunk_tokens": 4, **FAST, **kw})


def chunk_files(kvdir, session="s"):
    folder = kvdir / "sessions" / session_dirname(FP, session)
    return sorted(p.name for p in folder.glob("*.safetensors"))


def test_reopen_serves_every_session_bit_identical(kvdir):
    with make(kvdir) as store:
        for i, s in enumerate(["a", "b", "c"]):
            assert write_turn(store, s, list(range(10 * i, 10 * i + 7)), seed=i)
    with make(kvdir) as store:
        assert store.stats().disk_sessions == 3 and store.stats().host_sessions == 0
        for i, s in enumerate(["a", "b", "c"]):
            snap = store.lookup(s, FP)
            assert snap.tier == "disk"
            expect(snap, list(range(10 * i, 10 * i + 7)), seed=i)
        assert store.stats().hits_disk == 3 and store.stats().bytes_read > 0


def test_appending_writes_only_new_chunks_and_truncation_only_the_manifest(kvdir):
    store = make(kvdir)
    write_turn(store, "s", [1, 2, 3, 4, 5, 6])
    store.flush()
    assert chunk_files(kvdir) == ["00000000.safetensors", "00000001.safetensors"]  # 4 + a partial 2
    first = (kvdir / "sessions" / session_dirname(FP, "s") / "00000000.safetensors").stat()
    write_turn(store, "s", [7, 8, 9], keep_from=store.lookup("s", FP))
    store.flush()
    # The full chunk is untouched; the partial one was rewritten together with the new tokens (5 tokens:
    # a full chunk and a new partial one).
    assert chunk_files(kvdir) == ["00000000.safetensors", "00000002.safetensors", "00000003.safetensors"]
    again = (kvdir / "sessions" / session_dirname(FP, "s") / "00000000.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    # Truncation (keep tokens 0-1 and 5-8) changes only the manifest.
    snap = store.lookup("s", FP)
    writer = store.open_turn("s", FP, snap, torch.tensor([0, 1, 5, 6, 7, 8]))
    from ..kvdata import kv

    assert writer.append(torch.tensor([10]), *kv([10]))
    store.flush()
    # Chunks 0 and 2 are kept as they were; only the partial tail chunk 3 is rewritten with the new token.
    assert chunk_files(kvdir)[:2] == ["00000000.safetensors", "00000002.safetensors"]
    assert (kvdir / "sessions" / session_dirname(FP, "s") / "00000000.safetensors").stat().st_ino == first.st_ino
    store.close()
    with make(kvdir) as reopened:
        snap = reopened.lookup("s", FP)
        assert snap.token_ids.tolist() == [1, 2, 6, 7, 8, 9, 10]
        for layer in range(3):
            k, _ = layer_of(snap, layer)
            assert k[0, 0, :, 0].tolist() == [1000 * layer + t for t in [1, 2, 6, 7, 8, 9, 10]]


def test_host_full_demotes_to_disk_and_disk_full_drops(kvdir):
    host = 32 * BYTES_PER_TOKEN  # two 16-token buffers
    store = make(kvdir, host_bytes=host, disk_bytes=2_000_000)
    write_turn(store, "a", [1, 2])
    write_turn(store, "b", [3, 4])
    write_turn(store, "c", [5, 6])
    store.flush()
    store.lookup("c", FP)
    assert store.stats().demotions >= 1
    assert store.tier_of("a", FP) == "disk" and store.tier_of("c", FP) == "host"
    expect(store.lookup("a", FP), [1, 2])  # loads back from disk
    store.close()
    # Each session is a chunk and a manifest, a 4 KiB block each: room for two of the three (and "d" next to them).
    limit = 5 * 4096
    store = make(kvdir, host_bytes=host, disk_bytes=limit)
    assert store.stats().disk_sessions == 3
    write_turn(store, "d", [7, 8])
    store.flush()
    s = store.stats()
    assert s.disk_drops >= 1 and s.disk_bytes_used <= limit
    store.close()


def test_session_larger_than_disk_stays_in_memory(kvdir):
    from hf_attnstore.store import StoreIOError

    store = make(kvdir, disk_bytes=100)
    write_turn(store, "big", list(range(12)))
    with pytest.raises(StoreIOError, match="larger than the disk tier"):
        store.flush()  # kept in memory only: not durable, and flush() says so
    assert store.stats().rejected_too_large == 1 and store.stats().disk_sessions == 0
    expect(store.lookup("big", FP), list(range(12)))
    store.close(flush=False)


def test_prefetch_brings_disk_sessions_to_host(kvdir):
    with make(kvdir) as store:
        write_turn(store, "a", [1, 2, 3])
    with make(kvdir) as store:
        assert store.prefetch(["a", "unknown"]) == 1
        with store._index.cond:  # the load thread reports completion under the store's condition
            assert store._index.cond.wait_for(lambda: store._index.loads_active == 0, 10)
        snap = store.lookup("a", FP)
        assert snap.tier == "host"
        expect(snap, [1, 2, 3])


def test_ttl_expires_sessions(kvdir, monkeypatch):
    import time

    from hf_attnstore.store import store as store_module

    clock = [time.monotonic()]
    monkeypatch.setattr(store_module.time, "monotonic", lambda: clock[0])  # the store's clock, not threading's
    with make(kvdir, ttl_s=100) as store:
        write_turn(store, "a", [1, 2])
        write_turn(store, "b", [3, 4])
        clock[0] += 60
        assert store.lookup("b", FP) is not None  # used: its TTL starts again
        clock[0] += 60
        assert store.lookup("a", FP) is None and store.lookup("b", FP) is not None
        assert store.stats().ttl_expired == 1


def test_evict_and_delete(kvdir):
    with make(kvdir) as store:
        write_turn(store, "a", [1, 2])
        store.evict("a")
        store.flush()
        store.evict("a")
        assert store.tier_of("a", FP) == "disk"
        assert store.delete("a") and store.lookup("a", FP) is None
        store.flush()
    assert not any((kvdir / "sessions").iterdir())


# -- damaged files: always a clean miss ---------------------------------------------------------------
def session_folder(kvdir, session="s"):
    return kvdir / "sessions" / session_dirname(FP, session)


def damage(kvdir, how):
    folder = session_folder(kvdir)
    chunk = folder / "00000000.safetensors"
    if how == "truncate":
        chunk.write_bytes(chunk.read_bytes()[:-10])
    elif how == "flip_header":
        data = bytearray(chunk.read_bytes())
        data[40] ^= 0x04
        chunk.write_bytes(bytes(data))
    elif how == "flip_manifest":
        data = bytearray((folder / "manifest.json").read_bytes())
        data[len(data) // 2] ^= 0x01
        (folder / "manifest.json").write_bytes(bytes(data))
    elif how == "delete_chunk":
        chunk.unlink()
    elif how == "other_format":
        chunk.write_bytes(chunk.read_bytes().replace(FORMAT.encode(), b"hf_attnstore/0"))
    elif how == "temp_only":
        (folder / "manifest.json").rename(folder / ".tmp-123-manifest.json")


@pytest.mark.parametrize("how", ["truncate", "flip_header", "flip_manifest", "delete_chunk", "other_format", "temp_only"])
def test_damage_found_on_reopen_is_a_clean_miss_and_cleaned_up(kvdir, how):
    with make(kvdir) as store:
        write_turn(store, "s", [1, 2, 3, 4, 5])
        write_turn(store, "ok", [9, 9])
    damage(kvdir, how)
    with make(kvdir) as store:
        assert store.lookup("s", FP) is None
        expect(store.lookup("ok", FP), [9, 9])
    assert not session_folder(kvdir).exists()


def test_data_bit_flip_found_while_loading_is_a_load_error_then_a_miss(kvdir):
    with make(kvdir) as store:
        write_turn(store, "s", [1, 2, 3, 4, 5])
    chunk = session_folder(kvdir) / "00000000.safetensors"
    data = bytearray(chunk.read_bytes())
    data[-3] ^= 0x80  # inside the last layer's values: only its checksum can tell
    chunk.write_bytes(bytes(data))
    with make(kvdir) as store:
        snap = store.lookup("s", FP)
        layer_of(snap, 0)
        with pytest.raises(LoadError, match="checksum"):
            layer_of(snap, 2)
        assert store.lookup("s", FP) is None
        assert store.stats().load_errors == 1


def test_copied_to_another_sessions_name_is_a_miss(kvdir):
    with make(kvdir) as store:
        write_turn(store, "alice", [1, 2, 3])
    shutil.copytree(session_folder(kvdir, "alice"), session_folder(kvdir, "bob"))
    with make(kvdir) as store:
        assert store.lookup("bob", FP) is None
        expect(store.lookup("alice", FP), [1, 2, 3])
    assert not session_folder(kvdir, "bob").exists()


def test_other_model_is_a_miss(kvdir):
    with make(kvdir) as store:
        write_turn(store, "s", [1, 2, 3])
    with make(kvdir) as store:
        assert store.lookup("s", "0" * 64) is None and store.lookup("s", FP) is not None


def test_hostile_session_ids_stay_inside_disk_dir(tmp_path):
    kvdir = tmp_path / "inner" / "kv"
    with make(kvdir) as store:
        ids = ["../x", "/etc/passwd", "a\0b", "..", "é" * 2048, "../../../../tmp/evil", "\0", "🙂\n\t"]
        for i, sid in enumerate(ids):
            write_turn(store, sid, [i, i + 1])
        for bad in ("\ud800", "x" * 4097, "é" * 2049, ""):
            with pytest.raises(ValueError, match="`session_id`"):
                write_turn(store, bad, [1])
        for bad in (None, 123, b"s"):
            for call in (store.evict, store.delete, lambda s: store.token_ids(s, FP), lambda s: store.tier_of(s, FP),
                         lambda s: store.lookup(s, FP), lambda s: s in store):
                with pytest.raises(TypeError, match="`session_id`"):
                    call(bad)
        store.flush()
        assert store.stats().write_errors == 0
    with make(kvdir) as store:  # every id, NUL and 4 KiB ones included, survives a reopen exactly
        assert store.sessions() == sorted(ids)
        for i, sid in enumerate(ids):
            expect(store.lookup(sid, FP), [i, i + 1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inner"]
    assert sorted(p.name for p in (tmp_path / "inner").iterdir()) == ["kv"]


@pytest.mark.parametrize("fail_at", [1, 2])  # the chunk write, the manifest write
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_write_errors_leave_nothing_visible_and_host_keeps_serving(kvdir, monkeypatch, caplog, fail_at, err):
    store = make(kvdir, chunk_tokens=64)
    write_turn(store, "s", [1, 2])
    store.flush()
    calls = {"n": 0}
    real = disk_module._write_bytes

    def failing(fd, data):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(err, os.strerror(err))
        return real(fd, data)

    monkeypatch.setattr(disk_module, "_write_bytes", failing)
    write_turn(store, "s", [3, 4], keep_from=store.lookup("s", FP))
    with pytest.raises(StoreIOError):
        store.flush()
    s = store.stats()
    assert s.write_errors == 1
    expect(store.lookup("s", FP), [1, 2, 3, 4])  # host tier still serves the whole session
    assert sum("failed" in r.message for r in caplog.records) == 1
    monkeypatch.setattr(disk_module, "_write_bytes", real)
    store.close(flush=False)
    assert not list(kvdir.rglob(".tmp-*"))
    with make(kvdir) as reopened:
        expect(reopened.lookup("s", FP), [1, 2])  # the failed state never became visible


def test_store_options_are_validated(kvdir):
    for kw, match in [(dict(chunk_tokens=0), "chunk_tokens"), (dict(read_buffer_layers=-1), "read_buffer_layers"),
                      (dict(ttl_s=0), "ttl_s"), (dict(disk_bytes="x"), "disk_bytes")]:
        with pytest.raises(ValueError, match=match):
            make(kvdir, **kw)


def test_closed_store_refuses_use(kvdir):
    store = make(kvdir)
    store.close()
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.lookup("s", FP)


def test_a_retained_session_outlives_the_ttl_until_its_retention_ends(kvdir, monkeypatch):
    import time

    from hf_attnstore.store import store as store_module

    clock = [time.monotonic()]
    monkeypatch.setattr(store_module.time, "monotonic", lambda: clock[0])
    with make(kvdir, ttl_s=100) as store:
        store.retain("kept", FP, 1000)  # before it is stored (a first turn asks for it)
        write_turn(store, "kept", [1, 2])
        write_turn(store, "idle", [3, 4])
        assert store.stats().retained_sessions == 1
        clock[0] += 500
        assert store.lookup("idle", FP) is None and store.lookup("kept", FP) is not None
        store.flush()  # the idle session's write to disk (it pins the session) is over
        clock[0] += 600  # past its retention, and idle for longer than the TTL since the lookup
        assert store.lookup("kept", FP) is None
        s = store.stats()
        assert s.ttl_expired == 2 and s.retained_sessions == 0 and s.retained_dropped == 0


def test_capacity_still_evicts_a_retained_session_and_says_so():
    from ..kvdata import BYTES_PER_TOKEN

    store = AttnStore(host_bytes=2 * 16 * BYTES_PER_TOKEN)  # two sessions; no lower tier
    try:
        store.retain("a", FP, 1000)
        for name, ids in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
            write_turn(store, name, ids)
        assert "a" not in store.sessions()
        assert store.stats().retained_dropped == 1
    finally:
        store.close()
