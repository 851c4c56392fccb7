"""`AttnStore.find`: one call returns what a turn plans from (its own KV, a longer shared prefix, the states),
checked by the store: any doubt is a miss."""

from __future__ import annotations

import dataclasses

import torch

from hf_attnstore.store import AttnStore, Found
from hf_attnstore.store.format import prefix_digest, session_dirname
from hf_attnstore.store.store import verified_state
from hf_attnstore.store.states import SessionState

from .kvdata import FP, kv
from .test_state import FAST, states

SYSTEM = list(range(100, 200))  # a shared system prompt of 100 tokens (more than one prefix block)


def turn(store, session, ids, state=False):
    """A new history `ids` for `session`, ended with states after them when `state`."""
    writer = store.open_turn(session, FP, None, torch.arange(0))
    assert writer.append(torch.tensor(ids), *kv(ids))
    writer.close(SessionState.capture(len(ids), states()) if state else None)


def test_an_exact_hit_returns_the_own_session_and_nothing_shared():
    store = AttnStore(host_bytes="64MiB")
    turn(store, "s", list(range(10)), state=True)
    found = store.find("s", FP, torch.arange(11))
    assert found.shared is None and found.own.session_id == "s" and found.own.tier == "host"
    assert found.own.token_ids.tolist() == list(range(10)) and found.own.head == 0
    assert found.own.state.tokens == 10  # verified: this session's, after exactly its first 10 ids
    assert store.find("t", FP, torch.arange(11)) == Found(None, None)  # another session: a miss
    assert store.find("s", "g" * 64, torch.arange(11)).own is None  # another model: a miss
    assert store.stats().lookups == 3


def test_a_longer_prefix_of_another_session_comes_with_the_own_one():
    store = AttnStore(host_bytes="64MiB")
    turn(store, "alice", SYSTEM + [7, 8])
    turn(store, "bob", SYSTEM[:20] + [999])
    found = store.find("bob", FP, torch.tensor(SYSTEM + [9]))
    assert found.own.length == 21 and found.shared.session_id == "alice"
    assert found.shared.token_ids.tolist() == SYSTEM and found.shared.tier == "host"
    # Not longer than what the own KV shares with the prompt: nothing shared.
    turn(store, "carol", SYSTEM + [5])
    assert store.find("carol", FP, torch.tensor(SYSTEM + [9])).shared is None
    # Not asked for (a hybrid model, a truncated prompt): nothing shared.
    assert store.find("bob", FP, torch.tensor(SYSTEM + [9]), share=False).shared is None
    # A prompt that is all shared prefix: a turn computes at least its last token, so the shared match must reuse
    # more than the own one up to the prompt's last token but one.
    found = store.find("dave", FP, torch.tensor(SYSTEM))
    assert found.own is None and found.shared.token_ids.tolist() == SYSTEM


def test_a_shared_prefix_is_found_on_disk_and_loaded(tmp_path):
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), **FAST)
    turn(store, "alice", SYSTEM + [7, 8])
    store.flush()
    store.evict("alice")
    found = store.find("bob", FP, torch.tensor(SYSTEM + [9]), wait_first=True)
    assert found.own is None and found.shared.tier == "disk" and found.shared.length == 100
    found.shared.snapshot.loader.wait_all()
    store.close()


def test_states_that_are_not_this_sessions_or_not_of_its_ids_are_not_returned():
    store = AttnStore(host_bytes="64MiB")
    turn(store, "s", list(range(8)), state=True)
    snap = store.lookup("s", FP)
    assert verified_state(snap) is not None
    other_ids = SessionState.capture(8, states()).sealed((FP, "s"), prefix_digest(FP, torch.arange(1, 9)))
    other_session = SessionState.capture(8, states()).sealed((FP, "t"), prefix_digest(FP, torch.arange(8)))
    for state in (other_ids, other_session):
        assert verified_state(dataclasses.replace(snap, state=state)) is None
    # The same through `find`: a state whose digest does not match the stored ids is not offered (the KV still is).
    store._index.entries[(FP, "s")].host.state = other_ids
    found = store.find("s", FP, torch.arange(9), wait_first=True)
    assert found.own.length == 8 and found.own.state is None


def test_a_damaged_session_is_a_miss_when_waited_for(tmp_path):
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), **FAST)
    turn(store, "s", list(range(8)), state=True)
    store.flush()
    store.close()
    path = next((tmp_path / "sessions" / session_dirname(FP, "s")).glob("s-*"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # a flipped bit in the state file: its checksum fails when the load reads it
    path.write_bytes(bytes(data))
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), **FAST)
    assert store.find("s", FP, torch.arange(9), wait_first=True).own is None
    assert store.find("s", FP, torch.arange(9)).own is None  # dropped: a clean miss from now on
    store.close()


def test_kv_of_other_shapes_is_a_miss():
    store = AttnStore(host_bytes="64MiB")
    turn(store, "s", list(range(8)))
    geometry = store.lookup("s", FP).source.geometry
    assert store.find("s", FP, torch.arange(9), geometry=geometry).own is not None
    assert store.find("s", FP, torch.arange(9), geometry=(9, 9, 9)).own is None
