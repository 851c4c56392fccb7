"""The simulator: exact outcomes on small synthetic traces, and that it runs the store's placement code."""

from __future__ import annotations

import dataclasses

import pytest

from hf_attnstore.lab import simulation
from hf_attnstore.lab.simulation import ModelProfile, SimConfig, simulate

# 1 byte of KV per token keeps capacities readable: a 40-token session takes 40 bytes.
PROFILE = ModelProfile("toy", kv_bytes_per_token=1.0, prefill_s_per_token=0.01, decode_s_per_step=0.01,
                       context_window=200)
TRACE = [[(10, 10)] * 4 for _ in range(30)]  # 30 sessions of 4 turns, 20 tokens a turn
BIG = SimConfig(host_bytes=1e9, disk_bytes=1e9, think_time_s=5.0, batch=4)


def test_unbounded_tiers_hit_every_resumed_turn():
    r = simulate(TRACE, PROFILE, BIG)
    assert (r.turns, r.resumed) == (120, 90)
    assert r.hits_host == 90 and r.hits_disk == 0 and r.hit_rate == 1.0
    # Each resumed turn prefills only its 10 new tokens; recomputation would prefill the history too.
    assert r.prefill_tokens == 30 * 10 + 90 * 10
    assert r.prefill_tokens_recompute == 30 * (10 + 30 + 50 + 70)


def test_no_store_is_recomputation():
    r = simulate(TRACE, PROFILE, dataclasses.replace(BIG, host_bytes=0, disk_bytes=0, prefetch=False))
    assert r.hits_host == r.hits_disk == 0 and r.hit_rate == 0.0
    assert r.prefill_tokens == r.prefill_tokens_recompute


def test_a_small_host_tier_serves_from_disk_unless_prefetched():
    # ~2 sessions of ~60 bytes in host memory; one engine slot, so that jobs queue and can be seen ahead.
    small = dataclasses.replace(BIG, host_bytes=100, batch=1)
    lru = simulate(TRACE, PROFILE, dataclasses.replace(small, policy="lru", prefetch=False))
    ahead = simulate(TRACE, PROFILE, small)
    assert lru.hit_rate == ahead.hit_rate == 1.0  # the disk holds everything
    assert ahead.host_share > lru.host_share
    assert ahead.prefetches > 0 and lru.prefetches == 0


def test_overflow_invalidation_loses_the_overflowed_sessions():
    tight = dataclasses.replace(PROFILE, context_window=50)  # the third turn of every session overflows
    dec = simulate(TRACE, tight, BIG)
    inv = simulate(TRACE, tight, dataclasses.replace(BIG, truncation="invalidate"))
    assert dec.hit_rate == 1.0 and inv.misses_overflow > 0
    assert inv.hit_rate == pytest.approx(1 - inv.misses_overflow / inv.resumed)
    assert inv.prefill_tokens > dec.prefill_tokens


def test_a_disk_too_small_drops_sessions_and_costs_hits():
    r = simulate(TRACE, PROFILE, dataclasses.replace(BIG, host_bytes=50, disk_bytes=200, policy="fifo",
                                                     prefetch=False))
    assert r.disk_drops > 0 and r.hit_rate < 1.0


def test_a_codec_fits_more_sessions_on_a_small_disk():
    small = dataclasses.replace(BIG, host_bytes=50, disk_bytes=200, policy="lru", prefetch=False)
    small = dataclasses.replace(small, codec_tiers="disk")  # host memory at full precision: the disk's effect alone
    runs = {codec: simulate(TRACE, PROFILE, dataclasses.replace(small, kv_codec=codec)) for codec in (None, "int8", "int4")}
    assert runs[None].hit_rate < runs["int8"].hit_rate <= runs["int4"].hit_rate
    assert runs["int4"].disk_drops < runs[None].disk_drops
    # The disk copy of int4 at 200 bytes holds what a lossless one needs 200 / ratio bytes for.
    ratio = simulation.codec_ratio("int4")
    assert ratio == (0.5 + 4 / 32) / 2
    wide = simulate(TRACE, PROFILE, dataclasses.replace(small, disk_bytes=200 / ratio))
    assert runs["int4"].hit_rate == pytest.approx(wide.hit_rate, abs=0.05)
    # Encoding host copies too (the store's default) keeps more sessions in DRAM.
    everywhere = simulate(TRACE, PROFILE, dataclasses.replace(small, kv_codec="int4", codec_tiers="all"))
    assert everywhere.hits_host > runs["int4"].hits_host
    with pytest.raises(ValueError, match="codec_tiers"):
        simulate(TRACE, PROFILE, dataclasses.replace(small, kv_codec="int4", codec_tiers="ssd"))


