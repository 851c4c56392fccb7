"""Reopening a disk tier: at once, or in the background while the store serves (`reopen_in_background`).

The background scan is held at a gate (a patched `DiskTier.scan_folder` that waits on its thread) so that what a
call does while sessions are not indexed yet is tested deterministically, not by timing."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from hf_attnstore import AttnStore, StoreTuning
from hf_attnstore.store.tiers.disk import DiskTier

from .kvdata import FP
from .test_shared_disk import CHUNK, SYSTEM, du_once, expect_prefix, start_from, store_dir


def open_store(path, background: bool, **kw) -> AttnStore:
    return AttnStore(host_bytes="64MiB", disk_dir=path, tuning=StoreTuning(
        chunk_tokens=CHUNK, idle_flush_s=0.01, fsync=False, reopen_in_background=background), **kw)


def fill(path, n: int = 6) -> list[str]:
    """Session s0 holds the shared prompt and one token; s1..s{n-1} start from it (its files linked)."""
    store = open_store(path, background=False)
    from .kvdata import kv
    with store.open_turn("s0", FP, None, torch.empty(0)) as turn:
        assert turn.append(torch.tensor(SYSTEM + [0]), *kv(SYSTEM + [0]))
    store.flush()
    for i in range(1, n):
        start_from(store, f"s{i}", "s0", len(SYSTEM), [i])
        store.flush()
    store.close()
    return [f"s{i}" for i in range(n)]


class Gate:
    """Holds the reopen thread before each folder it scans until `release`; calls on other threads pass."""

    def __init__(self, monkeypatch):
        self.open, self.waiting, self.scanned = threading.Event(), threading.Event(), []
        original = DiskTier.scan_folder

        def scan_folder(tier, folder, shared=None):
            if threading.current_thread().name == "attnstore-reopen":
                self.waiting.set()
                assert self.open.wait(60), "the test never released the reopen thread"
                self.scanned.append(folder.name)
            return original(tier, folder, shared)

        monkeypatch.setattr(DiskTier, "scan_folder", scan_folder)

    def release(self) -> None:
        self.open.set()


def test_a_background_reopen_indexes_what_a_reopen_at_once_does(tmp_path):
    sids = fill(tmp_path)
    with open_store(tmp_path, background=False) as store:
        want = (store.sessions(), store.stats().disk_bytes_used)
    with open_store(tmp_path, background=True) as store:
        assert store.wait_reopened(timeout=60) and not store.reopening
        assert (store.sessions(), store.stats().disk_bytes_used) == want
        assert want == (sids, du_once(tmp_path))  # the shared files counted once, as on the disk
        for i, sid in enumerate(sids):
            expect_prefix(store.lookup(sid, FP), SYSTEM + [i])


def test_a_session_named_while_the_scan_has_not_reached_it_is_indexed_by_that_call(tmp_path, monkeypatch):
    sids = fill(tmp_path)
    gate = Gate(monkeypatch)
    with open_store(tmp_path, background=True) as store:
        assert gate.waiting.wait(60) and store.reopening
        assert store.sessions() == []  # nothing indexed yet: the thread waits at the gate
        snap = store.lookup("s3", FP)  # indexed now, by this call
        expect_prefix(snap, SYSTEM + [3])
        assert store.tier_of("s4", FP) == "disk" and store.token_ids("s5", FP).tolist() == SYSTEM + [5]
        found = store.find("s2", FP, torch.tensor(SYSTEM + [2, 9]))
        assert found.own is not None and found.own.length == len(SYSTEM) + 1
        assert store.sessions() == ["s2", "s3", "s4", "s5"]
        gate.release()
        assert store.wait_reopened(timeout=60)
        # Each folder once: the thread read the others, and skipped the four the calls indexed (but the one it was
        # holding at the gate, read and then dropped), and nothing is counted twice.
        assert store.sessions() == sids and store.stats().disk_bytes_used == du_once(tmp_path)
        claimed = {store_dir(tmp_path, sid).name for sid in ("s2", "s3", "s4", "s5")}
        assert set(gate.scanned) | claimed == {p.name for p in (tmp_path / "sessions").iterdir()}
        assert len(set(gate.scanned) & claimed) <= 1


def test_a_session_extended_while_the_store_reopens_keeps_its_history(tmp_path, monkeypatch):
    fill(tmp_path)
    gate = Gate(monkeypatch)
    with open_store(tmp_path, background=True) as store:
        assert gate.waiting.wait(60)
        base = store.lookup("s1", FP)
        from .kvdata import kv
        with store.open_turn("s1", FP, base, torch.arange(base.length)) as turn:
            assert turn.append(torch.tensor([77]), *kv([77]))
        store.flush()
        gate.release()
        assert store.wait_reopened(timeout=60)
        expect_prefix(store.lookup("s1", FP), SYSTEM + [1, 77])
        used = store.stats().disk_bytes_used
    with open_store(tmp_path, background=False) as store:  # and so it is on disk
        expect_prefix(store.lookup("s1", FP), SYSTEM + [1, 77])
        assert store.stats().disk_bytes_used == used == du_once(tmp_path)


@pytest.mark.parametrize("with_fingerprint", [True, False])
def test_a_session_deleted_before_the_scan_reaches_it_stays_deleted(tmp_path, monkeypatch, with_fingerprint):
    fill(tmp_path)
    gate = Gate(monkeypatch)
    with open_store(tmp_path, background=True) as store:
        assert gate.waiting.wait(60)
        # By id alone the store cannot name the folder (its name hashes the model too): the scan removes it.
        assert store.delete("s2", FP if with_fingerprint else None) is with_fingerprint
        gate.release()
        assert store.wait_reopened(timeout=60)
        assert store.lookup("s2", FP) is None and "s2" not in store.sessions()
        store.flush()
        assert not store_dir(tmp_path, "s2").exists()
        expect_prefix(store.lookup("s3", FP), SYSTEM + [3])  # its shared files are still there for the others
        assert store.stats().disk_bytes_used == du_once(tmp_path)
    with open_store(tmp_path, background=False) as store:
        assert store.lookup("s2", FP) is None


def test_the_scan_survives_a_failing_folder_and_reports_it(tmp_path, monkeypatch, caplog):
    fill(tmp_path, n=4)
    bad = store_dir(tmp_path, "s1").name
    original = DiskTier.scan_folder

    def scan_folder(tier, folder, shared=None):
        if folder.name == bad:
            raise RuntimeError("injected")
        return original(tier, folder, shared)

    monkeypatch.setattr(DiskTier, "scan_folder", scan_folder)
    with caplog.at_level(logging.ERROR), open_store(tmp_path, background=True) as store:
        assert store.wait_reopened(timeout=60)
        assert store.sessions() == ["s0", "s2", "s3"]
    assert any("reopening" in r.getMessage() and "injected" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(DiskTier, "scan_folder", original)
    with open_store(tmp_path, background=True) as store:  # nothing was lost: the next reopen finds it
        assert store.wait_reopened(timeout=60) and store.sessions() == ["s0", "s1", "s2", "s3"]


def test_closing_while_the_store_reopens_stops_the_scan_and_loses_nothing(tmp_path, monkeypatch):
    sids = fill(tmp_path)
    gate = Gate(monkeypatch)
    store = open_store(tmp_path, background=True)
    assert gate.waiting.wait(60)
    closer = threading.Thread(target=store.close)
    closer.start()
    for _ in range(6000):  # the thread is released once the store is closed, so that it stops at the next folder
        if store._index.closed:
            break
        threading.Event().wait(0.01)
    gate.release()
    closer.join(60)
    assert not closer.is_alive() and store._reopening.thread is not None and not store._reopening.thread.is_alive()
    assert len(gate.scanned) < len(sids)  # it stopped early
    with open_store(tmp_path, background=False) as store:
        assert store.sessions() == sids


def test_after_a_background_reopen_the_disk_eviction_order_is_the_last_accesses(tmp_path, monkeypatch):
    """The thread indexes folders in the disk's order; at its end the eviction order is the sessions' last
    accesses, as a reopen at once leaves it, with a session used while the store reopened last."""
    sids = fill(tmp_path)
    with open_store(tmp_path, background=False) as store:
        at_once = list(store._index.disk_policy.victims())
    gate = Gate(monkeypatch)
    with open_store(tmp_path, background=True) as store:
        assert gate.waiting.wait(60)
        store.lookup("s0", FP)  # the oldest, used now
        gate.release()
        assert store.wait_reopened(timeout=60)
        assert list(store._index.disk_policy.victims()) == [k for k in at_once if k[1] != "s0"] + [(FP, "s0")]
    assert [k[1] for k in at_once] == sids  # (written in this order)


def test_a_damaged_folder_is_removed_by_the_scan_and_the_rest_serve(tmp_path):
    fill(tmp_path, n=3)
    manifest = store_dir(tmp_path, "s1") / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-10])
    with open_store(tmp_path, background=True) as store:
        assert store.wait_reopened(timeout=60)
        assert store.sessions() == ["s0", "s2"] and not store_dir(tmp_path, "s1").exists()
        assert store.stats().disk_bytes_used == du_once(tmp_path)


def test_a_session_deleted_by_id_while_the_store_reopens_is_not_served_from_redis_after(tmp_path, monkeypatch):
    """Its remote copy goes with its folder when the thread reaches it, as `delete` removes an indexed one's."""
    from hf_attnstore.lab.redis_server import RedisServer

    with RedisServer(tmp_path / "redis") as server:
        fill(tmp_path / "kv", n=3)
        with open_store(tmp_path / "kv", background=False, remote=server.url) as store:
            for sid in ("s0", "s1", "s2"):  # every session mirrored to Redis
                store.retain(sid, FP, 3600)
            store.flush()
            from .kvdata import kv
            with store.open_turn("s1", FP, store.lookup("s1", FP), torch.arange(len(SYSTEM) + 1)) as turn:
                assert turn.append(torch.tensor([55]), *kv([55]))  # a write: s1 is copied to Redis behind the disk
            store.flush()
            assert store.stats().remote_bytes_written > 0
        gate = Gate(monkeypatch)
        with open_store(tmp_path / "kv", background=True, remote=server.url) as store:
            assert gate.waiting.wait(60)
            store.delete("s1")
            gate.release()
            assert store.wait_reopened(timeout=60)
            store.flush()
            # The remote deletion is queued on the tier's writer, which `flush` does not wait for: wait for it here.
            store._remote._writer.submit(lambda: None).result(timeout=30)
            assert store.lookup("s1", FP) is None  # neither the disk copy nor the remote one
        with open_store(tmp_path / "kv", background=False, remote=server.url) as store:
            assert store.lookup("s1", FP) is None and store.lookup("s2", FP) is not None


def test_a_claim_that_fails_is_a_miss_and_the_next_call_tries_again(tmp_path, monkeypatch, caplog):
    fill(tmp_path, n=3)
    gate = Gate(monkeypatch)
    original, failing = DiskTier.scan_folder, {store_dir(tmp_path, "s2").name}

    def scan_folder(tier, folder, shared=None):
        if folder.name in failing and threading.current_thread().name != "attnstore-reopen":
            failing.clear()
            raise OSError("injected")
        return original(tier, folder, shared)

    with open_store(tmp_path, background=True) as store:
        assert gate.waiting.wait(60)
        monkeypatch.setattr(DiskTier, "scan_folder", scan_folder)  # (the gate's wrapper is what the thread runs)
        with caplog.at_level(logging.ERROR):
            assert store.lookup("s2", FP) is None
        assert any("injected" in r.getMessage() for r in caplog.records)
        expect_prefix(store.lookup("s2", FP), SYSTEM + [2])  # tried again, and found
        gate.release()
        assert store.wait_reopened(timeout=60) and store.sessions() == ["s0", "s1", "s2"]
