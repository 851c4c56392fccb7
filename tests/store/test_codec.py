"""Lossy codecs of the cold copies: accuracy, sizes, the chunk format, and which store serves what."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore.store import AttnStore
from hf_attnstore.store.codec import KVCodec, serves
from hf_attnstore.store.format import encode_chunk, prefix_digest, read_chunk_meta

from .kvdata import FP, HEADS, LAYERS, expect, layer_of, write_turn

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=8)


def noisy_kv(n: int, seed: int = 0):
    """KV with a per-channel structure (an outlier channel in the keys), as pre-RoPE keys have."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, HEADS, n, 16, generator=g) * torch.linspace(0.5, 8, 16) for _ in range(LAYERS)]
    values = [torch.randn(1, HEADS, n, 16, generator=g) for _ in range(LAYERS)]
    return keys, values


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("n", [1, 5, 32, 77])
def test_round_trip_error_is_within_half_a_step_of_each_group(name, n):
    codec = KVCodec(name, group=8)
    keys, values = noisy_kv(n)
    for x, is_key in ((keys[0], True), (values[0], False)):
        blob = codec.encode(x, keys=is_key)
        assert blob.dtype == torch.uint8 and blob.numel() == codec.nbytes(HEADS, n, 16, is_key)
        out = torch.empty_like(x)
        codec.decode_into(blob, n, out, keys=is_key)
        # Each group's step is its range / levels; the error is at most half a step, plus the fp16 rounding of
        # the zero point (relative to the group's magnitude).
        axis = 2 if is_key else 3
        moved = x.movedim(axis, -1)
        pad = (-moved.shape[-1]) % 8
        grouped = torch.cat([moved, moved[..., -1:].expand(*moved.shape[:-1], pad)], -1).unflatten(-1, (-1, 8))
        step = (grouped.amax(-1) - grouped.amin(-1)) / (2 ** codec.bits - 1)
        magnitude = grouped.abs().amax(-1)
        err = (out - x).abs().movedim(axis, -1)
        err = torch.cat([err, err.new_zeros(*err.shape[:-1], pad)], -1).unflatten(-1, (-1, 8)).amax(-1)
        assert (err <= step * 0.51 + magnitude * 2.0 ** -10).all()
        if n > 3:  # a span of the chunk decodes to the same values as the whole
            part = torch.empty(1, HEADS, n - 3, 16)
            codec.decode_into(blob, n, part, keys=is_key, start=2)
            assert torch.equal(part, out[:, :, 2 : n - 1])


def test_bytes_per_token():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; fp32 is 46,080 B/token.
    assert KVCodec("int8").bytes_per_token(30, 3, 64) == 30 * 2 * 3 * 64 * (1 + 4 / 32)
    assert KVCodec("int4").bytes_per_token(30, 3, 64) == 30 * 2 * 3 * 64 * (0.5 + 4 / 32)
    assert KVCodec("int4", group=64).bytes_per_token(30, 3, 64) < KVCodec("int4").bytes_per_token(30, 3, 64)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_codec="int3"), "unknown KV codec 'int3'"),
    (dict(kv_codec="int8", kv_codec_group=7), "even integer"),
    (dict(kv_codec="int8", kv_codec_group=0), "even integer"),
    (dict(kv_codec=8), "must be None, 'int8' or 'int4'"),
])
def test_bad_codec_options_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttnStore(host_bytes="1MiB", **kwargs)


def test_which_store_serves_which_codec():
    int8, int4, int4_coarse = KVCodec("int8"), KVCodec("int4"), KVCodec("int4", group=128)
    assert serves(None, None) and not serves(None, int8) and not serves(None, int4)  # lossless: exact or miss
    assert serves(int8, None) and serves(int8, int8) and not serves(int8, int4)
    assert serves(int4, int8) and serves(int4, int4) and not serves(int4, int4_coarse)
    assert serves(int4_coarse, int4)


def chunk_meta(data: bytes, session="s"):
    return read_chunk_meta(lambda size, offset: data[offset : offset + size], len(data), FP, session)


def test_a_lossy_chunk_records_its_codec_and_is_smaller():
    keys, values = noisy_kv(32)
    ids, prefix = torch.arange(32), prefix_digest(FP, torch.tensor([]))
    lossless, _ = encode_chunk(FP, "s", ids, keys, values, prefix, "")
    int4, digest = encode_chunk(FP, "s", ids, keys, values, prefix, "", KVCodec("int4"))
    meta = chunk_meta(int4)
    assert meta.codec == KVCodec("int4") and meta.dtype == torch.float32 and meta.digest == digest
    assert chunk_meta(lossless).codec is None
    assert len(int4) < len(lossless) / 4  # 16-channel heads here: a value group is 16 channels, and a header
    out = torch.empty(1, HEADS, 32, 16)
    begin, end = meta.offsets["L0001.v"]
    meta.decode_into("L0001.v", int4[begin:end], out, 0)
    assert (out - values[1]).abs().max() < 0.5


