"""Faults that used to stop the store or lose data: each test failed before its fix."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from hf_attnstore.store import AttnStore, StoreIOError
from hf_attnstore.store.tiers import disk as disk_module
from hf_attnstore.store.tiers.disk import DiskTier
from hf_attnstore.store.format import session_dirname

from .kvdata import BYTES_PER_TOKEN, FP, expect, kv, write_turn

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10)


def make(kvdir, **kw):
    return AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(kvdir), "chunk_tokens": 4, **FAST, **kw})


def full_disk(monkeypatch, fail=lambda: True):
    real = disk_module._write_bytes

    def write(fd, data):
        if fail():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(disk_module, "_write_bytes", write)
    return real


def test_a_failed_write_stays_pending_and_flush_retries_it(tmp_path, monkeypatch):
    kvdir = tmp_path / "kv"
    store = make(kvdir)
    real = full_disk(monkeypatch)
    write_turn(store, "s", [1, 2, 3])
    with pytest.raises(StoreIOError, match="'s'"):
        store.flush()
    with pytest.raises(StoreIOError, match="not durable"):  # still pending: never a silent success
        store.flush()
    assert store.stats().saves_pending == 1
    monkeypatch.setattr(disk_module, "_write_bytes", real)  # room again: the next flush writes it
    store.flush()
    store.close()
    with make(kvdir) as reopened:
        expect(reopened.lookup("s", FP), [1, 2, 3])


def test_save_thread_survives_any_exception_and_reports_it_per_session(tmp_path, monkeypatch):
    store = make(tmp_path / "kv")
    real = DiskTier.write_file

    def explode(disk, fp, sid, *args):
        if sid == "bad":
            raise KeyError("not an OSError")
        return real(disk, fp, sid, *args)

    monkeypatch.setattr(DiskTier, "write_file", explode)
    write_turn(store, "bad", [1, 2])
    write_turn(store, "good", [3, 4])
    with pytest.raises(StoreIOError, match="'bad'") as info:
        store.flush(timeout=5)
    assert "'good'" not in str(info.value)
    write_turn(store, "later", [5, 6])  # the thread still works
    monkeypatch.setattr(DiskTier, "write_file", real)
    store.flush(timeout=5)
    store.close()
    with make(tmp_path / "kv") as reopened:
        assert reopened.sessions() == ["bad", "good", "later"]


def test_full_disk_and_full_host_never_stall_a_turn_or_exceed_the_limit(tmp_path, monkeypatch):
    limit = 40 * BYTES_PER_TOKEN
    store = make(tmp_path / "kv", host_bytes=limit, io_timeout_s=30)
    full_disk(monkeypatch)
    worst, peak = 0.0, 0
    for i in range(12):
        started = time.monotonic()
        write_turn(store, f"s{i}", list(range(i * 16, i * 16 + 16)), seed=float(i))
        worst = max(worst, time.monotonic() - started)
        peak = max(peak, store.stats().host_bytes_used)
    assert worst < 5, f"a turn waited {worst:.1f} s for room that a failed demotion could not free"
    assert peak <= limit
    s = store.stats()
    assert s.host_drops >= 8 and s.write_errors >= 1
    for sid in store.sessions():  # what is kept is exact
        i = int(sid[1:])
        expect(store.lookup(sid, FP), list(range(i * 16, i * 16 + 16)), seed=float(i))
    store.close(flush=False)


def test_host_full_of_running_turns_refuses_instead_of_exceeding(tmp_path):
    limit = 40 * BYTES_PER_TOKEN
    store = AttnStore(host_bytes=limit, **{k: v for k, v in FAST.items() if k != "fsync"})
    running = [store.open_turn(f"r{i}", FP, None, torch.arange(0)) for i in range(2)]
    for i, w in enumerate(running):
        assert w.append(torch.arange(16), *kv(list(range(16)), seed=i))
    late = store.open_turn("late", FP, None, torch.arange(0))
    assert not late.append(torch.arange(16), *kv(list(range(16))))  # both others are pinned by their turns
    assert store.stats().host_bytes_used <= limit and store.stats().rejected_no_room == 1
    for w in running:
        w.close()
    with store.open_turn("late2", FP, None, torch.arange(0)) as w:  # ended turns can move again
        assert w.append(torch.arange(16), *kv(list(range(16))))


def test_the_running_turn_is_never_demoted_mid_decode(tmp_path):
    store = make(tmp_path / "kv", host_bytes=60 * BYTES_PER_TOKEN, chunk_tokens=64)
    turn = store.open_turn("mine", FP, None, torch.arange(0))
    assert turn.append(torch.arange(8), *kv(list(range(8))))
    store.flush()  # entirely on disk, so it could be demoted at no cost ...
    store.evict("mine")  # ... by an explicit eviction or by another session's need for room
    write_turn(store, "other", list(range(100, 140)), seed=1.0)
    for t in range(8, 12):  # decoding goes on: every token is stored
        assert turn.append(torch.tensor([t]), *kv([t]))
    turn.close()
    expect(store.lookup("mine", FP), list(range(12)))
    store.close()


def test_stray_entries_in_the_disk_dir_are_tolerated(tmp_path):
    kvdir = tmp_path / "kv"
    with make(kvdir) as store:
        write_turn(store, "s", [1, 2, 3, 4, 5])
    folder = kvdir / "sessions" / session_dirname(FP, "s")
    (folder / ".tmp-stray").mkdir()
    (folder / "99999999.safetensors").mkdir()
    (folder / ".tmp-file").write_bytes(b"x")
    (kvdir / "sessions" / "not-a-session").write_bytes(b"x")
    with make(kvdir) as store:
        expect(store.lookup("s", FP), [1, 2, 3, 4, 5])
    assert sorted(p.name for p in folder.iterdir()) == ["00000000.safetensors", "00000001.safetensors",
                                                        "manifest.json"]
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a folder"):
        make(tmp_path / "file")
    other = tmp_path / "kv2"
    other.mkdir()
    (other / "sessions").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a folder"):
        make(other)


def test_appends_keep_no_graph_and_no_larger_storage():
    store = AttnStore(host_bytes="64MiB")
    fused = torch.randn(1, 2, 80, 4, requires_grad=True) * 2  # a view's base: a fused QKV output, say
    keys = [fused[:, :, :64] for _ in range(3)]
    values = [fused[:, :, 16:80] for _ in range(3)]
    with store.open_turn("s", FP, None, torch.arange(0)) as w:
        assert w.append(torch.arange(64), keys, values)
    snap = store.lookup("s", FP)
    held = {seg.keys[0].untyped_storage().data_ptr(): seg for seg, _, _ in snap.parts}
    for seg in held.values():
        for t in seg.keys + seg.values:
            assert t.grad_fn is None and not t.requires_grad
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert store.stats().host_bytes_used == 64 * BYTES_PER_TOKEN


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_unstorable_dtypes_are_refused_at_append(dtype):
    store = AttnStore(host_bytes="64MiB")
    keys, values = kv([1, 2])
    with pytest.raises(TypeError, match="cannot be stored"):
        store.open_turn("s", FP, None, torch.arange(0)).append(torch.tensor([1, 2]), [k.to(dtype) for k in keys],
                                                               values)


def test_float64_sessions_round_trip_through_disk(tmp_path):
    with make(tmp_path / "kv") as store:
        keys, values = kv([1, 2, 3, 4, 5])
        with store.open_turn("s", FP, None, torch.arange(0)) as w:
            w.append(torch.tensor([1, 2, 3, 4, 5]), [k.double() for k in keys], [v.double() for v in values])
    with make(tmp_path / "kv") as store:
        snap = store.lookup("s", FP)
        assert snap.layer_parts(0)[0][0].dtype == torch.float64


def test_store_arguments_are_checked_with_their_names(tmp_path):
    for kw, exc, match in [(dict(host_bytes=float("nan")), ValueError, "host_bytes"),
                           (dict(host_bytes=float("inf")), ValueError, "host_bytes"),
                           (dict(disk_dir=123), TypeError, "disk_dir"), (dict(disk_dir=""), ValueError, "disk_dir"),
                           (dict(disk_bytes=True), TypeError, "disk_bytes"), (dict(io_timeout_s=float("nan")),
                                                                               ValueError, "io_timeout_s"),
                           (dict(namespace=1), TypeError, "namespace"), (dict(hostbytes=1), TypeError, "hostbytes")]:
        with pytest.raises(exc, match=match):
            AttnStore(**kw)
    assert not (tmp_path / "123").exists() and not os.path.exists("123")


def disk_usage(kvdir) -> int:
    """Bytes the files occupy, rounded to 4 KiB blocks (what the limit counts; `du` agrees on ext4/tmpfs)."""
    total = 0
    # os.walk, not rglob: the save thread may delete a folder (a dropped session) while this walks the tree.
    for folder, _, names in os.walk(kvdir):
        for name in names:
            try:
                size = os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                continue  # deleted meanwhile: it no longer occupies anything
            total += -(-size // 4096) * 4096 if name != "LOCK" else 0
    return total


def test_disk_bytes_is_never_exceeded_while_writing(tmp_path, monkeypatch):
    """Files (chunks, manifests, temporaries, not-yet-collected chunks) are counted before they are written."""
    kvdir = tmp_path / "kv"
    limit = 40 * 4096
    store = make(kvdir, disk_bytes=limit)
    peak, real = [0], disk_module._write_bytes

    def write(fd, data):
        real(fd, data)
        peak[0] = max(peak[0], disk_usage(kvdir))  # measured with the temporary file complete

    monkeypatch.setattr(disk_module, "_write_bytes", write)
    snaps = {}
    for i in range(30):
        sid = f"s{i % 7}"
        ids = list(range(i * 10, i * 10 + 6))
        base = snaps.get(sid)
        if base is not None and base.length > 12:  # a truncation now and then: old chunks become garbage
            base = None
        write_turn(store, sid, ids, keep_from=base)
        snaps[sid] = store.lookup(sid, FP)
        store.flush()
    assert peak[0] <= limit, (peak[0], limit)
    assert store.stats().disk_bytes_used == disk_usage(kvdir) <= limit
    assert store.stats().disk_drops > 0
    store.close()


def test_a_session_whose_write_failed_can_still_be_demoted_at_once(tmp_path, monkeypatch):
    """Regression (found by eval/faults.py): a session backing off after failed writes, then chosen to make
    room, was skipped by the writer until its back-off ended; the append waited `io_timeout_s`, then its
    turn was not stored."""
    limit = 40 * BYTES_PER_TOKEN
    store = make(tmp_path / "kv", host_bytes=limit, io_timeout_s=3)
    full_disk(monkeypatch)
    write_turn(store, "old", list(range(16)))
    for _ in range(6):  # six failures: the next automatic retry is a minute away
        with pytest.raises(StoreIOError):
            store.flush()
    write_turn(store, "a", list(range(100, 116)), seed=1.0)
    write_turn(store, "b", list(range(200, 216)), seed=2.0)  # needs "old" out of host memory now
    s = store.stats()
    assert s.rejected_no_room == 0 and s.host_drops == 1 and s.host_bytes_used <= limit
    expect(store.lookup("b", FP), list(range(200, 216)), seed=2.0)
    assert store.lookup("old", FP) is None  # never durable: dropped, not served half-written
    store.close(flush=False)


def test_a_session_that_outgrows_the_host_tier_keeps_its_durable_prefix(tmp_path):
    """Regression (found by eval/faults.py, kill -9 runs): a session that grew past `host_bytes` was deleted
    from every tier, including the prefix a flush() had acknowledged as durable."""
    store = make(tmp_path / "kv", host_bytes=40 * BYTES_PER_TOKEN)
    write_turn(store, "s", list(range(16)))
    store.flush()  # acknowledged: 16 tokens are durable
    assert not write_turn(store, "s", list(range(16, 64)), keep_from=store.lookup("s", FP))  # too large now
    assert store.stats().rejected_too_large == 1
    expect(store.lookup("s", FP), list(range(16)))
    store.close()
    with make(tmp_path / "kv") as reopened:
        expect(reopened.lookup("s", FP), list(range(16)))


@pytest.mark.parametrize("err", [errno.EIO, errno.EMFILE])
def test_a_disk_read_error_is_a_miss_that_keeps_the_disk_copy(tmp_path, monkeypatch, err):
    """An I/O error while loading (the device's, not the data's) never deletes the session: the turn misses,
    the next one loads it. Damaged data is still removed (tests/store/test_integrity.py)."""
    from hf_attnstore.store.buffer import LoadError

    from .kvdata import LAYERS, layer_of

    kvdir = tmp_path / "kv"
    with make(kvdir) as store:
        write_turn(store, "s", list(range(10)))
    real, calls = disk_module.DiskTier.read_layer_into, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second layer read of the first load
            raise OSError(err, os.strerror(err))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(disk_module.DiskTier, "read_layer_into", failing)
    store = make(kvdir)
    snap = store.lookup("s", FP)
    assert snap.tier == "disk"
    with pytest.raises(LoadError):
        for layer in range(LAYERS):
            layer_of(snap, layer)
    assert store.stats().load_errors == 1
    snap = store.lookup("s", FP)  # still indexed: loaded again, whole
    assert snap.tier == "disk"
    expect(snap, list(range(10)))
    store.close()
    with make(kvdir) as reopened:
        expect(reopened.lookup("s", FP), list(range(10)))


def test_a_failed_deletion_does_not_stop_the_others_or_the_accounting(tmp_path, monkeypatch):
    """The save thread runs queued deletions one by one: one that fails (EACCES) is logged, the next ones still
    run, and every queued byte leaves the count (a review finding: one failure skipped the rest)."""
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), fsync=False, idle_flush_s=0.05, io_timeout_s=10,
                      chunk_tokens=4)
    for sid in ("a", "b"):
        write_turn(store, sid, list(range(8)))
    store.flush()
    original = DiskTier.remove

    def refuse_a(self, key, keep=None):
        if keep is None and key[1] == "a":
            raise PermissionError(errno.EACCES, "refused")
        return original(self, key, keep)

    monkeypatch.setattr(DiskTier, "remove", refuse_a)
    store.delete("a")
    store.delete("b")
    deadline = time.monotonic() + 20  # deletions run on the save thread, after the call returns
    while store.stats().disk_bytes_used and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (tmp_path / "sessions" / session_dirname(FP, "b")).exists()
    assert (tmp_path / "sessions" / session_dirname(FP, "a")).exists()  # the refused one stays, uncounted
    assert store.stats().disk_bytes_used == 0 and store.lookup("a", FP) is None
    store.close()
