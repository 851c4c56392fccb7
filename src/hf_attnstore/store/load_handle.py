"""Progress of a session being loaded from disk into host memory, layer by layer.

The load thread marks each layer ready as soon as its bytes are verified; the consumer (a cache's layer
about to compute) waits only for its own layer. The read buffer bounds how far the loader may run ahead
of the consumer (the paper's S_buf, in layers).
"""

from __future__ import annotations

import threading


class LoadError(RuntimeError):
    """A stored session could not be loaded (damaged or vanished files, I/O error).

    Example:
        >>> handle = LoadHandle(num_layers=1, read_buffer_layers=None, timeout_s=1.0)
        >>> handle.fail(OSError("EIO"))
        >>> try:
        ...     handle.wait_layer(0)
        ... except LoadError as exc:
        ...     print(exc)
        loading the session failed: EIO
    """


class LoadHandle:
    """Shared between the load thread (producer) and the cache layers (consumer).

    Args:
        num_layers: Layers to load.
        read_buffer_layers: How many layers the loader may load beyond the next one the consumer needs;
            ``None`` = no limit. Only applies while a consumer is attached.
        timeout_s: Longest wait for one layer before giving up (the load is then treated as failed).

    Example:
        >>> handle = LoadHandle(num_layers=2, read_buffer_layers=1, timeout_s=1.0)
        >>> handle.layer_ready(0)  # the load thread verified layer 0
        >>> handle.wait_layer(0)  # the layer computing next needs only its own
        >>> handle.ready_layers, handle.done
        (1, False)
    """

    def __init__(self, num_layers: int, read_buffer_layers: int | None, timeout_s: float):
        self.num_layers = num_layers
        self.read_buffer_layers = read_buffer_layers
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._ready = 0  # layers [0, _ready) are loaded
        self._needed = -1  # highest layer the consumer has asked for
        self._attached = False
        self._error: BaseException | None = None
        self._gate_waiting = False

    # -- consumer side ------------------------------------------------------------------------------
    def attach(self) -> None:
        """A cache will consume this load: from now on the read buffer limits run-ahead.

        Example:
            >>> handle = LoadHandle(num_layers=4, read_buffer_layers=1, timeout_s=1.0)
            >>> handle.attach()
            >>> handle.gate(2, timeout=0.01)  # the consumer needs no layer yet: at most layers 0 and 1 run ahead
            False
        """
        with self._cond:
            self._attached = True

    def release(self) -> None:
        """The consumer is gone (done or abandoned): the loader may finish at full speed.

        Example:
            >>> handle = LoadHandle(num_layers=4, read_buffer_layers=1, timeout_s=1.0)
            >>> handle.attach(); handle.release()
            >>> handle.gate(3)  # no consumer: no limit
            True
        """
        with self._cond:
            self._attached = False
            self._cond.notify_all()

    def wait_layer(self, layer: int) -> None:
        """Blocks until `layer` is loaded. Raises LoadError if the load failed or timed out.

        Example:
            >>> handle = LoadHandle(num_layers=2, read_buffer_layers=None, timeout_s=0.05)
            >>> handle.layer_ready(0)
            >>> handle.wait_layer(0)  # returns at once
            >>> handle.wait_layer(1)
            Traceback (most recent call last):
            ...
            hf_attnstore.store.load_handle.LoadError: layer 1 was not loaded within 0.05 s
        """
        with self._cond:
            if layer > self._needed:
                self._needed = layer
                self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._ready > layer or self._error is not None, self.timeout_s):
                raise LoadError(f"layer {layer} was not loaded within {self.timeout_s} s")
            if self._error is not None and self._ready <= layer:
                raise LoadError(f"loading the session failed: {self._error}") from self._error

    def wait_all(self) -> None:
        """Blocks until every layer is loaded. Raises LoadError if the load failed or timed out.

        Example:
            >>> handle = LoadHandle(num_layers=2, read_buffer_layers=None, timeout_s=1.0)
            >>> handle.layer_ready(0); handle.layer_ready(1)
            >>> handle.wait_all(); handle.done
            True
        """
        self.wait_layer(self.num_layers - 1)

    @property
    def ready_layers(self) -> int:
        """How many leading layers are loaded (never waits)."""
        with self._cond:
            return self._ready

    @property
    def done(self) -> bool:
        with self._cond:
            return self._ready == self.num_layers

    # -- producer side ------------------------------------------------------------------------------
    def gate(self, layer: int, timeout: float | None = None) -> bool:
        """Called by the loader before reading `layer`: waits while it is too far ahead of the consumer.

        Returns whether the layer may be read now; False after `timeout` seconds (default: the handle's
        timeout, after which a load always proceeds rather than wait for a consumer that may be gone).

        Example:
            >>> handle = LoadHandle(num_layers=4, read_buffer_layers=1, timeout_s=1.0)
            >>> handle.attach()
            >>> handle.gate(1), handle.gate(2, timeout=0.01)  # the consumer is before layer 0: one layer of run-ahead
            (True, False)
        """
        if self.read_buffer_layers is None:
            return True
        with self._cond:
            self._gate_waiting = True  # observable by tests: the producer is held back here
            try:
                return self._cond.wait_for(
                    lambda: not self._attached or layer <= self._needed + 1 + self.read_buffer_layers,
                    self.timeout_s if timeout is None else timeout,
                )
            finally:
                self._gate_waiting = False

    def layer_ready(self, layer: int) -> None:
        """The load thread verified `layer` (layers are loaded in order): its consumer may go on.

        Example:
            >>> handle = LoadHandle(num_layers=2, read_buffer_layers=None, timeout_s=1.0)
            >>> handle.layer_ready(0)
            >>> handle.ready_layers, handle.done
            (1, False)
        """
        with self._cond:
            assert layer == self._ready, "layers are loaded in order"
            self._ready = layer + 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The load failed with `error`: waits for layers not loaded yet raise LoadError (loaded ones stay readable).

        Example:
            >>> handle = LoadHandle(num_layers=2, read_buffer_layers=None, timeout_s=1.0)
            >>> handle.layer_ready(0)
            >>> handle.fail(OSError("EIO"))
            >>> handle.wait_layer(0)  # loaded before the failure: still readable
            >>> handle.wait_layer(1)
            Traceback (most recent call last):
            ...
            hf_attnstore.store.load_handle.LoadError: loading the session failed: EIO
        """
        with self._cond:
            self._error = error
            self._cond.notify_all()
