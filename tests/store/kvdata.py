"""Synthetic KV whose every value encodes (session seed, layer, token), so any mix-up is detectable."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from hf_attnstore.store.buffer import dense

FP = "f" * 64
LAYERS, HEADS, DIM = 3, 2, 4
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * DIM * 4 + 8


def kv(ids: list[int], seed: float = 0.0):
    t = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    keys = [(t + 1000 * layer + seed).expand(1, HEADS, len(ids), DIM).contiguous() for layer in range(LAYERS)]
    return keys, [k + 0.5 for k in keys]


def write_turn(store, session, ids, seed=0.0, keep_from=None, fp=FP):
    """Appends `ids` after `keep_from` (a snapshot) or as a new session; returns the writer's result."""
    base = keep_from
    keep = torch.arange(base.length) if base is not None else torch.arange(0)
    with store.open_turn(session, fp, base, keep) as writer:  # the turn ends: the session may move again
        return writer.append(torch.tensor(ids), *kv(ids, seed))


def expect(snapshot, ids, seed=0.0):
    """Asserts the snapshot holds exactly `ids` with the KV `kv(ids, seed)` would give."""
    assert snapshot is not None
    assert snapshot.token_ids.tolist() == list(ids)
    keys, values = kv(ids, seed)
    for layer in range(LAYERS):
        k, v = layer_of(snapshot, layer)
        assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer]), f"layer {layer} differs"


def layer_of(snapshot, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer as single tensors (waits for a load, like a cache layer does)."""
    parts = snapshot.layer_parts(idx)
    cpu, dtype = torch.device("cpu"), snapshot.source.dtype  # parts kept encoded are dequantized (encoded.py)
    return (torch.cat([dense(k, cpu, dtype) for k, _ in parts], dim=2),
            torch.cat([dense(v, cpu, dtype) for _, v in parts], dim=2))


def chunk_metadata(root: Path) -> list[dict]:
    """The metadata of every chunk file below `root` (what each chunk says of itself: codec, labels, sizes)."""
    out = []
    for path in sorted(Path(root).rglob("*.safetensors")):
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        meta = json.loads(raw[8 : 8 + n]).get("__metadata__", {})
        if "n_tokens" in meta:
            out.append(meta)
    return out
