"""Chunk files and manifests: round trips and every way a file can be damaged."""

from __future__ import annotations

import os

import pytest
import torch

from hf_attnstore.store.tiers.disk import DiskTier
from hf_attnstore.store.format import (FORMAT, FormatError, Manifest, Span, encode_chunk, file_reader,
                                       prefix_digest, read_range, session_dirname)

from .kvdata import FP, kv


@pytest.fixture
def disk(tmp_path):
    return DiskTier(tmp_path / "kv", fsync=False)


def chunk_path(disk, session="s", name="00000000"):
    return disk.session_dir(FP, session) / f"{name}.safetensors"


def write_chunk(disk, session="s", ids=(5, 6, 7), dtype=torch.float32):
    keys, values = kv(list(ids))
    keys, values = [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    data, _ = encode_chunk(FP, session, torch.tensor(ids), keys, values, prefix_digest(FP, torch.tensor([])), "")
    disk.write_file(FP, session, "00000000.safetensors", data)
    return keys, values


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_chunk_round_trip(disk, dtype):
    keys, values = write_chunk(disk, dtype=dtype)
    fd, meta = disk.open_chunk(FP, "s", "00000000")
    try:
        assert meta.n_tokens == 3 and meta.dtype == dtype and meta.geometry == (3, 2, 4)
        assert disk.read_ids(fd, meta).tolist() == [5, 6, 7]
        for layer in range(3):
            k, v = torch.empty_like(keys[layer]), torch.empty_like(values[layer])
            disk.read_layer_into(fd, meta, layer, 0, 3, k, v)
            assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer])
    finally:
        os.close(fd)


def test_chunk_is_a_standard_safetensors_file(disk):
    from safetensors import safe_open

    write_chunk(disk)
    with safe_open(str(chunk_path(disk)), framework="pt") as f:
        assert f.metadata()["session_id"] == "s"
        assert f.get_tensor("ids").tolist() == [5, 6, 7]


def open_and_read_all(disk, fp=FP, session="s", digest=None):
    """Reads every tensor, as the loader does; with `digest`, also checks the manifest's pin."""
    fd, meta = disk.open_chunk(fp, session, "00000000")
    try:
        for name, (begin, end) in meta.offsets.items():
            read_range(file_reader(fd), begin, end, name, meta)
        if digest is not None and meta.digest != digest:
            raise FormatError("not the pinned chunk")
    finally:
        os.close(fd)
    return meta.digest


def test_truncated_chunk_is_refused(disk):
    write_chunk(disk)
    path = chunk_path(disk)
    data = path.read_bytes()
    for cut in (0, 5, 100, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(FormatError):
            open_and_read_all(disk)


def test_every_single_bit_flip_is_detected(disk):
    write_chunk(disk, ids=(1, 2))
    path = chunk_path(disk)
    data = bytearray(path.read_bytes())
    pinned = open_and_read_all(disk)
    undetected = []
    for pos in range(len(data)):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        path.write_bytes(bytes(flipped))
        try:
            open_and_read_all(disk, digest=pinned)
        except FormatError:
            continue
        undetected.append(pos)
    # JSON whitespace and key order inside the header are the only bytes a flip may leave harmless; none
    # of them can change a tensor, a name, an offset or the metadata's values.
    header_len = int.from_bytes(data[:8], "little")
    for pos in undetected:
        assert 8 <= pos < 8 + header_len and chr(data[pos]) in ' \t\n"', (pos, chr(data[pos]))


def test_chunk_of_another_model_or_session_or_format_is_refused(disk):
    write_chunk(disk)
    src = chunk_path(disk)
    foreign = disk.session_dir("0" * 64, "s") / src.name
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(src.read_bytes())
    with pytest.raises(FormatError, match="another model"):
        disk.open_chunk("0" * 64, "s", "00000000")
    other = chunk_path(disk, session="t")
    other.parent.mkdir(parents=True)
    other.write_bytes(src.read_bytes())
    with pytest.raises(FormatError, match="another session"):
        disk.open_chunk(FP, "t", "00000000")
    src.write_bytes(src.read_bytes().replace(FORMAT.encode(), b"hf_attnstore/9"))
    with pytest.raises(FormatError, match="format"):
        disk.open_chunk(FP, "s", "00000000")


def make_manifest():
    return Manifest(FP, "s", torch.arange(10), (Span("00000000", 0, 6), Span("00000001", 2, 6)), 2)


def test_manifest_round_trip_and_select():
    m = Manifest.decode(make_manifest().encode(), FP)
    assert m.token_ids.tolist() == list(range(10)) and m.next_chunk == 2
    sel = m.select([(0, 2), (5, 9)])
    assert sel.token_ids.tolist() == [0, 1, 5, 6, 7, 8]
    # Spans after the dropped tokens are rebased: their KV was computed after another history.
    assert sel.spans == (Span("00000000", 0, 2), Span("00000000", 5, 6, rebased=True),
                         Span("00000001", 2, 5, rebased=True))
    assert m.select([(0, 7)]).spans == (Span("00000000", 0, 6), Span("00000001", 2, 3))


def test_manifest_damage_is_refused():
    data = make_manifest().encode()
    for pos in range(len(data)):  # every byte: any flip breaks the JSON, a key, or the checksum
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        with pytest.raises(FormatError):
            Manifest.decode(bytes(flipped), FP)
    with pytest.raises(FormatError, match="another model"):
        Manifest.decode(data, "0" * 64)


def test_hostile_session_ids_never_become_paths(tmp_path):
    root = tmp_path / "kv"
    disk = DiskTier(root, fsync=False)
    for sid in ("../x", "/etc/passwd", "a\0b", "..", "x" * 10_000, "\udcff"):
        folder = disk.session_dir(FP, sid)
        assert folder.parent == root.resolve() / "sessions"
        assert folder.name == session_dirname(FP, sid) and len(folder.name) == 40
