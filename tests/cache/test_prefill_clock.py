"""Timing prefill forwards for the store's load-or-recompute choice (cache/prefill_clock.py)."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore.cache.prefill_clock import PrefillClock
from hf_attnstore.store.loader import MIN_PREFILL_TOKENS


def test_prefills_are_reported_and_decoding_steps_and_cancelled_forwards_are_not():
    seen = []
    clock = PrefillClock(lambda *sample: seen.append(sample))
    cpu = torch.device("cpu")
    clock.begin(cpu, 100, MIN_PREFILL_TOKENS - 1)  # a decoding step (or a few tokens): its overhead, not a rate
    clock.end()
    clock.begin(cpu, 0, 64)
    clock.cancel()  # it waited for stored KV
    clock.end()
    clock.begin(cpu, 10, 64)
    clock.end()
    clock.end()  # an end without a begin counts nothing
    assert [s[:2] for s in seen] == [(10, 74)] and seen[0][2] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forwards_are_timed_by_events_once_they_complete():
    seen = []
    clock = PrefillClock(lambda *sample: seen.append(sample))
    x = torch.randn(2048, 2048, device="cuda")
    clock.begin(x.device, 0, 64)
    for _ in range(20):
        x = x @ x / 2048
    clock.end()
    torch.cuda.synchronize()
    clock.collect()
    assert [s[:2] for s in seen] == [(0, 64)] and seen[0][2] > 0
