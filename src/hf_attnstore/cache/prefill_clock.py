"""Timing a turn's prefill forwards, for the store's load-or-recompute choice (`StoreConfig.recompute_by_cost`).

The store decides whether a resumed session's leading chunks are loaded or recomputed by the model's measured
prefill rate (`AttnStore.costs`). A turn measures the forwards that compute without waiting for
stored KV (a miss's prefill, a later prefill of the same turn, a recomputed head) and reports each one.

On CUDA a forward returns before its kernels finish, so it is timed with CUDA events, read once they have
completed (at the next forward or when the turn ends): never a synchronization on the critical path. On CPU the
wall clock is the compute time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..store.loader import MIN_PREFILL_TOKENS


class PrefillClock:
    """Times forwards and reports ``(start, end, seconds)`` to `report` once each is known.

    Example:
        >>> seen = []
        >>> clock = PrefillClock(lambda *sample: seen.append(sample))
        >>> clock.begin(torch.device("cpu"), start=0, tokens=64)
        >>> clock.end()
        >>> clock.collect()
        >>> seen[0][:2]
        (0, 64)
    """

    def __init__(self, report: Callable[[int, int, float], None]):
        self._report = report
        self._running: tuple | None = None  # (start, end, t0 or CUDA start event)
        self._pending: list[tuple] = []  # CUDA: (start, end, start event, end event), not yet completed

    def begin(self, device: torch.device, start: int, tokens: int) -> None:
        """A forward of `tokens` tokens after `start` others begins (timed only when it is a prefill)."""
        self._running = None
        if tokens < MIN_PREFILL_TOKENS:
            return
        if device.type == "cuda":
            # On the forward's device's stream (a model on cuda:1 is not timed by the current device's events).
            stream = torch.cuda.current_stream(device)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            self._running = (start, start + tokens, (event, stream))
        else:
            self._running = (start, start + tokens, time.perf_counter())

    def cancel(self) -> None:
        """The running forward does not count (it waited for stored KV, or failed)."""
        self._running = None

    def end(self) -> None:
        """The running forward completed."""
        if self._running is None:
            return
        start, end, t0 = self._running
        self._running = None
        if isinstance(t0, float):
            self._report(start, end, time.perf_counter() - t0)
            return
        first, stream = t0
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self._pending.append((start, end, first, event))

    def collect(self) -> None:
        """Reports the CUDA forwards whose kernels have completed (a no-op on CPU)."""
        while self._pending and self._pending[0][3].query():
            start, end, first, last = self._pending.pop(0)
            self._report(start, end, first.elapsed_time(last) / 1000)
