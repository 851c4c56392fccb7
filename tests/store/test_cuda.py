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


def test_an_encoded_host_part_crosses_as_its_blob_and_is_dequantized_on_the_device():
    from hf_attnstore.store.codec import KVCodec
    from hf_attnstore.store.buffer import EncodedSegment, dense
    from hf_attnstore.store.format import encode_kv

    codec, n = KVCodec("int4"), 256
    keys = [torch.randn(1, 4, n, 64) * torch.linspace(0.5, 8, 64) for _ in range(2)]
    values = [torch.randn(1, 4, n, 64) for _ in range(2)]
    seg = EncodedSegment(codec, (2, 4, 64), torch.arange(n), *encode_kv(keys, values, codec), torch.float32).pinned()
    assert all(b.is_pinned() for b in seg.keys + seg.values)
    k, v = seg.layer(1, 10, 200)
    on_gpu = k.to("cuda", non_blocking=True)
    assert on_gpu.blob.is_cuda and on_gpu.blob.numel() == codec.nbytes(4, n, 64, True)  # the codec's bytes
    for x in (k, v):
        got = dense(x, torch.device("cuda"), torch.float32)
        assert got.is_cuda and torch.allclose(got.cpu(), dense(x, torch.device("cpu"), torch.float32), atol=1e-5)


def test_compaction_copies_a_tail_whose_device_copy_may_still_be_in_flight():
    from hf_attnstore.store.codec import KVCodec
    from hf_attnstore.store.buffer import EncodedSegment
    from hf_attnstore.store.format import encode_kv

    layers, heads, dim, n, tail = 4, 8, 128, 4096, 40
    codec = KVCodec("int8")
    for _ in range(10):
        keys = [torch.randn(1, heads, n, dim) for _ in range(layers)]
        values = [k * 2 for k in keys]
        blobs = encode_kv([k[:, :, : n - tail] for k in keys], [v[:, :, : n - tail] for v in values], codec)
        chunk = EncodedSegment(codec, (layers, heads, dim), torch.arange(n - tail), *blobs, torch.float32).pinned()
        buf = SessionBuffer((layers, heads, dim), torch.float32, pin_memory=True)
        on_gpu = [k.cuda() for k in keys], [v.cuda() for v in values]
        torch.cuda._sleep(50_000_000)  # delay the stream so the copy into host memory lands late
        buf.append(torch.arange(n), *on_gpu)
        assert buf.compact([(0, (chunk, 0, n - tail))]) == n - tail
        seg, a, b = buf.parts[-1]
        assert b - a == tail and torch.equal(seg.keys[layers - 1][:, :, a:b], keys[-1][:, :, n - tail :])
