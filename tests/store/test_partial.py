"""Partial eviction (StoreConfig.partial_eviction): cold sessions lose their leading chunks first."""

from __future__ import annotations

import time

import pytest
import torch

from hf_attnstore.store import AttnStore
from hf_attnstore.store.index import blocks
from hf_attnstore.store.tiers.disk import MANIFEST as MANIFEST_NAME
from hf_attnstore.store.format import FormatError, Manifest, session_dirname
from hf_attnstore.store.policy import choose_head_drops, recompute_cost

from .kvdata import FP, kv, layer_of, write_turn

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10)
CHUNK = 4


@pytest.fixture
def kvdir(tmp_path):
    return tmp_path / "kv"


def make(kvdir, **kw):
    return AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(kvdir), "chunk_tokens": CHUNK, **FAST, **kw})


def session_bytes(kvdir, session):
    folder = kvdir / "sessions" / session_dirname(FP, session)
    return sum(blocks(p.stat().st_size) for p in folder.iterdir())


def expect_tail(snapshot, ids, head):
    """The snapshot covers `ids`, misses exactly its first `head` tokens' KV, and holds the rest exactly."""
    assert snapshot.token_ids.tolist() == ids and snapshot.head == head
    keys, values = kv(ids)
    for layer in range(3):
        k, v = layer_of(snapshot, layer)
        assert torch.equal(k[:, :, head:], keys[layer][:, :, head:])
        assert torch.equal(v[:, :, head:], values[layer][:, :, head:])


def fill(kvdir, names, tokens=12, **kw):
    """Writes `names` (oldest first) to disk, then reopens with a disk tier that holds all of them but one
    chunk less than needed for one more session of `tokens` tokens (and the room a head drop's new manifest takes
    while it is written beside the old one)."""
    with make(kvdir) as store:
        for i, name in enumerate(names):
            write_turn(store, name, list(range(100 * i, 100 * i + tokens)))
            time.sleep(0.02)  # distinct last-use times
    total = sum(session_bytes(kvdir, n) for n in names)
    return make(kvdir, disk_bytes=total + 3 * 4096, partial_eviction=True, **kw)


# -- the victim choice (shared with the simulator) --------------------------------------------------------
def test_recompute_cost_grows_along_the_history():
    assert recompute_cost(0, 256) < recompute_cost(256, 512) < recompute_cost(4096, 4352)
    assert recompute_cost(0, 256) == pytest.approx(256 * (1 + 255 / 2 / 16384))


def test_choose_head_drops_takes_heads_of_idle_sessions_first():
    units = [(0, 4, 10), (4, 8, 10), (8, 12, 10)]
    # "old" idle 100 s, "new" idle 1 s: old loses chunks until its next chunk is worth more than new's head.
    chosen = choose_head_drops([("new", 1.0, units), ("old", 100.0, units)], overflow=25)
    assert chosen == ["old", "old", "old"]
    # With attention dominating (a short `attention_tokens`), later chunks cost more: the head of a session
    # idle half as long goes before the third chunk of the older one.
    chosen = choose_head_drops([("new", 50.0, units), ("old", 100.0, units)], overflow=25, attention_tokens=4)
    assert chosen == ["old", "old", "new"]
    assert choose_head_drops([("a", 1.0, units)], overflow=0) == []
    assert choose_head_drops([("a", 1.0, units)], overflow=1000) == ["a", "a", "a"]  # all it has


# -- the manifest ------------------------------------------------------------------------------------------
def test_manifest_with_a_dropped_head_round_trips_and_selects():
    from hf_attnstore.store.format import Span

    spans = tuple(Span(f"{i:08d}", 0, 4, f"d{i}") for i in range(3))
    m = Manifest(FP, "s", torch.arange(12), spans, 3).drop_head_span()
    assert m.head == 4 and [s.chunk for s in m.spans] == ["00000001", "00000002"]
    back = Manifest.decode(m.encode(), FP)
    assert back.head == 4 and back.dropped == m.dropped and back.spans == m.spans
    cut = m.select([(0, 6)])
    assert cut.head == 4 and cut.length == 6 and cut.spans[0].end == 2
    inside = m.select([(0, 3)])  # only head tokens: a manifest of a head, nothing stored
    assert inside.head == 3 and inside.spans == ()
    kept = m.select([(0, 2), (6, 12)])  # sinks of the head, then stored tokens after a gap (rebased)
    assert kept.head == 2 and kept.length == 8 and all(s.rebased for s in kept.spans)
    # A manifest whose dropped and stored spans do not add up to its ids is refused.
    bad = Manifest(FP, "s", torch.arange(13), m.spans, 3, m.dropped)
    with pytest.raises(FormatError, match="cover"):
        Manifest.decode(bad.encode(), FP)


