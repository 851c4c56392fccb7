"""The lower-tier interface (tier.py) as the disk tier implements it, and the save thread's use of it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hf_attnstore.store import AttnStore
from hf_attnstore.store.tiers.disk import MANIFEST, DiskTier
from hf_attnstore.store.format import FormatError, Manifest, Span, encode_chunk, prefix_digest
from hf_attnstore.store.tiers.base import SerialWriter, Tier

from .kvdata import FP, LAYERS, expect, kv, write_turn

KEY = (FP, "s")


def test_serial_writer_runs_in_order_and_survives_failures():
    writer = SerialWriter("test-writer")
    done = []

    def step(i):
        if i == 2:
            raise OSError("injected")
        done.append(i)
        return i * 10

    futures = [writer.submit(step, i) for i in range(5)]
    assert [f.result(5) for f in futures if f.exception(5) is None] == [0, 10, 30, 40]
    with pytest.raises(OSError, match="injected"):
        futures[2].result(5)
    assert done == [0, 1, 3, 4]  # submission order, and the thread went on after the failure
    assert writer.close(5)
    late = writer.submit(step, 9)
    with pytest.raises(RuntimeError, match="closed"):
        late.result(1)
    assert writer.close(5)  # idempotent


def test_serial_writer_close_waits_for_queued_writes_within_its_timeout():
    writer, release = SerialWriter("test-writer"), threading.Event()
    future = writer.submit(release.wait, 5)
    assert not writer.close(0.05)  # still writing: close says so instead of blocking for ever
    release.set()
    assert future.result(5) is True
    assert writer.close(5)


def encoded(ids, previous=""):
    keys, values = kv(ids)
    return encode_chunk(FP, "s", torch.tensor(ids), keys, values, prefix_digest(FP, torch.tensor([])), previous)


def test_disk_tier_implements_the_interface(tmp_path):
    tier = DiskTier(tmp_path / "kv", fsync=False)
    assert isinstance(tier, Tier) and tier.name == "disk"
    assert not tier.contains(KEY) and tier.manifest(KEY) is None
    data, digest = encoded([5, 6, 7])
    assert tier.put(KEY, "00000000.safetensors", data).result(5) == len(data)
    manifest = Manifest(FP, "s", torch.tensor([5, 6, 7]), (Span("00000000", 0, 3, digest),), 1)
    tier.put(KEY, MANIFEST, manifest.encode()).result(5)
    assert tier.contains(KEY) and tier.manifest(KEY).token_ids.tolist() == [5, 6, 7]
    assert tier.manifest((FP, "other")) is None and tier.manifest(("0" * 64, "s")) is None
    keys, values = kv([5, 6, 7])
    with tier.get(KEY, "00000000") as chunk:
        assert chunk.ids().tolist() == [5, 6, 7]
        for layer in range(LAYERS):
            k, v = torch.empty_like(keys[layer]), torch.empty_like(values[layer])
            assert chunk.read_layer_into(layer, 0, 3, k, v) == k.numel() * 4 * 2
            assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer])
    with pytest.raises(FormatError):
        tier.get((FP, "other"), "00000000")  # another session's key: refused before any byte is read
    [found] = list(tier.scan())
    assert found.manifest.session_id == "s" and found.chunks == {"00000000": (len(data), 3)}
    tier.put(KEY, "00000001.safetensors", encoded([8])[0]).result(5)
    tier.remove(KEY, keep={"00000000"})  # garbage collection: unreferenced chunks go, the manifest stays
    assert not (tier.session_dir(*KEY) / "00000001.safetensors").exists() and tier.contains(KEY)
    tier.remove(KEY)
    assert not tier.contains(KEY) and list(tier.scan()) == []
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.put(KEY, "x", b"").result(1)
    tier.close()  # idempotent


def test_a_failed_chunk_put_in_a_batch_commits_nothing_and_leaves_no_file(tmp_path, monkeypatch):
    """The save thread encodes the next chunk while the tier writes the previous one. When one chunk of a job
    fails, later ones may already be on disk: none of them may be referenced, kept or left uncounted."""
    store = AttnStore("64MiB", tmp_path / "kv", chunk_tokens=2, fsync=False, idle_flush_s=0.05, io_timeout_s=10)
    write_turn(store, "s", [1, 2, 3, 4])
    store.flush()
    real, calls = DiskTier.write_file, []

    def second_chunk_fails(disk, fp, sid, name, data):
        calls.append(name)
        if len(calls) == 2:
            raise OSError("injected")
        return real(disk, fp, sid, name, data)

    monkeypatch.setattr(DiskTier, "write_file", second_chunk_fails)
    snap = store.lookup("s", FP)
    write_turn(store, "s", [5, 6, 7, 8, 9, 10], keep_from=snap)
    with pytest.raises(Exception, match="injected"):
        store.flush(timeout=5)
    folder = store._disk.session_dir(*KEY)
    on_disk = sorted(p.name for p in folder.iterdir())
    assert on_disk == ["00000000.safetensors", "00000001.safetensors", MANIFEST], on_disk
    assert store.stats().disk_bytes_used == sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.iterdir())
    monkeypatch.setattr(DiskTier, "write_file", real)
    store.flush(timeout=5)
    store.close()
    with AttnStore("64MiB", tmp_path / "kv", fsync=False) as reopened:
        expect(reopened.lookup("s", FP), list(range(1, 11)))


def test_close_lets_a_write_in_flight_finish_before_releasing_the_folder(tmp_path, monkeypatch):
    real, entered = DiskTier.write_file, threading.Event()

    def slow(disk, *args):
        entered.set()
        time.sleep(0.3)
        return real(disk, *args)

    monkeypatch.setattr(DiskTier, "write_file", slow)
    store = AttnStore("64MiB", tmp_path / "kv", chunk_tokens=4, fsync=False, idle_flush_s=0.05)
    write_turn(store, "s", [1, 2, 3])
    store.close()
    assert entered.is_set()
    monkeypatch.setattr(DiskTier, "write_file", real)
    with AttnStore("64MiB", tmp_path / "kv", fsync=False) as reopened:
        expect(reopened.lookup("s", FP), [1, 2, 3])
