"""Host-to-GPU copies of a resumed session's layers, ahead of the layers that need them (CUDA only)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..store.buffer import LoadHandle

Parts = list[tuple[torch.Tensor, torch.Tensor]]


class CudaLayerPrefetcher:
    """Copies reused layers host -> GPU on a dedicated stream, up to `ahead` layers before they are needed.

    Layer i's copy is issued at the latest when layer i is requested; layers i+1..i+ahead+1 are issued too
    if their host data is already loaded (never waiting for the disk on their behalf). The compute stream
    waits on each layer's event, not on the whole stream.

    Args:
        host_parts: ``(layer, length) -> [(keys, values), ...]``: views of a layer's KV in host memory (it
            waits for a layer still loading from disk).
        loader: The disk load in progress, or ``None`` when the session is in host memory.
        num_layers: Layers of the model.
        device: The GPU.
        ahead: Layers copied ahead of the one computed (``read_buffer_layers``); ``None`` = all.
    """

    def __init__(self, host_parts: Callable[[int, int], Parts], loader: LoadHandle | None, num_layers: int,
                 device: torch.device, ahead: int | None):
        self.host_parts, self.loader, self.num_layers, self.device = host_parts, loader, num_layers, device
        self.ahead = num_layers if ahead is None else ahead
        self.stream = torch.cuda.Stream(device)
        self.inflight: dict[int, tuple] = {}

    def _issue(self, idx: int, length: int) -> None:
        parts = self.host_parts(idx, length)
        # The copy stream must not read the host buffer before earlier work on the compute stream that
        # produced it (a device-to-host save of the previous turn) is done.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copies = [(k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)) for k, v in parts]
            event = torch.cuda.Event()
            event.record(self.stream)
        self.inflight[idx] = (copies, event)

    def get(self, idx: int, length: int) -> Parts:
        """Layer `idx`'s KV on the GPU, usable on the current stream."""
        last = min(self.num_layers - 1, idx + self.ahead + 1)
        for j in range(idx, last + 1):
            if j not in self.inflight and (j == idx or self.loader is None or self.loader.ready_layers > j):
                self._issue(j, length)
        copies, event = self.inflight.pop(idx)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for k, v in copies:
            # Allocated on the copy stream, used on the compute stream: tell the allocator.
            k.record_stream(current)
            v.record_stream(current)
        return copies