# -- the store -------------------------------------------------------------------------------------------
def test_the_oldest_session_loses_its_head_and_loads_the_rest(kvdir):
    store = fill(kvdir, ["old", "mid", "new"])
    ids = list(range(500, 512))
    write_turn(store, "d", ids)
    store.flush()
    s = store.stats()
    assert s.head_drops >= 1 and s.disk_drops == 0 and s.head_dropped_tokens == CHUNK * s.head_drops
    assert s.disk_bytes_used <= store.config.disk_bytes
    snap = store.lookup("old", FP)
    head = snap.head
    assert head == CHUNK * s.head_drops
    expect_tail(snap, list(range(0, 12)), head)
    for name, i in (("mid", 1), ("new", 2)):  # the younger sessions are whole
        snap = store.lookup(name, FP)
        assert snap.head == 0
    store.close()
    # The dropped head is durable: a reopened store finds the same session, head still missing.
    with make(kvdir, partial_eviction=True) as store:
        snap = store.lookup("old", FP)
        expect_tail(snap, list(range(0, 12)), head)
        assert len(list((kvdir / "sessions" / session_dirname(FP, "old")).glob("*.safetensors"))) == 3 - head // CHUNK


def test_fill_head_makes_the_host_copy_whole_once(kvdir):
    store = fill(kvdir, ["old", "mid", "new"])
    write_turn(store, "d", list(range(500, 512)))
    store.flush()
    snap = store.lookup("old", FP)
    head = snap.head
    assert head > 0
    keys, values = kv(list(range(12)))
    head_kv = ([k[:, :, :head] for k in keys], [v[:, :, :head] for v in values])
    layer_of(snap, 2)  # the load has finished
    assert store.fill_head(snap, *head_kv)
    assert not store.fill_head(snap, *head_kv)  # claimed: a second turn changes nothing
    again = store.lookup("old", FP)
    assert again.head == 0
    k, v = layer_of(again, 1)
    assert torch.equal(k, keys[1]) and torch.equal(v, values[1])
    # A turn appends after the whole session; the disk copy keeps its head dropped (it is not rewritten).
    write_turn(store, "old", [7, 7], keep_from=again)
    store.flush()
    with open(kvdir / "sessions" / session_dirname(FP, "old") / MANIFEST_NAME, "rb") as f:
        manifest = Manifest.decode(f.read(), FP)
    assert manifest.head == head and manifest.length == 14
    store.close()
    with make(kvdir, partial_eviction=True) as store:
        snap = store.lookup("old", FP)
        assert snap.head == head and snap.token_ids.tolist() == list(range(12)) + [7, 7]
        k, _ = layer_of(snap, 0)
        assert torch.equal(k[:, :, head:12], keys[0][:, :, head:])


def test_sessions_the_scheduler_queued_are_not_shrunk(kvdir):
    store = fill(kvdir, ["old", "mid", "new"], policy="lookahead")
    store.set_schedule(["old"])
    write_turn(store, "d", list(range(500, 512)))
    store.flush()
    assert store.lookup("old", FP).head == 0
    assert store.lookup("mid", FP).head > 0  # the next-oldest idle session paid instead
    store.close()


def test_without_partial_eviction_whole_sessions_leave(kvdir):
    store = fill(kvdir, ["old", "mid", "new"])
    store.close()
    with make(kvdir, disk_bytes=store.config.disk_bytes) as store:
        write_turn(store, "d", list(range(500, 512)))
        store.flush()
        s = store.stats()
        assert s.head_drops == 0 and s.disk_drops >= 1
        assert store.lookup("old", FP) is None


def test_a_failed_manifest_write_drops_the_whole_copy(kvdir, monkeypatch):
    store = fill(kvdir, ["old", "mid", "new"])
    real = store._disk.write_file

    def write_file(fp, sid, name, data):
        if name == MANIFEST_NAME and sid == "old":
            raise OSError(28, "No space left on device")
        return real(fp, sid, name, data)

    monkeypatch.setattr(store._disk, "write_file", write_file)
    write_turn(store, "d", list(range(500, 512)))
    store.flush()
    assert store.lookup("old", FP) is None  # a clean miss, never a manifest that disagrees with the files
    assert store.stats().disk_bytes_used <= store.config.disk_bytes
    store.close()


def test_making_room_for_a_write_lets_the_write_happen(kvdir):
    """Regression: bytes queued for deletion counted as used when deciding whether a file fits, so a write
    that evicted other sessions to make room was then refused as 'larger than the disk tier'."""
    with make(kvdir) as store:
        for i, name in enumerate(["a", "b", "c"]):
            write_turn(store, name, list(range(100 * i, 100 * i + 12)))
    one = session_bytes(kvdir, "a")
    with make(kvdir, disk_bytes=3 * one) as store:  # room for three: the fourth evicts one
        write_turn(store, "d", list(range(500, 512)))
        store.flush()
        s = store.stats()
        assert s.rejected_too_large == 0 and s.disk_drops == 1 and s.disk_sessions == 3
        store.evict("d")
        assert store.tier_of("d", FP) == "disk"
