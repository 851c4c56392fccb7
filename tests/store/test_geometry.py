"""KV geometries: keys and values of one shape (the short form files have always recorded) or of two (multi-head
latent attention: the key's rotary part and a wider latent), through host memory, chunk files and the codecs."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hf_attnstore.store import AttnStore
from hf_attnstore.store.tiers.disk import DiskTier
from hf_attnstore.store.format import FormatError, encode_chunk, prefix_digest
from hf_attnstore.store.format import bytes_per_token, make_geometry, parse_geometry, shapes

from .kvdata import FP

LAYERS, ROT, LATENT = 3, 8, 32


def latent_kv(ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, keys ``[1, 1, n, ROT]`` and values ``[1, 1, n, LATENT]`` whose values encode (layer, token, dim)."""
    t = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    keys = [t + 1000 * layer + torch.arange(ROT) / 100 for layer in range(LAYERS)]
    values = [-t - 1000 * layer - torch.arange(LATENT) / 100 for layer in range(LAYERS)]
    return keys, values


def test_the_short_form_is_kept_where_keys_and_values_agree():
    assert make_geometry(3, (2, 4), (2, 4)) == (3, 2, 4)
    assert make_geometry(3, (1, 8), (1, 32)) == (3, 1, 8, 1, 32)
    assert shapes((3, 2, 4)) == (3, (2, 4), (2, 4))
    assert shapes((3, 1, 8, 1, 32)) == (3, (1, 8), (1, 32))
    assert parse_geometry([3, 2, 4, 2, 4]) == (3, 2, 4)  # canonical either way
    assert bytes_per_token((3, 1, 8, 1, 32), 2) == 3 * (8 + 32) * 2
    for bad in ([3, 2], [3, 2, 4, 1], [3, 0, 4], [3, 2, -4, 1, 8], [1, 2, 3, 4, 5, 6]):
        with pytest.raises(ValueError):
            parse_geometry(bad)


def test_files_of_equal_shapes_record_the_short_form():
    """Files (and their digests) of every model cached before latent attention came are unchanged."""
    keys, values = [torch.zeros(1, 2, 3, 4) for _ in range(LAYERS)], [torch.ones(1, 2, 3, 4) for _ in range(LAYERS)]
    data, _ = encode_chunk(FP, "s", torch.arange(3), keys, values, prefix_digest(FP, torch.tensor([])), "")
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert json.loads(header["__metadata__"]["geometry"]) == [LAYERS, 2, 4]


@pytest.mark.parametrize("codec", [None, "int8", "int4"])
def test_keys_and_values_of_two_shapes_round_trip_through_host_and_disk(tmp_path, codec):
    ids = list(range(5, 45))
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), kv_codec=codec, chunk_tokens=16, fsync=False)
    keys, values = latent_kv(ids)
    with store.open_turn("s", FP, None, torch.arange(0)) as writer:
        assert writer.append(torch.tensor(ids), keys, values)
    host = store.lookup("s", FP)
    assert host.source.geometry == (LAYERS, 1, ROT, 1, LATENT)
    assert host.source.nbytes >= len(ids) * (bytes_per_token(host.source.geometry, 4) + 8)
    store.flush()
    store.evict("s")
    loaded = store.lookup("s", FP)
    assert loaded.tier == "disk" and loaded.token_ids.tolist() == ids
    for layer in range(LAYERS):
        parts = loaded.layer_parts(layer)
        k, v = torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)
        assert k.shape == (1, 1, len(ids), ROT) and v.shape == (1, 1, len(ids), LATENT)
        if codec is None:
            assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer])
        else:  # lossy: within the codec's error of each tensor's range
            for got, want in ((k, keys[layer]), (v, values[layer])):
                assert (got - want).abs().max() <= 0.1 * want.abs().max()
    store.close()


def test_a_chunk_whose_shapes_disagree_with_its_geometry_is_refused(tmp_path):
    disk = DiskTier(tmp_path / "kv", fsync=False)
    keys, values = latent_kv([5, 6, 7])
    data, _ = encode_chunk(FP, "s", torch.tensor([5, 6, 7]), keys, values, prefix_digest(FP, torch.tensor([])), "")
    # The same bytes with the recorded geometry swapped (keys as wide as values): shapes no longer match.
    lied = data.replace(b"[3, 1, 8, 1, 32]", b"[3, 1, 32, 1, 8]")
    assert lied != data
    disk.write_file(FP, "s", "00000000.safetensors", lied)
    with pytest.raises(FormatError):
        fd, _ = disk.open_chunk(FP, "s", "00000000")
        os.close(fd)


def test_a_turn_cannot_change_its_shapes(tmp_path):
    store = AttnStore(host_bytes="16MiB")
    keys, values = latent_kv([5, 6])
    with store.open_turn("s", FP, None, torch.arange(0)) as writer:
        writer.append(torch.tensor([5, 6]), keys, values)
        with pytest.raises(TypeError):
            writer.append(torch.tensor([7, 8]), values, keys)  # roles swapped: another geometry
        with pytest.raises(TypeError):
            writer.append(torch.tensor([7, 8]), keys, [v[:, :, :1] for v in values])  # a token short
