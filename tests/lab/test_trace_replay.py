"""The first requests of Mooncake's trace through the real store (a block pool, a tiny model) against the simulator.

The done-when of issue 48's item 5: the store's measured hit equals the simulator's, request by request, for the
same capacity and policy. Each case is also checked to be non-trivial (hits and evictions happened) and to
discriminate (the simulator with another policy, or one block more, disagrees with this store).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_attnstore.lab.trace_replay import BlockRuns, ReplayConfig, format_replay, replay_trace, scale_requests, tiny_model
from hf_attnstore.lab.trace_sim import TraceSimConfig, simulate_trace
from hf_attnstore.lab.traces import TraceRequest, chat_trace, load_trace

from .test_trace_sim import SHARED_TRACE

REQUESTS, BLOCK = 150, 8


@pytest.fixture(scope="module")
def trace():
    if not SHARED_TRACE.exists():
        pytest.skip(f"the shared Mooncake trace is not at {SHARED_TRACE}")
    return load_trace(SHARED_TRACE, limit=REQUESTS)


@pytest.fixture(scope="module")
def model(trace):
    return tiny_model(max(r.input_length for r in scale_requests(trace, BLOCK)) + 1)


@pytest.mark.parametrize("policy", ["lru", "slru"])
@pytest.mark.parametrize("capacity", [200, 1600])
def test_store_hits_equal_the_simulators_request_by_request(trace, model, capacity, policy):
    config = ReplayConfig(capacity_blocks=capacity, policy=policy, block_tokens=BLOCK, check_exact=False)
    result = replay_trace(trace, config, model)
    assert result.store_hits == result.sim_hits
    assert sum(result.store_hits) >= 10 * BLOCK and sum(h > 0 for h in result.store_hits) >= 2, "too few hits"
    assert result.evictions > 1000, "the pool must have been full for most requests"
    # A turn reuses its hit, but for the last token of a prompt found whole (it must compute one).
    assert result.reused == [min(h, n - 1) for h, n in zip(result.store_hits, result.input_tokens)]
    # The comparison discriminates: the other policy hits differently on these requests. (A block more or less
    # often does not: few of the first requests hit, each for many blocks. The chat trace below checks that.)
    other = "lru" if policy == "slru" else "slru"
    scaled = scale_requests(trace, BLOCK)
    assert simulate_trace(scaled, TraceSimConfig(capacity * BLOCK, other, block=BLOCK)).host_hits != result.store_hits


@pytest.fixture(scope="module")
def chats():
    return chat_trace(conversations=40, seed=0)  # 201 turns of growing conversations: dense reuse


@pytest.mark.parametrize("policy", ["lru", "lru-leaf", "slru"])
@pytest.mark.parametrize("capacity", [20, 40])
def test_a_dense_chat_trace_replays_exactly_and_one_block_changes_it(chats, capacity, policy):
    result = replay_trace(chats, ReplayConfig(capacity_blocks=capacity, policy=policy, block_tokens=BLOCK,
                                              check_exact=False))
    assert result.store_hits == result.sim_hits
    assert sum(h > 0 for h in result.store_hits) > 50 and result.evictions > 100
    assert result.reused == [min(h, n - 1) for h, n in zip(result.store_hits, result.input_tokens)]
    scaled = scale_requests(chats, BLOCK)
    for c, p in [(capacity - 1, policy), (capacity + 1, policy)] + [(capacity, q) for q in ("lru", "lru-leaf", "slru")
                                                                     if q != policy]:
        assert simulate_trace(scaled, TraceSimConfig(c * BLOCK, p, block=BLOCK)).host_hits != result.store_hits, (c, p)


@pytest.mark.parametrize("policy", ["lru", "slru"])
def test_through_the_pipeline_the_store_hits_the_same(chats, policy):
    # The serving path (ChatPipeline.submit_prompt: the worker's queue, generate, the Reply) finds what the cache
    # path finds, and its generated token is the one recomputation picks.
    config = ReplayConfig(capacity_blocks=20, policy=policy, block_tokens=BLOCK)
    direct = replay_trace(chats, dataclasses.replace(config, check_exact=False))
    served = replay_trace(chats, dataclasses.replace(config, through="pipeline"))
    assert served.store_hits == served.sim_hits == direct.store_hits and served.reused == direct.reused
    assert served.checked > 50 and served.greedy_equal


def test_reused_blocks_give_the_logits_of_recomputation(trace, model):
    result = replay_trace(trace[:60], ReplayConfig(capacity_blocks=800, policy="lru-leaf", block_tokens=BLOCK), model)
    assert result.equal and sum(result.reused) > 0
    assert result.max_logit_diff is not None and result.max_logit_diff < 1e-4
    assert result.greedy_equal


def test_a_small_trace_replays_exactly_with_plain_and_leaf_first_lru():
    # Room for two blocks. Request 1 pushes one block out: plain LRU evicts block 1 (touched before its child),
    # which leaves block 2 useless; leaf-first LRU evicts block 2 and keeps block 1's hit for request 2.
    reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 512, 1, (3,)), TraceRequest(2, 1024, 1, (1, 2)),
            TraceRequest(3, 1024, 1, (1, 2))]
    lru = replay_trace(reqs, ReplayConfig(capacity_blocks=2, policy="lru", block_tokens=8))
    leaf = replay_trace(reqs, ReplayConfig(capacity_blocks=2, policy="lru-leaf", block_tokens=8))
    assert lru.equal and leaf.equal
    assert lru.store_hits == [0, 0, 0, 16] and leaf.store_hits == [0, 0, 8, 16]
    assert leaf.reused == [0, 0, 8, 15]  # a prompt found whole still computes its last token
    assert leaf.max_logit_diff < 1e-4 and leaf.greedy_equal


def test_scaling_keeps_the_last_blocks_share_and_ids_are_deterministic():
    (r,) = scale_requests([TraceRequest(0, 512 + 100, 1, (7, 8))], 16)
    assert r.input_length == 16 + 3 and r.hash_ids == (7, 8)
    runs = BlockRuns(16)
    ids = runs.prompt(r)
    assert ids.numel() == 19 and torch.equal(BlockRuns(16).prompt(r), ids)
    assert not torch.equal(BlockRuns(16, seed=1).prompt(r), ids)
    with pytest.raises(ValueError, match="one length"):
        runs.prompt(TraceRequest(0, 16 + 5, 1, (7, 8)))


def test_siblings_never_draw_the_same_ids():
    # One-token prompts at the root from 16 ids: repeated draws are drawn again until all 16 are placed; a 17th
    # sibling cannot be, and says so.
    runs = BlockRuns(8, vocab=16)
    prompts = {tuple(runs.prompt(TraceRequest(0, 1, 1, (b,))).tolist()) for b in range(16)}
    assert len(prompts) == 16
    with pytest.raises(ValueError, match="siblings"):
        runs.prompt(TraceRequest(0, 1, 1, (99,)))


def test_the_config_says_what_to_do():
    with pytest.raises(ValueError, match="block_tokens"):
        ReplayConfig(capacity_blocks=10, block_tokens=1)
    with pytest.raises(ValueError, match="unknown"):
        ReplayConfig(capacity_blocks=10, policy="mru")
    with pytest.raises(ValueError, match="capacity in blocks"):
        ReplayConfig(capacity_blocks=0)
    with pytest.raises(ValueError, match="pipeline"):
        ReplayConfig(capacity_blocks=10, through="serve")


def test_the_table_has_one_row_per_replay(trace, model):
    result = replay_trace(trace[:20], ReplayConfig(capacity_blocks=100, block_tokens=BLOCK, check_exact=False), model)
    table = format_replay([result, result]).splitlines()
    assert len(table) == 4 and "| 20 | 8 | 100 | lru |" in table[2] and "| yes |" in table[2]
