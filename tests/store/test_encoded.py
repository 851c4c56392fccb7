"""Host copies kept encoded (store/encoded.py): the save thread's blobs replace a session's written chunks."""

from __future__ import annotations

import time

import pytest
import torch

from hf_attnstore.store import AttnStore
from hf_attnstore.store.buffer import SessionBuffer
from hf_attnstore.store.codec import KVCodec
from hf_attnstore.store.buffer import EncodedSegment, EncodedSlice, copy_into, dense
from hf_attnstore.store.format import encode_kv

from .kvdata import FP, HEADS, LAYERS, layer_of
from .test_codec import noisy_kv

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=8)
DIM = 16
CPU = torch.device("cpu")


def encoded_chunk(codec, ids, keys, values, start, end):
    k, v = [t[:, :, start:end] for t in keys], [t[:, :, start:end] for t in values]
    return EncodedSegment(codec, (LAYERS, HEADS, DIM), torch.tensor(ids[start:end]), *encode_kv(k, v, codec),
                          torch.float32)


def whole(start, seg):
    """`seg` as the encoded copy of tokens [start, start + its length) of a buffer."""
    return start, (seg, 0, seg.filled)


def dequantized(codec, t, keys):
    out = torch.empty_like(t)
    codec.decode_into(codec.encode(t, keys=keys), t.shape[2], out, keys=keys)
    return out


def buffer_of(n):
    keys, values = noisy_kv(n)
    buf = SessionBuffer((LAYERS, HEADS, DIM), torch.float32, pin_memory=False)
    buf.append(torch.arange(n), keys, values)
    return buf, keys, values


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_an_encoded_slice_decodes_its_tokens_and_narrows(name):
    codec = KVCodec(name, group=8)
    keys, values = noisy_kv(24)
    seg = encoded_chunk(codec, list(range(24)), keys, values, 0, 24)
    k, v = seg.layer(1, 5, 21)
    assert isinstance(k, EncodedSlice) and k.shape == (1, HEADS, 16, DIM) and v.shape == (1, HEADS, 16, DIM)
    assert torch.equal(dense(k, CPU, torch.float32), dequantized(codec, keys[1], True)[:, :, 5:21])
    assert torch.equal(dense(v, CPU, torch.float32), dequantized(codec, values[1], False)[:, :, 5:21])
    narrow = k.narrow(2, 3, 4)
    assert narrow.shape[2] == 4 and torch.equal(narrow.decode(torch.float32),
                                                dequantized(codec, keys[1], True)[:, :, 8:12])
    out = torch.zeros(1, HEADS, 16, DIM, dtype=torch.float64)
    copy_into(out, v)
    assert torch.allclose(out, dequantized(codec, values[1], False)[:, :, 5:21].double())
    assert seg.nbytes == LAYERS * (codec.nbytes(HEADS, 24, DIM, True) + codec.nbytes(HEADS, 24, DIM, False)) + 8 * 24


def test_compact_swaps_whole_chunks_copies_the_tail_and_frees_memory():
    codec = KVCodec("int8", group=8)
    buf, keys, values = buffer_of(70)
    ids = list(range(70))
    before = buf.snapshot()
    full_bytes = buf.nbytes
    assert buf.compact([whole(0, encoded_chunk(codec, ids, keys, values, 0, 32)),
                        whole(32, encoded_chunk(codec, ids, keys, values, 32, 64))]) == 64
    snap = buf.snapshot()
    assert snap.token_ids.tolist() == ids and buf.length == 70
    assert [type(seg).__name__ for seg, _, _ in buf.parts] == ["EncodedSegment", "EncodedSegment", "Segment"]
    # The old segment (70 tokens at fp32) is no longer used: the tail's 6 tokens were copied out (into a
    # segment of 16, the allocation unit, so that the next turn appends in place).
    tail = buf.parts[2][0]
    assert tail is not before.parts[0][0] and tail.capacity == 16
    assert buf.nbytes == buf.parts[0][0].nbytes * 2 + full_bytes // 70 * 16 < full_bytes * 0.6
    for layer in range(LAYERS):
        k, v = layer_of(snap, layer)
        assert torch.equal(k[:, :, :64], torch.cat([dequantized(codec, keys[layer][:, :, a:a + 32], True)
                                                    for a in (0, 32)], dim=2))
        assert torch.equal(k[:, :, 64:], keys[layer][:, :, 64:]), "the trailing partial chunk stays exact"
        assert torch.equal(v[:, :, 64:], values[layer][:, :, 64:])
        # A snapshot taken before is untouched: it still reads full precision.
        assert torch.equal(layer_of(before, layer)[0], keys[layer])
    # Appends go on after the copied tail (in place), and the writer's view dequantizes encoded parts.
    more_k, more_v = noisy_kv(3, seed=1)
    buf.append(torch.arange(70, 73), more_k, more_v)
    assert len(buf.parts) == 3 and buf.length == 73
    ids_out, k_out, _ = buf.snapshot().tensors(60, 73)
    assert ids_out.tolist() == list(range(60, 73)) and torch.equal(k_out[0][:, :, 10:], more_k[0])


