"""Measuring time to first token through `generate` without changing what it computes."""

from __future__ import annotations

import time

from transformers.generation.streamers import BaseStreamer


class FirstTokenTimer(BaseStreamer):
    """A streamer that records when `generate` emits its first new token.

    `generate` calls `put` once with the prompt, then once per new token; the second call marks the first
    token. Start the clock with :meth:`start` before any work that counts towards TTFT (cache lookup too).

    Example:
        >>> timer = FirstTokenTimer().start()
        >>> timer.put("prompt"); timer.put("token")
        >>> timer.ttft >= 0
        True
    """

    def __init__(self):
        self.t0 = self.first = None
        self._calls = 0

    def start(self) -> "FirstTokenTimer":
        self.t0, self.first, self._calls = time.perf_counter(), None, 0
        return self

    def put(self, value) -> None:
        self._calls += 1
        if self._calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass

    @property
    def ttft(self) -> float:
        """Seconds from :meth:`start` to the first generated token."""
        assert self.t0 is not None and self.first is not None, "start() the timer and run generate first"
        return self.first - self.t0
