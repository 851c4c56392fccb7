"""A bound on a whole call, for clients whose own timeouts bound each socket read but not the call.

redis-py's cluster client answers one command within its `socket_timeout`, but a pipeline (and an MGET across
nodes, which is one) that fails on a hung node is resent command by command, each on a new connection with a
handshake of its own: on a frozen node one lookup took 5 to 6 times the timeout (tests/store/test_remote_cluster.py and
tests/serving/test_shared_state.py, with the bound removed). :class:`Deadline` runs each
call on a small pool of threads and waits for it at most `seconds`. A call that overruns is abandoned, not
interrupted: its thread ends when the client's own timeouts end it, and the caller sees a ``TimeoutError`` (an
``OSError``, which the tiers already take as a failure of the server: a miss, and the circuit breaker).

Example:
    >>> import time
    >>> deadline = Deadline(0.05, name="example")
    >>> deadline.call(sum, [1, 2, 3])
    6
    >>> deadline.call(time.sleep, 0.5)
    Traceback (most recent call last):
    ...
    TimeoutError: no answer within 0.05 s
    >>> deadline.close()
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import ThreadPoolExecutor


class Deadline:
    """Runs calls on `workers` threads and waits for each at most `seconds` (see the module's docstring).

    Args:
        seconds: The bound on one call, queueing for a thread included.
        workers: Calls that may run at once; abandoned calls hold theirs until they end.
        name: The threads' name prefix.
    """

    def __init__(self, seconds: float, workers: int = 8, name: str = "attnstore-deadline"):
        if not seconds > 0:
            raise ValueError(f"`seconds` must be positive, got {seconds!r}")
        self.seconds = seconds
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, or ``TimeoutError`` when it has not returned within the bound."""
        future = self._pool.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=self.seconds)
        except concurrent.futures.TimeoutError:
            future.cancel()  # still queued: never runs; running: abandoned, it ends on the client's own timeouts
            raise TimeoutError(f"no answer within {self.seconds:g} s") from None

    def close(self) -> None:
        """Stops taking calls; calls still running end on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