def test_compact_refuses_chunks_that_do_not_match():
    codec = KVCodec("int4", group=8)
    buf, keys, values = buffer_of(40)
    ids = list(range(40))
    wrong_ids = list(range(100, 140))
    assert buf.compact([whole(0, encoded_chunk(codec, wrong_ids, keys, values, 0, 32))]) == 0  # other tokens
    longer = noisy_kv(48)
    assert buf.compact([whole(16, encoded_chunk(codec, list(range(48)), *longer, 16, 48))]) == 0  # past the end
    assert len(buf.parts) == 1
    assert buf.compact([whole(8, encoded_chunk(codec, ids, keys, values, 8, 16))]) == 8
    assert buf.compact([whole(8, encoded_chunk(codec, ids, keys, values, 8, 16))]) == 0  # already encoded
    assert [(b - a) for _, a, b in buf.parts] == [8, 8, 24]
    assert buf.snapshot().token_ids.tolist() == ids


def loaded(store, timeout=10.0):
    """Waits until the store has finished every load (its index updated, not only the layers read)."""
    deadline = time.monotonic() + timeout
    while store.stats().loads_in_flight:
        assert time.monotonic() < deadline, "a load did not finish"
        time.sleep(0.005)


def make(path, **kw):
    return AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(path), **FAST, **kw})


def write(store, n=20, session="s"):
    keys, values = noisy_kv(n)
    with store.open_turn(session, FP, None, torch.arange(0)) as writer:
        assert writer.append(torch.arange(n), keys, values)
    store.flush()
    return keys, values


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_store_keeps_written_chunks_encoded_and_serves_the_same_kv_as_its_disk_copy(tmp_path, name):
    with make(tmp_path / "exact", kv_codec=name, kv_codec_host=False) as store:
        write(store, n=44)
        exact_bytes = store.stats().host_bytes_used
        assert store.stats().host_encoded_tokens == 0
    with make(tmp_path / "kv", kv_codec=name) as store:
        keys, values = write(store, n=44)
        stats = store.stats()
        assert stats.host_encoded_tokens == 40  # five whole chunks of 8; the last 4 tokens stay exact
        codec, per_token = KVCodec(name), exact_bytes // 48  # 44 tokens were held in a segment of 48
        chunk = LAYERS * (codec.nbytes(HEADS, 8, DIM, True) + codec.nbytes(HEADS, 8, DIM, False)) + 8 * 8
        assert stats.host_bytes_used == 5 * chunk + 16 * per_token < exact_bytes
        host = store.lookup("s", FP)
        assert host.tier == "host"
        from_host = [layer_of(host, layer) for layer in range(LAYERS)]
        store.evict("s")
        disk = store.lookup("s", FP)
        assert disk.tier == "disk"
        for layer in range(LAYERS):
            # The host copy of the whole chunks is the disk copy's own blobs: resumed from either tier, the
            # same KV. The trailing partial chunk is exact in host memory (lossy on disk, rewritten later).
            k, v = layer_of(disk, layer)
            host_k, host_v = from_host[layer]
            assert torch.equal(host_k[:, :, :40], k[:, :, :40]) and torch.equal(host_v[:, :, :40], v[:, :, :40])
            assert not torch.equal(host_k[:, :, :40], keys[layer][:, :, :40])
            assert torch.equal(host_k[:, :, 40:], keys[layer][:, :, 40:])
            assert torch.equal(host_v[:, :, 40:], values[layer][:, :, 40:])


