"""LoadHandle: per-layer readiness, the read buffer, failures reaching the consumer."""

from __future__ import annotations

import threading
import time

import pytest

from hf_attnstore.store.buffer import LoadError, LoadHandle


def producer(handle: LoadHandle, layers: int, fail_at: int | None = None):
    def run():
        for layer in range(layers):
            handle.gate(layer)
            if layer == fail_at:
                handle.fail(OSError("disk gone"))
                return
            handle.layer_ready(layer)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def settle(handle: LoadHandle, expected: int) -> int:
    """Waits (on the handle's condition, bounded) until `expected` layers are ready, then until the loader
    is blocked in its gate, so that a broken gate would have loaded further by then."""
    with handle._cond:
        handle._cond.wait_for(lambda: handle._ready >= expected, 5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and handle._ready < handle.num_layers:
        with handle._cond:
            if handle._gate_waiting:  # the producer waits in gate(): it can go no further
                break
            handle._cond.wait(0.01)
    return handle.ready_layers


@pytest.mark.parametrize("buffer_layers", [0, 2])
def test_read_buffer_bounds_run_ahead(buffer_layers):
    handle = LoadHandle(8, buffer_layers, timeout_s=5)
    handle.attach()
    thread = producer(handle, 8)
    handle.wait_layer(0)
    # The consumer needs layer 0: the loader may load layer 1 and `buffer_layers` more, not beyond.
    assert settle(handle, 2 + buffer_layers) == 2 + buffer_layers
    handle.wait_layer(3)
    assert settle(handle, min(8, 5 + buffer_layers)) == min(8, 5 + buffer_layers)
    handle.release()
    thread.join(5)
    assert handle.done


def test_without_consumer_the_loader_runs_freely():
    handle = LoadHandle(6, 0, timeout_s=5)
    producer(handle, 6).join(5)
    assert handle.done


def test_failure_reaches_the_waiting_consumer_but_not_loaded_layers():
    handle = LoadHandle(4, None, timeout_s=5)
    producer(handle, 4, fail_at=2).join(5)
    handle.wait_layer(1)
    with pytest.raises(LoadError, match="disk gone"):
        handle.wait_layer(2)


def test_wait_times_out():
    handle = LoadHandle(2, None, timeout_s=0.05)
    with pytest.raises(LoadError, match="within"):
        handle.wait_layer(0)
