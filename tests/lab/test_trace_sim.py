"""The prefix-block trace simulator: hand-checked semantics, the bounds, look-ahead, the second tier, the costs,
and the reference figures of ../shared/traces/README.md on the shared Mooncake trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_attnstore.lab.simulation import PROFILES
from hf_attnstore.lab.trace_report import Bandwidths, request_costs, run_table
from hf_attnstore.lab.trace_sim import (TraceSimConfig, belady_hit_rate, belady_hits, infinite_hit_rate,
                                         reuse_gap_histogram, simulate_trace)
from hf_attnstore.lab.traces import TraceRequest, load_trace

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def trace(*chains):
    """Requests of whole 512-token blocks, except (chain, tokens) pairs that give the input length."""
    out = []
    for i, c in enumerate(chains):
        ids, n = c if isinstance(c[0], tuple) else (c, 512 * len(c))
        out.append(TraceRequest(float(i), n, 1, tuple(ids)))
    return out


def hits(reqs, host_blocks, policy="lru", **kw):
    return simulate_trace(reqs, TraceSimConfig(512 * host_blocks, policy, **kw)).host_hits


def test_longest_leading_run_counts_and_the_partial_last_block_counts_its_tokens():
    reqs = trace(((1, 2, 3), 1300), ((1, 2, 4), 1200), ((1, 5), 600), ((1, 2, 3), 1300), ((6, 2), 1024))
    assert hits(reqs, 100) == [0, 1024, 512, 1300, 0]  # block 2 after a miss is no hit
    assert infinite_hit_rate(reqs) == pytest.approx((1024 + 512 + 1300) / (1300 + 1200 + 600 + 1300 + 1024))


def test_plain_lru_evicts_a_parent_that_leaf_first_keeps():
    # Two blocks of room: after (3,), plain LRU drops block 1 (oldest) and so loses (1, 2); leaf-first drops the
    # leaf 2 and keeps the parent, which the next request reuses.
    reqs = trace((1, 2), (3,), (1, 2))
    assert hits(reqs, 2, "lru") == [0, 0, 0]
    assert hits(reqs, 2, "lru-leaf") == [0, 0, 512]


def test_belady_evicts_the_farthest_next_use_and_its_tie_conventions():
    reqs = trace((1,), (2,), (1,))
    assert belady_hit_rate(reqs, 512) == pytest.approx(1 / 3)  # keeps 1 (used again), drops 2 (never)
    assert hits(reqs, 1, "lru") == [0, 0, 0]
    # Parent and child next used by the same request: the reference drops the parent (wasting the child);
    # leaf ties drop the child and keep a one-block hit.
    reqs = trace((1, 2), (1, 2))
    assert belady_hit_rate(reqs, 512) == 0.0
    assert belady_hit_rate(reqs, 512, leaf_ties=True) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="`capacity_tokens`=100"):
        belady_hit_rate(reqs, 100)


@pytest.mark.parametrize("policy", ["lru-leaf", "retention", "slru", "density"])
def test_a_queued_request_keeps_its_blocks(policy):
    reqs = trace((1,), (2,), (1,))
    if policy != "density":  # density's choice before it has learned anything is a random sample
        assert hits(reqs, 1, policy) == [0, 0, 0]
    assert hits(reqs, 1, policy, window=1) == [0, 0, 512]  # block 1 waits in the queue: block 2 goes


def test_a_disk_tier_catches_host_evictions_and_hits_move_back():
    reqs = trace((1,), (2,), (1,), (2,))
    r = simulate_trace(reqs, TraceSimConfig(512, "lru-leaf", disk_tokens=512))
    assert r.host_hits == [0, 0, 0, 0] and r.disk_hits == [0, 0, 512, 512]
    r = simulate_trace(reqs, TraceSimConfig(512, "lru-leaf", disk_tokens=0))
    assert r.disk_hits == [0, 0, 0, 0] and r.token_hit_rate == 0


def test_density_learns_that_reused_blocks_outlive_single_use_ones():
    # Forty hot blocks read round-robin between single-use ones; 30 blocks of room. LRU's lifetime (30 accesses)
    # is shorter than the hot blocks' reuse distance (80), so it never hits; hit density learns that reused
    # blocks are hit at that age and single-use ones never, and keeps hot blocks instead.
    chains = [c for i in range(4000) for c in ((10**6 + i,), (i % 40,))]
    reqs = trace(*chains)
    for policy, low, high in (("lru", 0.0, 0.0), ("lru-leaf", 0.0, 0.0), ("density", 0.3, 0.5)):
        rate = simulate_trace(reqs, TraceSimConfig(512 * 30, policy)).token_hit_rate
        assert low <= rate <= high, (policy, rate)


def test_config_and_table_refuse_bad_input():
    with pytest.raises(ValueError, match="`host_tokens`=-1"):
        TraceSimConfig(-1)
    with pytest.raises(ValueError, match="`host_tokens`=100 holds no 512-token block"):
        TraceSimConfig(100)
    with pytest.raises(ValueError, match="`disk_tokens`=1e\\+20"):
        TraceSimConfig(512, disk_tokens=1e20)
    with pytest.raises(ValueError, match="`window`=-2"):
        TraceSimConfig(512, window=-2)
    with pytest.raises(ValueError, match="`policy`='mru'"):
        TraceSimConfig(512, "mru")
    with pytest.raises(ValueError, match="`models`"):
        run_table(trace((1,)), [512], models=["gpt-9"])


def test_costs_follow_the_profile():
    reqs = trace((1,), (1,))
    r = simulate_trace(reqs, TraceSimConfig(512, "lru"))
    p, bw = PROFILES["llama-13b"], Bandwidths(host=25e9, disk=5e9)
    c = request_costs(r, p, bw)
    first, second = 512 * p.prefill_s_per_token, 512 * p.kv_bytes_per_token / bw.host  # a miss; a host read
    assert c["ttft_mean_s"] == pytest.approx((first + second) / 2)
    assert c["ttft_p99_s"] == pytest.approx(first) and c["prefill_saved"] == pytest.approx(0.5)
    assert c["gpu_hours_saved"] == pytest.approx(512 * p.prefill_s_per_token * p.gpus / 3600)


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"the shared Mooncake trace is not at {SHARED_TRACE}")
def test_reproduces_the_reference_figures_of_the_shared_trace():
    reqs = load_trace(SHARED_TRACE)
    assert round(100 * infinite_hit_rate(reqs), 1) == 65.1
    for tokens, lru, belady in ((300_000, 5.0, 20.2), (1_000_000, 14.2, 36.9), (3_000_000, 31.5, 55.6),
                                (10_000_000, 57.7, 65.1)):
        assert round(100 * belady_hit_rate(reqs, tokens), 1) == belady, tokens
        assert round(100 * simulate_trace(reqs, TraceSimConfig(tokens, "lru")).token_hit_rate, 1) == lru, tokens


def test_reuse_gaps_count_reused_tokens_and_those_within_the_hit_prefix():
    reqs = trace((1,), (2,), (1,), ((1, 2), 700), (1,))
    # Request 3 reads block 1 (gap 1) and block 2 (gap 2, 188 tokens): with 512 hit tokens only block 1 is a hit.
    assert reuse_gap_histogram(reqs, [0, 0, 512, 512, 0]) == {1: (1024, 512), 2: (700, 512)}
    assert reuse_gap_histogram(reqs, [0, 0, 512, 700, 512]) == {1: (1024, 1024), 2: (700, 700)}
    assert reuse_gap_histogram(reqs, belady_hits(reqs, 512)) == {1: (1024, 1024), 2: (700, 512)}
    with pytest.raises(ValueError, match="`hits` has 1 entries for 5 requests"):
        reuse_gap_histogram(reqs, [0])