def test_chunks_written_during_a_turn_are_kept_encoded_once_it_ends(tmp_path):
    with make(tmp_path / "kv", kv_codec="int8", idle_flush_s=60) as store:
        keys, values = noisy_kv(20)
        with store.open_turn("s", FP, None, torch.arange(0)) as writer:
            assert writer.append(torch.arange(20), keys, values)
            store.flush()  # written while the turn is open: its buffer must not change under it
            assert store.stats().host_encoded_tokens == 0
            during = store.stats().host_bytes_used
            assert torch.equal(layer_of(store.lookup("s", FP), 2)[0], keys[2])
        store.flush()  # the turn has ended: the copies that waited are applied
        assert store.stats().host_encoded_tokens == 16
        assert store.stats().host_bytes_used < during
        k = layer_of(store.lookup("s", FP), 2)[0]
        assert not torch.equal(k[:, :, :16], keys[2][:, :, :16]) and torch.equal(k[:, :, 16:], keys[2][:, :, 16:])


@pytest.mark.parametrize("with_turn", [False, True])
def test_a_session_loaded_from_disk_keeps_the_chunks_it_read_encoded(tmp_path, with_turn):
    with make(tmp_path / "kv", kv_codec="int4") as store:
        write(store, n=44)
        store.evict("s")
        encoded_before = store.stats().host_encoded_tokens
        snap = store.lookup("s", FP)  # a load from disk: dequantized into host memory, the blobs kept too
        assert snap.tier == "disk"
        from_disk = [layer_of(snap, layer) for layer in range(LAYERS)]
        loaded(store)
        if with_turn:
            with store.open_turn("s", FP, snap, torch.arange(44)) as writer:
                assert writer.append(torch.tensor([7]), *[[t[:, :, :1] for t in x] for x in noisy_kv(1, seed=2)])
        store.flush()
        # Every whole chunk and the partial one (its disk copy is lossy too) are held as the blobs read.
        assert store.stats().host_encoded_tokens == encoded_before + 44
        again = store.lookup("s", FP)
        assert again.tier == "host"
        assert all(type(seg).__name__ == "EncodedSegment" for seg, _, _ in again.parts[:6])
        for layer in range(LAYERS):
            k, v = layer_of(again, layer)
            assert torch.equal(k[:, :, :44], from_disk[layer][0]) and torch.equal(v[:, :, :44], from_disk[layer][1])


def test_a_truncated_copy_of_an_encoded_session_is_written_again_from_its_dequantized_kv(tmp_path):
    with make(tmp_path / "kv", kv_codec="int8") as store:
        write(store, n=24)
        snap = store.lookup("s", FP)
        keep = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 20])  # a cut across encoded chunks
        want = [layer_of(snap, layer) for layer in range(LAYERS)]
        with store.open_turn("t", FP, snap, keep) as writer:
            assert writer.append(torch.tensor([99]), *[[t[:, :, :1] for t in x] for x in noisy_kv(1, seed=3)])
        store.flush()
        store.evict("t")
        got = store.lookup("t", FP)
        assert got.tier == "disk" and got.token_ids.tolist() == [*keep.tolist(), 99]
        for layer in range(LAYERS):
            k, _ = layer_of(got, layer)
            kept = want[layer][0][:, :, keep]
            # Quantized again in the new chunks' groups: within the codec's error of the kept KV.
            step = (kept.amax() - kept.amin()) / 255
            assert (k[:, :, :13] - kept).abs().max() <= step


def test_a_lossy_codec_needs_a_lower_tier_and_kv_codec_host_is_a_bool(tmp_path):
    with pytest.raises(ValueError, match="set `disk_dir` or `remote`"):
        AttnStore(host_bytes="1MiB", kv_codec="int8")
    with pytest.raises(TypeError, match="kv_codec_host"):
        AttnStore(host_bytes="1MiB", disk_dir=str(tmp_path), kv_codec="int8", kv_codec_host="yes")
