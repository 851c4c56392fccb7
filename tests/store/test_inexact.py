"""KV computed under sparse attention (``kv_budget``) is labelled inexact, in host memory, in chunks and manifests,
and the label survives every path a session takes: saving, demotion and loading (disk and Redis), truncation,
host copies kept encoded, restarts. A damaged or contradictory label is a clean miss.

The store only carries the label; which caches may reuse such KV is the cache's rule (tests/cache/test_sparse_labels.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_attnstore.store import AttnStore
from hf_attnstore.store.format import FormatError, Manifest, Span
from hf_attnstore.lab.redis_server import RedisServer

from .kvdata import FP, chunk_metadata, expect, kv

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=8)


def write(store, session, ids, inexact_at=None, keep_from=None, seed=0.0):
    keep = torch.arange(keep_from.length) if keep_from is not None else torch.arange(0)
    with store.open_turn(session, FP, keep_from, keep) as writer:
        assert writer.append(torch.tensor(ids), *kv(ids, seed), inexact_at=inexact_at)


def test_the_host_copy_knows_its_exact_prefix():
    store = AttnStore("64MiB")
    write(store, "s", list(range(10)))
    assert store.lookup("s", FP).exact_prefix() == 10
    snap = store.lookup("s", FP)
    write(store, "s", list(range(10, 20)), inexact_at=3, keep_from=snap)
    snap = store.lookup("s", FP)
    assert snap.exact_prefix() == 13 and snap.exact_prefix(12) == 12
    # Under causal attention what follows an inexact token is inexact, whatever its forward attended to.
    write(store, "s", list(range(20, 25)), keep_from=snap)
    snap = store.lookup("s", FP)
    assert snap.length == 25 and snap.exact_prefix() == 13
    expect(snap, list(range(25)))  # the label is a label: the KV itself is what was written


def test_an_out_of_range_label_is_refused():
    store = AttnStore("64MiB")
    with store.open_turn("s", FP, None, torch.arange(0)) as writer:
        with pytest.raises(ValueError, match="inexact_at"):
            writer.append(torch.tensor([1, 2]), *kv([1, 2]), inexact_at=3)


def test_labels_are_written_per_chunk_and_in_the_manifest_and_survive_a_restart(tmp_path):
    with AttnStore("64MiB", tmp_path, **FAST) as store:
        write(store, "s", list(range(20)), inexact_at=11)
        store.flush()
    # Chunks [0, 8) exact, [8, 16) inexact from its 4th token, [16, 20) inexact from its first.
    labels = {int(m["n_tokens"]): m.get("inexact_from") for m in chunk_metadata(tmp_path)}
    assert sorted(m.get("inexact_from", "-") for m in chunk_metadata(tmp_path)) == ["-", "0", "3"]
    assert labels[4] == "0"
    with AttnStore("64MiB", tmp_path, **FAST) as store:
        snap = store.lookup("s", FP)
        assert snap.tier == "disk" and snap.exact_prefix() == 11
        expect(snap, list(range(20)))
        # A later turn over it saves again: the new chunk follows inexact KV, so it is inexact too.
        write(store, "s", list(range(20, 30)), keep_from=snap)
        store.flush()
    with AttnStore("64MiB", tmp_path, **FAST) as store:
        assert store.lookup("s", FP).exact_prefix() == 11


def test_an_exact_session_writes_what_it_always_wrote(tmp_path):
    with AttnStore("64MiB", tmp_path, **FAST) as store:
        write(store, "s", list(range(20)))
        store.flush()
    assert all("inexact_from" not in m for m in chunk_metadata(tmp_path))
    manifest = next(tmp_path.rglob("manifest*"))
    assert b"exact" not in manifest.read_bytes()


def test_a_manifest_that_calls_inexact_chunks_exact_is_a_miss(tmp_path):
    with AttnStore("64MiB", tmp_path, **FAST) as store:
        write(store, "s", list(range(20)), inexact_at=11)
        store.flush()
    path = next(tmp_path.rglob("manifest*"))
    manifest = Manifest.decode(path.read_bytes())
    assert manifest.exact == 11
    forged = Manifest(manifest.fingerprint, manifest.session_id, manifest.token_ids, manifest.spans,
                      manifest.next_chunk, manifest.dropped, manifest.state, None)  # "every token is exact"
    path.write_bytes(forged.encode())
    with AttnStore("64MiB", tmp_path, **FAST) as store:
        snap = store.lookup("s", FP)
        with pytest.raises(Exception):
            snap.layer_parts(0)  # the load fails when the chunks are opened: the turn recomputes
        assert store.stats().load_errors == 1
        assert store.lookup("s", FP) is None  # and the session is gone: a clean miss


@pytest.mark.parametrize("exact", [-1, 20, 99, True, "3", 1.5])
def test_a_damaged_exact_field_is_refused(exact):
    ids = torch.arange(20)
    body = Manifest(FP, "s", ids, (Span("00000000", 0, 20, "d"),), 1).encode()
    outer = json.loads(body)
    inner = json.loads(outer["body"])
    inner["exact"] = exact
    text = json.dumps(inner, sort_keys=True)
    from hf_attnstore.store.format import checksum
    data = json.dumps({"body": text, "xxh64": checksum(text.encode())}).encode()
    with pytest.raises(FormatError):
        Manifest.decode(data)


def test_a_selection_keeps_the_label_of_every_token():
    ids = torch.arange(20)
    manifest = Manifest(FP, "s", ids, (Span("00000000", 0, 20, "d"),), 1, exact=11)
    assert manifest.select([(0, 4), (8, 20)]).exact == 7  # 0-3 and 8-10 are exact
    assert manifest.select([(0, 4), (12, 20)]).exact == 4
    assert manifest.select([(0, 10)]).exact is None  # every kept token is exact
    assert manifest.drop_head_span().exact == 11


def test_a_truncated_copy_keeps_the_labels_of_its_tokens():
    store = AttnStore("64MiB")
    write(store, "s", list(range(20)), inexact_at=11)
    snap = store.lookup("s", FP)
    keep = torch.cat([torch.arange(4), torch.arange(8, 20)])
    with store.open_turn("s", FP, snap, keep) as writer:
        assert writer.append(torch.tensor([99]), *kv([99]))
    truncated = store.lookup("s", FP)
    assert truncated.length == 17 and truncated.exact_prefix() == 7


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_host_copies_kept_encoded_keep_the_label(tmp_path, codec):
    store = AttnStore("64MiB", tmp_path, kv_codec=codec, **FAST)
    write(store, "s", list(range(20)), inexact_at=11)
    store.flush()
    assert store.stats().host_encoded_tokens == 16  # the two whole chunks are held by the codec now
    assert store.lookup("s", FP).exact_prefix() == 11
    store.evict("s")
    store.flush()
    assert store.lookup("s", FP).exact_prefix() == 11  # read back, kept encoded again
    store.close()


def test_prefix_sharing_never_links_inexact_chunks_into_an_exact_session(tmp_path):
    store = AttnStore("64MiB", tmp_path, **{**FAST, "chunk_tokens": 64})
    ids = list(range(1000, 1160))
    write(store, "a", ids, inexact_at=70)  # chunk 0 exact, chunk 1 inexact from its 7th token
    store.flush()
    write(store, "b", ids)  # the same tokens, all exact
    store.flush()
    manifest = next(Manifest.decode(p.read_bytes()) for p in tmp_path.rglob("manifest*")
                    if Manifest.decode(p.read_bytes()).session_id == "b")
    assert [span.owner for span in manifest.spans] == ["a", "", ""]  # a's chunk 0 only is linked
    assert manifest.exact is None
    store.evict("b")
    store.flush()
    snap = store.lookup("b", FP)
    assert snap.tier == "disk" and snap.exact_prefix() == 160
    expect(snap, ids)
    store.close()


def test_the_label_travels_through_redis(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        a = AttnStore("64MiB", remote=server.url, remote_timeout_s=2, **FAST)
        write(a, "s", list(range(20)), inexact_at=11)
        a.flush()
        b = AttnStore("64MiB", remote=server.url, remote_timeout_s=2, **FAST)
        snap = b.lookup("s", FP)
        assert snap.tier == "remote" and snap.exact_prefix() == 11
        expect(snap, list(range(20)))
        a.close()
        b.close()