def test_runs_the_stores_placement_code(monkeypatch):
    """Every demotion and disk drop the simulator counts is a victim chosen by the store's own function."""
    chosen = []
    real = simulation.choose_victims

    def spy(*args, **kwargs):
        victims = list(real(*args, **kwargs))
        chosen.append(victims)
        return iter(victims)

    monkeypatch.setattr(simulation, "choose_victims", spy)
    r = simulate(TRACE, PROFILE, dataclasses.replace(BIG, host_bytes=100, disk_bytes=400))
    assert real.__module__ == "hf_attnstore.store.policy"
    assert r.demotions > 0 and r.disk_drops > 0
    assert sum(len(v) for v in chosen) == r.demotions + r.disk_drops


def test_deterministic_and_bad_input():
    assert simulate(TRACE, PROFILE, BIG).ttft_s == simulate(TRACE, PROFILE, BIG).ttft_s
    with pytest.raises(ValueError, match="policy"):
        simulate(TRACE, PROFILE, dataclasses.replace(BIG, policy="random"))
    with pytest.raises(ValueError, match="truncation"):
        simulate(TRACE, PROFILE, dataclasses.replace(BIG, truncation="naive"))


def test_cost_is_gpu_time_plus_provisioned_tiers():
    re_cfg = dataclasses.replace(BIG, host_bytes=0, disk_bytes=0, prefetch=False)
    re, stored = simulate(TRACE, PROFILE, re_cfg), simulate(TRACE, PROFILE, BIG)
    c_re, c_as = re.cost(PROFILE, re_cfg), stored.cost(PROFILE, BIG)
    assert c_re["gpu"] == pytest.approx(re.gpu_busy_s / 3600 * 5.0) and c_re["dram"] == c_re["ssd"] == 0
    assert c_as["dram"] == pytest.approx(1.0 * stored.makespan_s / 3600 * 0.0088)  # 1e9 bytes = 1 GB
    assert c_as["gpu"] < c_re["gpu"]  # fewer prefill tokens


def test_partial_eviction_drops_heads_and_recomputes_them_on_resume(monkeypatch):
    small = dataclasses.replace(BIG, host_bytes=50, disk_bytes=400, policy="lru", prefetch=False, chunk_tokens=10)
    whole = simulate(TRACE, PROFILE, small)
    part = simulate(TRACE, PROFILE, dataclasses.replace(small, partial_eviction=True))
    assert whole.head_drops == whole.partial_hits == whole.head_recompute_tokens == 0
    # With every session's chunks about as costly (short histories: attention is a small share of a token's
    # cost), the retention value orders chunks by idle time: the oldest session loses chunk after chunk, as
    # whole-session LRU would lose it, and no session comes back half evicted on this trace.
    assert part.head_drops > 0 and part.hit_rate == whole.hit_rate
    # Forcing one head chunk off every idle session shows the resume path: the head is recomputed, the rest
    # reused, and every history token is either reused or prefilled again.
    real = simulation.choose_head_drops
    monkeypatch.setattr(simulation, "choose_head_drops", lambda cands, overflow: [k for k, _, u in cands if len(u) > 1])
    forced = simulate(TRACE, PROFILE, dataclasses.replace(small, partial_eviction=True))
    assert forced.partial_hits > 0 and forced.head_recompute_tokens >= 10 * forced.partial_hits
    assert forced.token_hit_rate < forced.hit_rate
    new_tokens = sum(u for conv in TRACE for u, _ in conv)
    for r in (whole, part, forced):
        assert r.reused_tokens + r.head_recompute_tokens <= r.history_tokens
        assert r.prefill_tokens == new_tokens + r.history_tokens - r.reused_tokens
    assert real is not simulation.choose_head_drops  # the simulator calls the store's placement code by name


