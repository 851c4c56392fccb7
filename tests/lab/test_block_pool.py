"""The block pool: prompts' blocks deduplicated across sessions, capacity in blocks, evicted by a block policy."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore import AttnStore
from hf_attnstore.store import StoreConfig
from hf_attnstore.lab import block_pool as block_pool_module
from hf_attnstore.lab.block_pool import BlockPool, BlockPoolConfig
from hf_attnstore.store.buffer import SessionBuffer
from hf_attnstore.store.store import POOL_SESSION


def _snapshot(ids: list[int]):
    buf = SessionBuffer((1, 1, 2), torch.float32, pin_memory=False)
    kv = [torch.arange(2.0 * len(ids)).view(1, 1, len(ids), 2)]
    buf.append(torch.tensor(ids), kv, kv)
    return buf.snapshot()


def _store_turn(store: AttnStore, session: str, ids: list[int], inexact_at: int | None = None):
    kv = [torch.randn(1, 2, len(ids), 4)]
    with store.open_turn(session, "fp", None, torch.empty(0)) as turn:
        assert turn.append(torch.tensor(ids), kv, kv, inexact_at=inexact_at)
    return kv


def test_blocks_are_stored_once_and_matched_block_by_block():
    pool = BlockPool(BlockPoolConfig(blocks=10, block_tokens=2), pin_memory=False)
    assert pool.store("fp", _snapshot([1, 2, 3, 4, 5])) == (3, 0)  # [1 2] [3 4] [5]
    assert pool.store("fp", _snapshot([1, 2, 3, 4, 6, 7])) == (1, 0)  # only [6 7] is new
    assert len(pool) == 4
    found, snap = pool.match("fp", torch.tensor([1, 2, 3, 4, 6, 7, 8]))
    assert found == 6 and snap.token_ids.tolist() == [1, 2, 3, 4, 6, 7]
    (k, _), = snap.layer_parts(0, 2)
    assert k.flatten().tolist() == [0.0, 1.0, 2.0, 3.0]  # the KV stored for [1 2]
    assert pool.match("fp", torch.tensor([1, 2, 3, 4, 5, 9]))[0] == 4  # [5] is a block of one token, not [5 9]'s
    assert pool.match("other-model", torch.tensor([1, 2, 3]))[0] == 0


def test_a_block_is_reused_only_for_the_same_ids_even_if_hashes_collide(monkeypatch):
    # Every block hashes alike: the ids compared under the lock still tell the blocks apart.
    monkeypatch.setattr(block_pool_module, "block_hashes", lambda ids, block, partial: [b"x"] * -(-len(ids) // block))
    pool = BlockPool(BlockPoolConfig(blocks=10, block_tokens=2), pin_memory=False)
    pool.store("fp", _snapshot([1, 2]))
    assert pool.match("fp", torch.tensor([1, 9, 4]))[0] == 0
    assert pool.match("fp", torch.tensor([1, 2, 4]))[0] == 2


def test_eviction_follows_the_block_policy_one_block_at_a_time():
    # Two blocks of room; a chain [1 2][3 4], then another prompt [9 9]. Plain LRU evicts the chain's first block
    # (touched before its child); leaf-first LRU evicts its leaf and keeps the first block's hit.
    hits = {}
    for policy in ("lru", "lru-leaf"):
        pool = BlockPool(BlockPoolConfig(blocks=2, block_tokens=2, policy=policy), pin_memory=False)
        pool.store("fp", _snapshot([1, 2, 3, 4]))
        assert pool.store("fp", _snapshot([9, 9])) == (1, 1)
        hits[policy] = pool.match("fp", torch.tensor([1, 2, 3, 4, 5]))[0]
        assert len(pool) == 2
    assert hits == {"lru": 0, "lru-leaf": 2}


def test_a_store_shares_prompts_through_the_pool_and_counts_it():
    store = AttnStore(host_bytes="1MiB", share_prefixes=False,
                      block_pool=BlockPoolConfig(blocks=4, block_tokens=4, policy="lru-leaf"))
    kv = _store_turn(store, "alice", list(range(10)))
    found = store.find("bob", "fp", torch.tensor(list(range(8)) + [99, 98]))
    assert found.own is None and found.shared.session_id == POOL_SESSION
    assert found.shared.token_ids.tolist() == list(range(8)) and found.shared.tier == "host"
    keys = torch.cat([k for k, _ in found.shared.snapshot.layer_parts(0)], dim=2)  # one part per block
    assert torch.equal(keys, kv[0][:, :, :8])
    s = store.stats()
    assert (s.block_lookups, s.block_hit_tokens, s.blocks_inserted, s.blocks_evicted, s.pool_blocks) == (1, 8, 3, 0, 3)
    # A prompt found whole: its hit counts every token; the turn may reuse all but the last.
    found = store.find("carol", "fp", torch.arange(10))
    assert store.stats().block_hit_tokens == 18 and found.shared.length == 10
    store.close()


def test_a_turn_starts_from_pooled_blocks_and_only_its_prompt_enters_the_pool():
    store = AttnStore(host_bytes="1MiB", share_prefixes=False, block_pool=BlockPoolConfig(blocks=100, block_tokens=4))
    _store_turn(store, "alice", list(range(8)))
    found = store.find("bob", "fp", torch.tensor(list(range(8)) + [50, 51]))
    kv = [torch.randn(1, 2, 2, 4)]
    with store.open_turn("bob", "fp", found.shared.snapshot, torch.arange(8)) as turn:
        assert turn.append(torch.tensor([50, 51]), kv, kv)  # the prompt: [0..3] [4..7] touched, [50 51] inserted
        assert turn.append(torch.tensor([60]), [torch.randn(1, 2, 1, 4)], [torch.randn(1, 2, 1, 4)])  # a reply
    assert store.token_ids("bob", "fp").tolist() == list(range(8)) + [50, 51, 60]
    assert store.stats().pool_blocks == 3  # the reply's token is no block: what the next prompt holds will be
    store.close()


def test_inexact_kv_never_enters_the_pool():
    store = AttnStore(host_bytes="1MiB", share_prefixes=False, block_pool=BlockPoolConfig(blocks=100, block_tokens=4))
    _store_turn(store, "alice", list(range(12)), inexact_at=6)  # tokens 6.. computed under sparse attention
    assert store.stats().pool_blocks == 1  # [0..3] only: [4..7] holds inexact tokens, and [4 5] is no block
    store.close()


def test_without_a_pool_nothing_is_counted():
    store = AttnStore(host_bytes="1MiB")
    _store_turn(store, "alice", list(range(100)))
    found = store.find("bob", "fp", torch.tensor(list(range(70)) + [999]))
    assert found.shared.session_id == "alice"  # the session table, as before
    assert store.stats().block_lookups == 0 and store.stats().pool_blocks == 0
    store.close()


def test_the_settings_say_what_to_do():
    with pytest.raises(ValueError, match="capacity in blocks"):
        BlockPoolConfig(blocks=0)
    with pytest.raises(ValueError, match="unknown"):
        BlockPoolConfig(blocks=10, policy="mru")
    with pytest.raises(ValueError, match="block_tokens"):
        BlockPoolConfig(blocks=10, block_tokens=0)
    with pytest.raises(TypeError, match="BlockPoolConfig"):
        StoreConfig(block_pool={"blocks": 10})
