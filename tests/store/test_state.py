"""Hybrid models' states in the store (state.py): kept with the KV after exactly their tokens, written and read
back through every tier with their integrity checks, and dropped (a clean miss) on any doubt."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore.store import AttnStore
from hf_attnstore.store.tiers.disk import CHUNK_SUFFIX
from hf_attnstore.store.format import FormatError, Manifest, Span, StateRef, prefix_digest, session_dirname
from hf_attnstore.lab.redis_server import RedisServer
from hf_attnstore.store.states import SessionState

from .kvdata import FP, expect, kv

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=4)
KEY = (FP, "s")


def states(seed: float = 0.0) -> dict[str, torch.Tensor]:
    return {"L0000.c0": torch.full((1, 6, 3), 1.0 + seed), "L0000.r0": torch.full((1, 2, 4, 4), 2.0 + seed),
            "L0002.c0": torch.arange(18, dtype=torch.float32).view(1, 6, 3) + seed}


def sealed(ids: list[int], seed: float = 0.0) -> SessionState:
    return SessionState.capture(len(ids), states(seed)).sealed(KEY, prefix_digest(FP, torch.tensor(ids)))


def turn(store, session, ids, state=True, keep_from=None, seed=0.0):
    """Appends `ids` after `keep_from` and ends the turn with the states after them (as AttnStoreCache does)."""
    keep = torch.arange(keep_from.length) if keep_from is not None else torch.arange(0)
    writer = store.open_turn(session, FP, keep_from, keep)
    assert writer.append(torch.tensor(ids), *kv(ids))
    total = len(ids) + (keep_from.length if keep_from is not None else 0)
    writer.close(SessionState.capture(total, states(seed)) if state else None)


def same(a: SessionState, b: SessionState) -> bool:
    return a.tokens == b.tokens and a.digest == b.digest and all(torch.equal(a.tensors[n], b.tensors[n])
                                                                 for n in a.tensors)


class TestFormat:
    def test_round_trip_and_every_doubt_is_a_format_error(self):
        state = sealed([5, 6, 7])
        data = state.encode()
        assert same(SessionState.decode(data, KEY, state.ref), state)
        with pytest.raises(FormatError, match="another model or session"):
            SessionState.decode(data, (FP, "t"), state.ref)
        with pytest.raises(FormatError, match="pinned"):
            SessionState.decode(data, KEY, StateRef(state.ref.name, 4, state.digest))
        with pytest.raises(FormatError, match="pinned"):
            SessionState.decode(data, KEY, StateRef(state.ref.name, 3, "0" * 32))
        damaged = bytearray(data)
        damaged[-2] ^= 0x01  # a flipped bit in the last tensor's data
        with pytest.raises(FormatError, match="checksum"):
            SessionState.decode(bytes(damaged), KEY, state.ref)
        with pytest.raises(FormatError):
            SessionState.decode(data[: len(data) // 2], KEY, state.ref)

    def test_only_float_states_with_our_names_are_captured(self):
        with pytest.raises(TypeError):
            SessionState.capture(3, {"L0000.c0": torch.zeros(2, dtype=torch.int64)})
        with pytest.raises(TypeError):
            SessionState.capture(3, {"../x": torch.zeros(2)})
        # Importance scores: labelled by what they sum, or unlabelled as older versions wrote them (read, unused).
        for name in ("I0001.alisa32", "I0001.h2o", "I0001"):
            SessionState.capture(3, {name: torch.zeros(2, 3)})
        with pytest.raises(TypeError):
            SessionState.capture(3, {"I0001.snapkv": torch.zeros(2, 3)})

    def test_the_manifest_keeps_its_state_only_with_all_its_tokens_in_place(self):
        ref = sealed([1, 2, 3, 4]).ref
        manifest = Manifest(FP, "s", torch.arange(1, 9), (Span("00000000", 0, 8, "ab"),), 1, (), ref)
        assert Manifest.decode(manifest.encode(), FP).state == ref
        assert manifest.select([(0, 6)]).state == ref
        assert manifest.select([(0, 3)]).state is None  # cut inside the tokens it summarizes
        assert manifest.select([(0, 2), (3, 8)]).state is None  # a truncation dropped one of them
        too_long = Manifest(FP, "s", torch.arange(1, 3), (Span("00000000", 0, 2, "ab"),), 1, (), ref)
        with pytest.raises(FormatError, match="state covers more tokens"):
            Manifest.decode(too_long.encode(), FP)
        for bad in (["../x", 4, "ab"], ["s-ab", 0, "ab"], ["s-ab", True, "ab"]):
            with pytest.raises(FormatError, match="malformed state"):
                StateRef.decode(bad)


def test_a_state_is_kept_only_after_exactly_the_stored_kv(tmp_path):
    store = AttnStore(host_bytes="64MiB")
    turn(store, "s", [1, 2, 3, 4])
    snap = store.lookup("s", FP)
    assert snap.state is not None and snap.state.tokens == 4 and snap.state.key == KEY
    assert snap.state.prefix == prefix_digest(FP, torch.tensor([1, 2, 3, 4]))
    # A turn that claims states after more tokens than it stored: refused, the old state stays.
    writer = store.open_turn("s", FP, snap, torch.arange(4))
    writer.append(torch.tensor([5]), *kv([5]))
    writer.close(SessionState.capture(7, states()))
    snap2 = store.lookup("s", FP)
    assert store.stats().states_refused == 1 and snap2.state.tokens == 4  # a prefix checkpoint still
    # An older turn ending after a newer one took the session over: its states are refused.
    old = store.open_turn("s", FP, snap2, torch.arange(5))
    old.append(torch.tensor([6]), *kv([6]))
    new = store.open_turn("s", FP, store.lookup("s", FP), torch.arange(6))
    new.append(torch.tensor([7]), *kv([7]))
    old.close(SessionState.capture(6, states()))
    new.close(SessionState.capture(7, states(1.0)))
    snap3 = store.lookup("s", FP)
    assert snap3.state.tokens == 7 and torch.equal(snap3.state.tensors["L0000.r0"], states(1.0)["L0000.r0"])
    assert store.stats().states_refused == 2
    # A cut inside the tokens a state summarizes drops it (and the bytes it counted).
    cut = store.open_turn("s", FP, snap3, torch.arange(5))
    cut.append(torch.tensor([9]), *kv([9]))
    cut.close()
    assert store.lookup("s", FP).state is None
    assert store.stats().host_bytes_used == store._index.entries[KEY].host.nbytes


def test_the_state_goes_to_disk_and_comes_back_verified(tmp_path):
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), **FAST)
    turn(store, "s", list(range(10)))
    store.flush()
    written = store.lookup("s", FP).state
    store.close()
    folder = tmp_path / "sessions" / session_dirname(*KEY)
    assert (folder / (written.ref.name + CHUNK_SUFFIX)).is_file()
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), **FAST)
    snap = store.lookup("s", FP)
    assert snap.tier == "disk" and snap.state is None  # a snapshot taken before the load read it
    expect(snap, list(range(10)))
    assert same(snap.source.state, written)
    # The next turn extends it, with new states: the old state file is collected after the new one is durable.
    turn(store, "s", [10, 11], keep_from=store.lookup("s", FP), seed=2.0)
    store.flush()
    names = sorted(p.name for p in folder.glob("s-*"))
    assert names == [store.lookup("s", FP).state.ref.name + CHUNK_SUFFIX]
    assert store.stats().disk_bytes_used == sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.iterdir())
    store.close()


@pytest.mark.parametrize("damage", ["flip", "delete", "swap"])
def test_a_damaged_or_missing_state_file_is_a_clean_miss(tmp_path, damage):
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), **FAST)
    turn(store, "s", list(range(8)))
    turn(store, "t", list(range(8)), seed=3.0)
    store.flush()
    store.close()
    folder = tmp_path / "sessions" / session_dirname(*KEY)
    path = next(folder.glob("s-*"))
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "delete":
        path.unlink()
    else:  # another session's state file under this one's name
        other = next((tmp_path / "sessions" / session_dirname(FP, "t")).glob("s-*"))
        path.write_bytes(other.read_bytes())
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), **FAST)
    snap = store.lookup("s", FP)
    if snap is not None:  # found at reopen (the file is there): the load reads the state and fails
        with pytest.raises(Exception):
            snap.loader.wait_all()
        assert store.stats().load_errors == 1
    assert store.lookup("s", FP) is None  # dropped: a clean miss
    expect(store.lookup("t", FP), list(range(8)))  # the other session is untouched
    store.close()


def test_sessions_with_a_state_are_never_partially_evicted(tmp_path):
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), partial_eviction=True, **FAST)
    for i, session in enumerate("abc"):
        turn(store, session, list(range(16)), seed=float(i))
    store.flush()
    store.close()
    # A disk tier that fits two of the three sessions: one goes whole, none loses its head.
    per_session = sum(p.stat().st_size for p in (tmp_path / "sessions" / session_dirname(FP, "a")).iterdir())
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), partial_eviction=True,
                      disk_bytes=int(2.5 * (per_session + 6 * 4096)), **FAST)
    turn(store, "d", list(range(16)), seed=4.0)
    store.flush()
    stats = store.stats()
    assert stats.head_drops == 0 and stats.disk_drops >= 1
    for session in "abcd":
        snap = store.lookup(session, FP)
        assert snap is None or snap.head == 0
    store.close()


def test_the_state_travels_through_the_remote_tier(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        a = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path / "a"), remote=server.url, **FAST)
        turn(a, "s", list(range(9)))
        a.flush()
        written = a.lookup("s", FP).state
        b = AttnStore(host_bytes="64MiB", remote=server.url, **FAST)  # no disk: the remote tier is below host
        snap = b.lookup("s", FP)
        assert snap.tier == "remote"
        expect(snap, list(range(9)))
        assert same(snap.source.state, written)
        # Redis evicted the state: the manifest is served without it (the KV alone, which a hybrid cannot use).
        b.close()
        server_client = a._remote.client
        server_client.delete(a._remote.key_of(KEY, "c:" + written.digest))
        c = AttnStore(host_bytes="64MiB", remote=server.url, **FAST)
        snap = c.lookup("s", FP)
        snap.loader.wait_all()
        assert snap.source.state is None
        for store in (a, c):
            store.close()