def test_shared_system_prompts_are_held_once_and_reused_by_new_sessions():
    trace, system = simulation.with_system_prompts(TRACE, [50], share=1.0)
    assert [conv[0] for conv in trace[:2]] == [(60, 10), (60, 10)] and system[0] == (0, 50)
    off = simulate(trace, PROFILE, BIG, system)
    on = simulate(trace, PROFILE, dataclasses.replace(BIG, share_prefixes=True), system)
    assert off.prefix_hits == 0 and off.hit_rate == on.hit_rate == 1.0
    # Sessions that arrive once another one's first turn has ended start from the prompt it holds.
    assert 25 <= on.prefix_hits <= 29 and on.prefix_reused_tokens == on.prefix_hits * 50
    assert on.prefill_tokens == off.prefill_tokens - on.prefix_hits * 50
    # Held once: 30 sessions of 50 + 80 tokens at the end take 30 * 80 + 50 bytes, not 30 * 130.
    assert off.peak_host_bytes == 30 * 130 and on.peak_host_bytes == 30 * 80 + 50
    assert on.peak_disk_bytes == 30 * 80 + 50
    # Without the option, or without prompts, nothing changes.
    assert simulate(trace, PROFILE, BIG, None).prefill_tokens == off.prefill_tokens
    with pytest.raises(ValueError, match="one"):
        simulate(trace, PROFILE, BIG, system[:3])
    with pytest.raises(ValueError, match="sizes"):
        simulation.with_system_prompts(TRACE, [0])


def test_a_shared_prompt_leaves_a_tier_with_its_last_holder():
    # Host room for about two sessions: evictions must keep the prompt's bytes while any holder stays.
    trace, system = simulation.with_system_prompts(TRACE, [50], share=1.0)
    small = dataclasses.replace(BIG, host_bytes=300, share_prefixes=True)
    r = simulate(trace, PROFILE, small, system)
    assert r.peak_host_bytes <= 300 and r.hit_rate == 1.0  # the disk holds everything
    assert r.prefix_hits >= 25  # a holder is always somewhere (host or disk)


def test_load_or_recompute_by_cost_uses_the_stores_choice(monkeypatch):
    # Demand loads from disk (one session fits in host memory, no prefetch), chunks of 10 tokens.
    small = dataclasses.replace(BIG, host_bytes=50, policy="lru", prefetch=False, chunk_tokens=10)
    for ssd, recomputes in ((1e6, False), (100.0, True)):  # reading 10 bytes: 10 us or 0.1 s; prefilling 10: 0.1 s
        load = simulate(TRACE, PROFILE, dataclasses.replace(small, ssd_read_bytes_per_s=ssd))
        by_cost = simulate(TRACE, PROFILE, dataclasses.replace(small, ssd_read_bytes_per_s=ssd, recompute_by_cost=True))
        assert load.hits_disk > 0 and by_cost.hits_disk > 0 and load.recompute_choices == 0
        if not recomputes:  # a fast disk: nothing is worth recomputing, and nothing changes
            assert by_cost.recompute_choices == 0 and by_cost.service_ttft_s == load.service_ttft_s
            continue
        # A slow disk: the leading chunks are recomputed while the rest is read, and turns wait less.
        assert 0 < by_cost.recompute_choices <= by_cost.hits_disk
        assert by_cost.head_recompute_tokens == by_cost.recompute_chosen_tokens > 0
        assert sum(by_cost.service_ttft_s) < sum(load.service_ttft_s)
        assert by_cost.gpu_busy_s > load.gpu_busy_s  # what it costs: GPU time to recompute
    calls = []
    real = simulation.choose_recompute
    monkeypatch.setattr(simulation, "choose_recompute", lambda *a, **k: calls.append(a) or real(*a, **k))
    simulate(TRACE, PROFILE, dataclasses.replace(small, ssd_read_bytes_per_s=100.0, recompute_by_cost=True))
    assert calls  # the simulator decides with the store's placement code