@pytest.mark.parametrize("bad", ["nan", "beyond_fp16"])
def test_kv_a_codec_cannot_hold_is_written_lossless(bad):
    keys, values = noisy_kv(8)
    if bad == "nan":
        keys[1][0, 0, 3, 2] = float("nan")
    else:
        keys[1][0, 0, :, 2] = 7e4  # a zero point beyond fp16's largest value (65504)
    data, _ = encode_chunk(FP, "s", torch.arange(8), keys, values, prefix_digest(FP, torch.tensor([])), "",
                           KVCodec("int8"))
    meta = chunk_meta(data)
    assert meta.codec is None
    out = torch.empty(1, HEADS, 8, 16)
    begin, end = meta.offsets["L0001.k"]
    meta.decode_into("L0001.k", data[begin:end], out, 0)
    assert torch.equal(out, keys[1]) if bad != "nan" else torch.equal(out.nan_to_num(), keys[1].nan_to_num())


def make(path, **kw):
    return AttnStore(**{"host_bytes": "64MiB", "disk_dir": str(path), **FAST, **kw})


def resume(store, session="s"):
    """Writes a 20-token session, moves it to disk and loads it back: the snapshot and the KV written."""
    ids = list(range(20))
    keys, values = noisy_kv(20)
    with store.open_turn(session, FP, None, torch.arange(0)) as writer:
        assert writer.append(torch.tensor(ids), keys, values)
    store.flush()
    store.evict(session)
    snap = store.lookup(session, FP)
    assert snap is not None and snap.tier == "disk" and snap.token_ids.tolist() == ids
    return snap, keys, values


@pytest.mark.parametrize("name, bound", [("int8", 0.01), ("int4", 0.1)])
def test_a_store_with_a_codec_serves_its_disk_copy_dequantized(tmp_path, name, bound):
    with make(tmp_path / "lossless") as store:
        _, keys, _ = resume(store)
        lossless_bytes = store.stats().bytes_written
    with make(tmp_path / name, kv_codec=name) as store:
        snap, keys, values = resume(store)
        for layer in range(LAYERS):
            k, v = layer_of(snap, layer)
            for got, want in ((k, keys[layer]), (v, values[layer])):  # error relative to the largest value
                assert 0 < (got - want).abs().max() < bound * want.abs().max()
        # Tiny chunks here: the headers (ids, checksums) are a large share of the files.
        assert store.stats().bytes_written < lossless_bytes * (0.55 if name == "int8" else 0.45)
        # The session goes on: the next turn appends after the dequantized history and saves again.
        with store.open_turn("s", FP, snap, torch.arange(20)) as writer:
            assert writer.append(torch.arange(20, 26), *noisy_kv(6, seed=1))
        store.flush()
        store.evict("s")
        snap = store.lookup("s", FP)
        assert snap.tier == "disk" and snap.token_ids.tolist() == list(range(26))


def test_a_lossless_store_never_serves_lossy_kv_and_removes_it(tmp_path):
    with make(tmp_path / "kv", kv_codec="int4") as store:
        resume(store)
    with make(tmp_path / "kv") as store:  # reopened lossless: the int4 session is a miss, and gone
        assert store.lookup("s", FP) is None and store.stats().disk_sessions == 0
        assert not any((tmp_path / "kv" / "sessions").iterdir())


def test_a_lossy_store_serves_lossless_kv_exactly(tmp_path):
    with make(tmp_path / "kv") as store:
        write_turn(store, "s", list(range(9)))
    with make(tmp_path / "kv", kv_codec="int4") as store:
        snap = store.lookup("s", FP)
        assert snap.tier == "disk"
        expect(snap, list(range(9)))


def test_an_int8_store_refuses_int4_kv_but_an_int4_store_takes_int8(tmp_path):
    with make(tmp_path / "a", kv_codec="int4") as store:
        resume(store)
    with make(tmp_path / "a", kv_codec="int8") as store:
        assert store.lookup("s", FP) is None
    with make(tmp_path / "b", kv_codec="int8") as store:
        resume(store)
    with make(tmp_path / "b", kv_codec="int4") as store:
        assert store.lookup("s", FP).tier == "disk"


def test_the_remote_tier_serves_lossy_kv_only_to_stores_that_accept_it(tmp_path):
    from hf_attnstore.lab.redis_server import RedisServer

    with RedisServer(tmp_path / "redis") as server:
        with make(tmp_path / "writer", kv_codec="int4", remote=server.url) as writer:
            resume(writer)
        with AttnStore(host_bytes="64MiB", remote=server.url, **FAST) as lossless:
            assert lossless.lookup("s", FP) is None and lossless.stats().misses == 1
        with AttnStore(host_bytes="64MiB", remote=server.url, kv_codec="int4", **FAST) as same:
            snap = same.lookup("s", FP)
            assert snap.tier == "remote"
            assert (layer_of(snap, 2)[1] - noisy_kv(20)[1][2]).abs().max() < 0.5
