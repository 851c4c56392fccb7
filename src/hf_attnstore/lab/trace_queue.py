"""A load-driven queue for the trace simulator: a prefill cluster of G instances serving a trace in arrival order.

With a fixed ``--window K`` the policies see the next K requests whatever the load. A real server's queue is what
has arrived and not yet started, which depends on how fast the cluster prefills, and so on the cache: hits
shorten prefills, which shortens the queue. :class:`PrefillCluster` couples the two. Requests start in arrival
order (FIFO) on the first free instance; a request's prefill keeps its instance busy for its service time (the
cost model's ``max(prefill of the misses, reading of the hits)``: Mooncake's prefill pool, decoding elsewhere);
when it starts, the requests that have arrived behind it are the queue its cache lookup may look ahead into.
TTFT is the wait for an instance plus the service time.

Example:
    >>> from hf_attnstore.lab.traces import TraceRequest
    >>> reqs = [TraceRequest(0, 512, 1, (1,)), TraceRequest(0, 512, 1, (2,)), TraceRequest(500, 512, 1, (3,))]
    >>> cluster = PrefillCluster(reqs, instances=1, service=lambda r, host, disk: 1.0)  # one second each
    >>> queued = []
    >>> for i in range(3):
    ...     queued.append(cluster.start(i))
    ...     cluster.finish(i, host_hits=0)
    >>> queued  # requests arrived behind each when it started
    [1, 1, 0]
    >>> cluster.waits_s, cluster.ttft_s()
    ([0.0, 1.0, 1.5], [1.0, 2.0, 2.5])
"""

from __future__ import annotations

import heapq
import math
from typing import Callable

from .traces import TraceRequest

MAX_INSTANCES = 100_000  # beyond any prefill pool: a typo


class PrefillCluster:
    """FIFO service of a trace on `instances` prefill instances (see the module docstring).

    Args:
        requests: The trace, arrivals non-decreasing (Mooncake's traces are in arrival order).
        instances: Prefill instances serving it.
        service: Seconds one request keeps its instance busy, given the request and its hit tokens in host memory and
            on disk.

    Call :meth:`start` for each request in order, then :meth:`finish` with its hits, before the next one starts.

    Example:
        >>> from hf_attnstore.lab.traces import TraceRequest
        >>> cluster = PrefillCluster([TraceRequest(0, 512, 1, (1,))] * 2, instances=2, service=lambda r, host, disk: 3.0)
        >>> cluster.start(0), cluster.finish(0, 0), cluster.start(1), cluster.finish(1, 512)
        (1, None, 0, None)
        >>> cluster.ttft_s()  # two instances: no wait
        [3.0, 3.0]
    """

    def __init__(self, requests: list[TraceRequest], instances: int,
                 service: Callable[[TraceRequest, int, int], float]):
        if not isinstance(instances, int) or isinstance(instances, bool) or not 1 <= instances <= MAX_INSTANCES:
            raise ValueError(f"`instances`={instances!r} must be an integer in [1, {MAX_INSTANCES:,}]")
        arrivals = [r.timestamp_ms / 1000 for r in requests]
        late = next((i for i in range(1, len(arrivals)) if arrivals[i] < arrivals[i - 1]), None)
        if late is not None:
            raise ValueError(f"request {late} arrives before request {late - 1}: a queue model needs the trace in "
                             "arrival order (sort it by `timestamp`)")
        self.requests, self.arrivals, self.service = requests, arrivals, service
        self.free = [0.0] * instances  # when each instance is next free (a heap)
        self.waits_s: list[float] = []
        self.services_s: list[float] = []
        self.queued: list[int] = []
        self._arrived = 0  # requests arrived by the latest start (starts never go back in time)
        self._start = 0.0

    def start(self, i: int) -> int:
        """Starts request `i` (the next in order) and returns how many requests have arrived behind it."""
        if i != len(self.waits_s):
            raise ValueError(f"request {i} started out of order: request {len(self.waits_s)} is next")
        self._start = max(self.arrivals[i], self.free[0])
        while self._arrived < len(self.arrivals) and self.arrivals[self._arrived] <= self._start:
            self._arrived += 1
        self.waits_s.append(self._start - self.arrivals[i])
        self.queued.append(max(0, self._arrived - i - 1))
        return self.queued[-1]

    def finish(self, i: int, host_hits: int, disk_hits: int = 0) -> None:
        """Request `i`, started last, found these hit tokens: its instance is busy for its service time."""
        if i != len(self.waits_s) - 1 or len(self.services_s) != i:
            raise ValueError(f"request {i} finished without being the one started last")
        seconds = self.service(self.requests[i], host_hits, disk_hits)
        self.services_s.append(seconds)
        heapq.heapreplace(self.free, self._start + seconds)

    def ttft_s(self) -> list[float]:
        """Each served request's time to first token: its wait plus its service."""
        return [w + s for w, s in zip(self.waits_s, self.services_s)]


def no_cache_ttft_s(requests: list[TraceRequest], instances: int,
                    service: Callable[[TraceRequest, int, int], float]) -> list[float]:
    """TTFT of every request on the same cluster with no cache at all (every prefill in full): the baseline.

    Example:
        >>> from hf_attnstore.lab.traces import TraceRequest
        >>> no_cache_ttft_s([TraceRequest(0, 512, 1, (1,))] * 2, 1, lambda r, host, disk: 2.0)
        [2.0, 4.0]
    """
    cluster = PrefillCluster(requests, instances, service)
    for i in range(len(requests)):
        cluster.start(i)
        cluster.finish(i, 0)
    return cluster.ttft_s()


def utilization(requests: list[TraceRequest], instances: int, service: Callable[[TraceRequest, int, int], float]) -> float:
    """The cluster's offered load with no cache: prefill seconds asked for per instance-second of the trace.

    Above 1 the queue grows without bound over the trace; a provisioned cluster runs below it.

    Example:
        >>> from hf_attnstore.lab.traces import TraceRequest
        >>> reqs = [TraceRequest(0, 512, 1, (1,)), TraceRequest(10_000, 512, 1, (2,))]  # 10 s apart
        >>> utilization(reqs, 1, lambda r, host, disk: 2.0)
        0.4
    """
    if len(requests) < 2:
        return 0.0
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    work = sum(service(r, 0, 0) for r in requests)
    return work / (instances * span) if span > 0 else math.inf
