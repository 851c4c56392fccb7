"""Measured costs of resuming a session: each lower tier's load rate and each model's prefill rate.

ALISA's third phase and Pensieve's partial hits: a session below host memory can be loaded, or its leading
tokens recomputed while the rest loads (a head: exact under causal attention, see `AttnStore.fill_head`).
Which is faster depends on the machine: on this project's 2-core CPU a cold disk read of SmolLM2's KV is far
faster than prefilling it, while a GPU prefills a small model faster than a slow tier delivers its KV. So the
store measures both instead of assuming either, and `placement.choose_recompute` decides per resume.

Both rates are byte- or work-weighted averages that forget old samples geometrically (half of the weight after
about `HALF_LIFE` samples), so a long load outweighs a short one and a changed machine is followed in a few turns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .placement import recompute_cost

# Samples after which an old one weighs half as much: recent enough to follow a tier that slows down, long
# enough that one slow turn (a page fault storm, another job on the cores) does not flip the decision.
HALF_LIFE = 8
_DECAY = 0.5 ** (1 / HALF_LIFE)
# Forwards shorter than this are not prefill samples: a decoding step's time is its fixed overhead (launches,
# Python), not its tokens', and would make recomputing look slower than it is.
MIN_PREFILL_TOKENS = 32


@dataclass
class _Rate:
    """A decayed ratio: sum of amounts / sum of seconds."""

    amount: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    def add(self, amount: float, seconds: float) -> None:
        self.amount = self.amount * _DECAY + amount
        self.seconds = self.seconds * _DECAY + seconds
        self.samples += 1

    @property
    def per_second(self) -> float | None:
        return self.amount / self.seconds if self.samples and self.seconds > 0 else None


class ResumeCosts:
    """The measured rates (thread-safe: loads report from the load thread, prefills from the turn's thread);
    `AttnStore.costs`. Observations may also come from outside (a calibration run, a test).

    Example:
        >>> costs = ResumeCosts()
        >>> costs.observe_load("disk", 2_000_000_000, 1.0)
        >>> costs.observe_prefill("model-a", 0, 1000, 1.0)
        >>> round(costs.load_bytes_per_s("disk") / 1e9, 1), round(costs.prefill_units_per_s("model-a"))
        (2.0, 1030)
        >>> costs.prefill_units_per_s("model-b") is None  # never measured: nothing is assumed
        True
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._loads: dict[str, _Rate] = {}
        self._prefills: dict[str, _Rate] = {}

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load read `nbytes` of KV from `tier` in `seconds` (opening, reading and verifying chunks)."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._loads.setdefault(tier, _Rate()).add(nbytes, seconds)

    def observe_prefill(self, model: str, start: int, end: int, seconds: float) -> None:
        """`model` computed tokens ``[start, end)`` of a sequence, after the tokens before them, in `seconds`."""
        if end - start >= MIN_PREFILL_TOKENS and seconds > 0:
            with self._lock:
                self._prefills.setdefault(model, _Rate()).add(recompute_cost(start, end), seconds)

    def load_bytes_per_s(self, tier: str) -> float | None:
        """The tier's measured load rate, or None before its first load."""
        with self._lock:
            rate = self._loads.get(tier)
            return rate.per_second if rate else None

    def prefill_units_per_s(self, model: str) -> float | None:
        """The model's measured prefill rate in :func:`~hf_attnstore.store.placement.recompute_cost` units per
        second (tokens per second at the start of a sequence), or None before its first measured prefill."""
        with self._lock:
            rate = self._prefills.get(model)
            return rate.per_second if rate else None
