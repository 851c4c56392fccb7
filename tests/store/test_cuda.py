"""CUDA paths of the host tier: asynchronous device-to-host copies into pinned segments."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore.store.buffer import SessionBuffer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_readers_of_shared_segments_wait_for_pending_copies():
    """A truncated copy (`selected`) and the disk writer read a segment whose copy may still be in flight."""
    layers, heads, dim, n = 4, 8, 128, 4096  # large enough that the copy is still running when we read
    for _ in range(20):
        buf = SessionBuffer((layers, heads, dim), torch.float32, pin_memory=True)
        keys = [torch.randn(1, heads, n, dim, device="cuda") for _ in range(layers)]
        values = [k * 2 for k in keys]
        torch.cuda._sleep(50_000_000)  # delay the stream so the copy lands late
        buf.append(torch.arange(n), keys, values)
        snap = buf.snapshot()
        sel = SessionBuffer.selected(snap, torch.cat([torch.arange(4), torch.arange(n // 2, n)]), pin_memory=True)
        ids, got_k, got_v = sel.snapshot().tensors(0, 8)
        assert torch.equal(got_k[3][:, :, :4], keys[3][:, :, :4].cpu())
        assert torch.equal(got_v[3][:, :, 4:8], values[3][:, :, n // 2 : n // 2 + 4].cpu())
        parts = snap.layer_parts(layers - 1)
        assert torch.equal(parts[0][0], keys[-1].cpu())
