"""The measured rates of load-or-recompute (store/costs.py) and the choice made from them (placement.py)."""

from __future__ import annotations

import pytest

from hf_attnstore.store import AttnStore
from hf_attnstore.store.loader import HALF_LIFE, MIN_PREFILL_TOKENS, ResumeCosts
from hf_attnstore.store.policy import RECOMPUTE_MARGIN, choose_recompute, recompute_cost


def test_rates_are_weighted_by_amount_and_forget_old_samples():
    costs = ResumeCosts()
    assert costs.load_bytes_per_s("disk") is None and costs.prefill_units_per_s("m") is None
    costs.observe_load("disk", 1000, 1.0)
    costs.observe_load("disk", 9000, 1.0)
    # Weighted by bytes and seconds, not a mean of two rates: (1000·d + 9000) / (1·d + 1), d = 2^(-1/HALF_LIFE).
    d = 0.5 ** (1 / HALF_LIFE)
    assert costs.load_bytes_per_s("disk") == pytest.approx((1000 * d + 9000) / (d + 1))
    for _ in range(20 * HALF_LIFE):  # the tier slowed down: the old samples fade
        costs.observe_load("disk", 100, 1.0)
    assert costs.load_bytes_per_s("disk") == pytest.approx(100, rel=1e-3)
    assert costs.load_bytes_per_s("remote") is None  # each tier its own


def test_short_forwards_and_empty_samples_are_not_rates():
    costs = ResumeCosts()
    costs.observe_prefill("m", 100, 100 + MIN_PREFILL_TOKENS - 1, 1.0)  # a decoding step or a few tokens
    costs.observe_prefill("m", 0, 64, 0.0)
    costs.observe_load("disk", 0, 1.0)
    assert costs.prefill_units_per_s("m") is None and costs.load_bytes_per_s("disk") is None
    costs.observe_prefill("m", 0, 64, 0.5)
    assert costs.prefill_units_per_s("m") == pytest.approx(recompute_cost(0, 64) / 0.5)


UNITS = [(0, 256, 1000), (256, 512, 1000), (512, 768, 1000), (768, 800, 125)]


def test_the_choice_balances_recompute_against_the_load_of_the_rest():
    # Loading a chunk takes 0.1 s (0.3125 s in all); recomputing 256 tokens ~0.258 s, 512 tokens ~0.520 s.
    chunks, chosen, load = choose_recompute(UNITS, 0, 3, seconds_per_byte=1e-4, seconds_per_unit=1e-3)
    assert load == pytest.approx(0.3125)
    # One chunk recomputed while the other 2,125 bytes load: max(0.258, 0.2125); two would take 0.520.
    assert chunks == 1 and chosen == pytest.approx(recompute_cost(0, 256) * 1e-3)


def test_fast_tiers_load_and_slow_tiers_recompute_all_they_may():
    assert choose_recompute(UNITS, 0, 3, seconds_per_byte=1e-9, seconds_per_unit=1e-3)[0] == 0
    chunks, chosen, load = choose_recompute(UNITS, 0, 3, seconds_per_byte=1.0, seconds_per_unit=1e-3)
    assert chunks == 3 and chosen == pytest.approx(125.0) and load == pytest.approx(3125.0)
    # Only `eligible` chunks may be recomputed (a rebased one may not), and nothing without any.
    assert choose_recompute(UNITS, 0, 1, seconds_per_byte=1.0, seconds_per_unit=1e-3)[0] == 1
    assert choose_recompute(UNITS, 0, 0, seconds_per_byte=1.0, seconds_per_unit=1e-3) == (0, 3125.0, 3125.0)


def test_a_dropped_head_is_recomputed_whatever_is_chosen():
    units = [(512, 768, 1000), (768, 1024, 1000)]
    # The 512-token head costs its recompute even when everything stored is loaded.
    _, chosen, load = choose_recompute(units, 512, 1, seconds_per_byte=1e-9, seconds_per_unit=1e-3)
    assert load == pytest.approx(recompute_cost(0, 512) * 1e-3) and chosen == load


def test_near_a_tie_loading_is_kept():
    # Recomputing the first chunk is estimated 2% faster than loading everything: not worth the noise.
    per_byte = 1e-3 / 2.0  # loading all 2000 bytes: 1.0 s
    per_unit = 0.98 / recompute_cost(0, 256)  # recomputing chunk 1 while chunk 2 loads: max(0.98, 0.5)
    assert choose_recompute(units := [(0, 256, 1000), (256, 512, 1000)], 0, 1, per_byte, per_unit)[0] == 0
    assert choose_recompute(units, 0, 1, per_byte, 0.9 / recompute_cost(0, 256))[0] == 1


def test_the_option_is_validated():
    with pytest.raises(TypeError, match="recompute_by_cost"):
        AttnStore(host_bytes="1MiB", recompute_by_cost="yes")
    store = AttnStore(host_bytes="1MiB", recompute_by_cost=True)
    assert store.config.recompute_by_cost and store.stats().resume_decisions == 0
    store.close()
