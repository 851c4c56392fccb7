"""Prefix sharing on disk: a shared prefix's chunks are stored once (hard links), counted once, survive the
deletion of any one session that names them, and are rebuilt from the manifests on reopen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hf_attnstore import AttnStore
from hf_attnstore.store import StoreIOError
from hf_attnstore.store.index import blocks
from hf_attnstore.store.format import Manifest, session_dirname

from .kvdata import FP, kv, layer_of

CHUNK = 64
SYSTEM = list(range(1000, 1000 + 3 * CHUNK))  # three whole chunks of a shared prompt


def disk_store(path, **kw):
    return AttnStore(host_bytes="64MiB", disk_dir=path, chunk_tokens=CHUNK, idle_flush_s=0.01, fsync=False, **kw)


def start_from(store, sid, source, shared, own):
    """A new session whose first `shared` tokens are `source`'s KV (as a turn over a shared prefix does), then
    `own` tokens of its own."""
    base = store.lookup(source, FP)
    keys, values = kv(own)
    with store.open_turn(sid, FP, base, torch.arange(shared)) as turn:
        assert turn.append(torch.tensor(own), keys, values)


def folder_files(root, sid, fp=FP):
    folder = store_dir(root, sid, fp)
    manifest = Manifest.decode((folder / "manifest.json").read_bytes())
    return manifest, {s.chunk: (folder / (s.chunk + ".safetensors")).stat() for s in manifest.spans}


def store_dir(root, sid, fp=FP):
    return root / "sessions" / session_dirname(fp, sid)


def used(store):
    return store.stats().disk_bytes_used


def test_a_shared_prefix_is_stored_once_and_counted_once(tmp_path):
    store = disk_store(tmp_path)
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(SYSTEM + [1, 2]), *kv(SYSTEM + [1, 2]))
    store.flush()
    alone = used(store)
    for sid, tail in (("b", [7, 8, 9]), ("c", [5])):
        start_from(store, sid, "a", len(SYSTEM), tail)
    store.flush()
    manifests = {sid: folder_files(tmp_path, sid) for sid in "abc"}
    # b's and c's first three chunks are a's files, by hard link: one inode, named three times.
    a_manifest, a_files = manifests["a"]
    for sid in "bc":
        manifest, files = manifests[sid]
        assert [s.owner for s in manifest.spans[:3]] == ["a"] * 3 and not manifest.spans[3].owner
        for mine, theirs in zip(manifest.spans[:3], a_manifest.spans[:3]):
            assert files[mine.chunk].st_ino == a_files[theirs.chunk].st_ino and files[mine.chunk].st_nlink == 3
    # Counted once: b and c add only their own tail chunk and manifest.
    shared = sum(blocks(a_files[s.chunk].st_size) for s in a_manifest.spans[:3])
    assert used(store) == alone + 2 * (alone - shared)  # the shared chunks are the only thing counted once
    expected = alone
    for sid in "bc":
        manifest, files = manifests[sid]
        expected += blocks(files[manifest.spans[3].chunk].st_size) + blocks(
            (store_dir(tmp_path, sid) / "manifest.json").stat().st_size)
    assert used(store) == expected
    # Loaded from disk, each session is exactly its KV.
    for sid in "abc":
        store.evict(sid)
    expect_prefix(store.lookup("b", FP), SYSTEM + [7, 8, 9])
    expect_prefix(store.lookup("c", FP), SYSTEM + [5])
    store.close()


def test_deleting_a_session_never_takes_a_chunk_another_names(tmp_path):
    store = disk_store(tmp_path)
    ids_a = SYSTEM + [1, 2]
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(ids_a), *kv(ids_a))
    start_from(store, "b", "a", len(SYSTEM), [7, 8, 9])
    store.flush()
    before = used(store)
    manifest, files = folder_files(tmp_path, "b")
    store.delete("a")
    store.flush()
    # a's own bytes went; the shared chunks are b's now, still counted once.
    a_own = before - used(store)
    assert a_own > 0 and used(store) >= sum(blocks(st.st_size) for st in files.values())
    store.evict("b")
    snap = store.lookup("b", FP)
    assert snap is not None and snap.tier == "disk"
    expect_prefix(snap, SYSTEM + [7, 8, 9])
    store.close()
    # Reopened: b is whole, and its files are counted as its own (one name each now).
    again = disk_store(tmp_path)
    expect_prefix(again.lookup("b", FP), SYSTEM + [7, 8, 9])
    assert again.stats().disk_bytes_used == used_after_reopen(tmp_path)
    again.close()


def expect_prefix(snap, ids):
    """b's KV: its first tokens are a's (kv(SYSTEM)), its tail its own (kv(tail))."""
    assert snap is not None and snap.token_ids.tolist() == ids
    sys_keys, _ = kv(SYSTEM)
    tail_keys, _ = kv(ids[len(SYSTEM):])
    for layer in range(len(sys_keys)):
        keys, _ = layer_of(snap, layer)
        assert torch.equal(keys[:, :, : len(SYSTEM)], sys_keys[layer])
        assert torch.equal(keys[:, :, len(SYSTEM):], tail_keys[layer])


def used_after_reopen(path):
    total = 0
    for folder in (path / "sessions").iterdir():
        for f in folder.iterdir():
            total += blocks(f.stat().st_size)
    return total


def du_once(path):
    """What the folder's files occupy, each file once however many names it has (what `du` counts)."""
    seen, total = set(), 0
    for folder in (path / "sessions").iterdir():
        for f in folder.iterdir():
            st = f.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += blocks(st.st_size)
    return total


def test_reopen_rebuilds_the_sharing_from_the_manifests(tmp_path):
    store = disk_store(tmp_path)
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(SYSTEM + [1]), *kv(SYSTEM + [1]))
    for sid, tail in (("b", [7, 8]), ("c", [5])):
        start_from(store, sid, "a", len(SYSTEM), tail)
    store.flush()
    counted = used(store)
    assert counted == du_once(tmp_path)
    # A name no manifest references (a crash between linking and writing the manifest) is collected.
    _, files = folder_files(tmp_path, "a")
    stray = store_dir(tmp_path, "c") / "00000099.safetensors"
    os.link(store_dir(tmp_path, "a") / (sorted(files)[0] + ".safetensors"), stray)
    store.close()
    again = disk_store(tmp_path)
    assert not stray.exists()
    assert again.stats().disk_bytes_used == counted == du_once(tmp_path)
    # The counts are right: deleting two of the three sessions leaves the third's files, counted as its own.
    again.delete("a")
    again.delete("c")
    again.flush()
    assert again.stats().disk_bytes_used == du_once(tmp_path)
    again.evict("b")
    expect_prefix(again.lookup("b", FP), SYSTEM + [7, 8])
    again.close()


def test_sessions_saved_behind_many_newer_sharers_still_link_the_prefix(tmp_path):
    """While saves lag behind new sessions, a session's newest sharers are all unsaved: the oldest one, on disk,
    is the one to link from. 20 sessions start from a's prompt during a forward (their saves wait), then save:
    each links a's files, none writes the prompt again."""
    store = disk_store(tmp_path)
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(SYSTEM + [1]), *kv(SYSTEM + [1]))
    store.flush()
    store.forward_started()  # saves wait for the model's quiet moment
    sids = [f"n{i}" for i in range(20)]
    for i, sid in enumerate(sids):
        start_from(store, sid, "a", len(SYSTEM), [100 + i])
    store.forward_finished()
    store.flush()
    _, a_files = folder_files(tmp_path, "a")
    inodes = {st.st_ino for st in list(a_files.values())[:3]}
    for sid in sids:
        manifest, files = folder_files(tmp_path, sid)
        shared = [st for span, st in zip(manifest.spans, files.values()) if span.owner == "a"]
        assert len(shared) == 3 and {st.st_ino for st in shared} <= inodes, sid
    assert used(store) == du_once(tmp_path)
    store.close()


def test_a_prompt_shared_past_the_link_limit_is_copied_once_per_limit(tmp_path, monkeypatch):
    """The file system allows a file so many names (65,000 on ext4; 4 here): the session refused one writes its
    own copy, and later sessions link that copy, even while their newest sharers are all unsaved."""
    import errno
    from hf_attnstore.store.tiers.disk import DiskTier

    original, refused = DiskTier.link, []

    def link(tier, source, name, key, new_name):
        if (store_dir(tmp_path, source[1]) / (name + ".safetensors")).stat().st_nlink >= 4:
            refused.append(key[1])
            raise OSError(errno.EMLINK, "Too many links")
        return original(tier, source, name, key, new_name)

    monkeypatch.setattr(DiskTier, "link", link)
    store = disk_store(tmp_path)
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(SYSTEM + [1]), *kv(SYSTEM + [1]))
    store.flush()
    store.forward_started()  # the saves of all 31 wait: each save's newest 16 sharers are unsaved
    sids = [f"n{i}" for i in range(31)]
    for i, sid in enumerate(sids):
        start_from(store, sid, "a", len(SYSTEM), [100 + i])
    store.forward_finished()
    store.flush()
    firsts = {folder_files(tmp_path, sid)[1][folder_files(tmp_path, sid)[0].spans[0].chunk].st_ino
              for sid in ["a"] + sids}
    # 32 sessions, 4 names a file: 8 files of the prompt's first chunk, one copy per refusal, each refused once.
    assert len(firsts) == 8 and len(refused) == 7 and len(set(refused)) == 7
    assert used(store) == du_once(tmp_path)
    for i, sid in enumerate(sids):
        expect_prefix(store.lookup(sid, FP), SYSTEM + [100 + i])
    store.close()


def test_share_prefixes_off_links_nothing(tmp_path):
    store = disk_store(tmp_path, share_prefixes=False)
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(SYSTEM + [1]), *kv(SYSTEM + [1]))
    start_from(store, "b", "a", len(SYSTEM), [7])
    store.flush()
    manifest, files = folder_files(tmp_path, "b")
    assert not any(s.owner for s in manifest.spans) and all(st.st_nlink == 1 for st in files.values())
    store.close()


def test_a_shared_chunk_whose_owner_went_before_the_link_is_written_by_the_session(tmp_path, monkeypatch):
    """The link fails (the owner's file was deleted meanwhile): the session writes its own copy, whole."""
    from hf_attnstore.store.tiers.disk import DiskTier

    def gone(self, source, name, key, new_name):
        raise FileNotFoundError("deleted meanwhile")

    store = disk_store(tmp_path)
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(SYSTEM + [1]), *kv(SYSTEM + [1]))
    store.flush()
    monkeypatch.setattr(DiskTier, "link", gone)
    start_from(store, "b", "a", len(SYSTEM), [7])
    store.flush()
    manifest, files = folder_files(tmp_path, "b")
    assert not any(s.owner for s in manifest.spans) and manifest.length == len(SYSTEM) + 1
    assert store.stats().disk_bytes_used == du_once(tmp_path)
    store.evict("b")
    expect_prefix(store.lookup("b", FP), SYSTEM + [7])
    store.close()


def test_a_damaged_shared_chunk_is_a_clean_miss_for_every_session_that_uses_it(tmp_path):
    """One byte of a shared chunk flipped: each session that names it recomputes (exact logits), none is
    served the damaged KV."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from hf_attnstore import AttnStoreCache
    from hf_attnstore.cache.upstream import cache_kwargs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(3, 128, (1, 96), generator=gen)
    prompts = {sid: torch.cat([system, torch.randint(3, 128, (1, 5), generator=gen)], 1) for sid in "ab"}
    store = AttnStore(host_bytes="64MiB", disk_dir=tmp_path, chunk_tokens=32, idle_flush_s=0.01, fsync=False)
    with torch.no_grad():
        for sid, prompt in prompts.items():
            cache = AttnStoreCache(model, store, sid, prompt)
            model(cache.input_ids[:, cache.reused_tokens:], **cache_kwargs(cache), use_cache=True)
            del cache
            store.flush()  # a is on disk before b is saved: b links a's chunks
        fp = AttnStoreCache.fingerprint_of(model, store)
        manifest, files = folder_files(tmp_path, "b", fp)
        shared = [s for s in manifest.spans if s.owner == "a"]
        assert len(shared) == 3  # the 96 shared tokens: three whole chunks, linked
        for sid in "ab":
            store.evict(sid)
        path = store_dir(tmp_path, "b", fp) / (shared[1].chunk + ".safetensors")
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF  # in the last layer's values: the header still parses, the checksum does not match
        path.write_bytes(bytes(data))  # the same file under a's name too (one inode)
        for sid, prompt in prompts.items():
            probe = torch.cat([prompt, torch.tensor([[7]])], 1)
            cache = AttnStoreCache(model, store, sid, probe, save=False)
            got = model(cache.input_ids[:, cache.reused_tokens:], **cache_kwargs(cache)).logits[0, -1]
            want = model(probe, **cache_kwargs(DynamicCache())).logits[0, -1]
            assert float((got - want).abs().max()) < 1e-4, sid
    assert store.stats().load_errors == 2
    store.close()


CHAIN = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, {root!r})
    from hf_attnstore.store import AttnStore, StoreIOError
    from tests.store.kvdata import FP, kv
    from tests.store.test_shared_disk import SYSTEM, CHUNK
    store = AttnStore(host_bytes="64MiB", disk_dir={kvdir!r}, chunk_tokens=CHUNK, idle_flush_s=0.001)
    with store.open_turn("s0", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(SYSTEM + [0]), *kv(SYSTEM + [0]))
    store.flush()
    alive = {{"s0"}}
    def say(*words):
        # One write per line: with PYTHONUNBUFFERED, print writes each word apart, and a kill between two of
        # them would leave a torn line.
        sys.stdout.write(" ".join(words) + "\\n")
        sys.stdout.flush()
    say("ACK", *sorted(alive))
    for step in range(1, 100000):
        # Each session starts from the previous one's shared prompt, so the shared files pass from owner
        # to owner while the older sessions are deleted.
        base = store.lookup(f"s{{step - 1}}", FP)
        sid = f"s{{step}}"
        with store.open_turn(sid, FP, base, torch.arange(len(SYSTEM))) as turn:
            turn.append(torch.tensor([step]), *kv([step]))
        alive.add(sid)
        if step >= 2:
            say("DEL", f"s{{step - 2}}")
            store.delete(f"s{{step - 2}}")
            alive.discard(f"s{{step - 2}}")
        store.flush()  # each session is on disk before the next one is saved: it links its files
        say("ACK", *sorted(alive))
''')


@pytest.mark.parametrize("kill_after_acks", [2, 7, 15])
def test_sigkill_while_shared_chunks_pass_between_sessions(tmp_path, kill_after_acks):
    """kill -9 while sessions that share their prefix's files are created and deleted: after reopening, every
    acknowledged session that was not deleted since is whole and exact, and the files are counted once."""
    kvdir = tmp_path / "kv"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", CHAIN.format(root=root, kvdir=str(kvdir))],
                             stdout=subprocess.PIPE, text=True)
    acked, deleted, acks, deadline = set(), set(), 0, time.monotonic() + 120
    try:
        for line in child.stdout:
            word, *rest = line.split()
            if word == "DEL":
                deleted.add(rest[0])
            elif word == "ACK":
                acked, acks = set(rest), acks + 1
                if acks >= kill_after_acks:
                    break
            assert time.monotonic() < deadline, "the child made no progress"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    # The child may have gone on after the last ACK we read: a deletion it began is announced first (DEL), so
    # the lines it wrote before the kill say which sessions are gone on purpose. A line the kill cut short
    # announced nothing: the deletion comes after the whole line is written.
    for line in child.stdout:
        word, *rest = line.split() if line.endswith("\n") else ("",)
        if word == "DEL":
            deleted.add(rest[0])
    with AttnStore(host_bytes="64MiB", disk_dir=kvdir, chunk_tokens=CHUNK) as store:
        survivors = acked - deleted
        assert survivors
        for sid in survivors:
            expect_prefix(store.lookup(sid, FP), SYSTEM + [int(sid[1:])])
        # The survivors name the first session's files (deleted long ago), passed on by hard links.
        owners = {s.owner for sid in survivors for s in folder_files(kvdir, sid)[0].spans}
        assert owners == {"s0", ""} or survivors == {"s0"}
        assert store.stats().disk_bytes_used == du_once(kvdir)
    assert not list(kvdir.rglob(".tmp-*"))


def test_the_remote_mirror_holds_a_shared_prefix_once_and_another_server_resumes_from_it(tmp_path):
    """With a disk tier mirrored to Redis: the shared chunks are put once, under the session that wrote them;
    a second server resumes the sharing session from Redis, exactly."""
    from hf_attnstore.lab.redis_server import RedisServer

    with RedisServer(tmp_path / "redis") as server:
        one = disk_store(tmp_path / "one", remote=server.url, remote_ttl_s=3600)
        with one.open_turn("a", FP, None, torch.empty(0)) as turn:
            turn.append(torch.tensor(SYSTEM + [1]), *kv(SYSTEM + [1]))
        one.flush()
        written = one.stats().remote_bytes_written
        start_from(one, "b", "a", len(SYSTEM), [7, 8])
        one.flush()
        # b's mirror copy: its own tail chunk and manifest only (the shared chunks are there under a's key).
        assert 0 < one.stats().remote_bytes_written - written < written / 2
        import redis

        chunks = redis.Redis.from_url(server.url).keys("attnstore:*:c:*")
        assert len(chunks) == 4 + 1  # a's three shared chunks and tail, b's tail
        assert all(0 < redis.Redis.from_url(server.url).ttl(k) <= 3600 for k in chunks)  # renewed by b's manifest
        two = disk_store(tmp_path / "two", remote=server.url)
        snap = two.lookup("b", FP)
        assert snap is not None and snap.tier == "remote"
        expect_prefix(snap, SYSTEM + [7, 8])
        for store in (one, two):
            store.close()


@pytest.mark.parametrize("limit", [None, 139264, 122880, 98304])
def test_the_disk_limit_and_the_count_hold_when_a_shared_source_is_in_the_way(tmp_path, limit):
    """b links a's chunks and needs room for four chunks of its own: a is pinned while b's save links it, so
    room is never made by evicting it (its files would stay, held by b's links); the count always equals the
    file system's and never exceeds `disk_bytes` (found by review: b was stored 24 KiB over the limit)."""
    store = disk_store(tmp_path, **({"disk_bytes": limit} if limit else {}))
    ids = SYSTEM + [1, 2]
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(ids), *kv(ids))
    store.flush()
    start_from(store, "b", "a", len(SYSTEM), list(range(5000, 5000 + 4 * CHUNK)))
    try:
        store.flush()
    except StoreIOError:  # b does not fit next to a, which cannot leave while b links it: refused, nothing evicted
        assert limit is not None and limit < 32 * 4096 and store.stats().rejected_too_large == 1
    assert store.stats().disk_bytes_used == du_once(tmp_path) <= (limit or 1 << 40)
    store.close(flush=False)


def test_one_session_naming_a_shared_file_twice_releases_it_cleanly(tmp_path):
    """b's new history links a's chunks again while its old copy (linking them too) is still there, and its save
    is cut meanwhile, so b names each shared file twice; deleting a, then b, keeps the count exact (found by
    review: a KeyError stopped the save thread's bookkeeping and left b pinned)."""
    from hf_attnstore.store.tiers.disk import DiskTier

    store = disk_store(tmp_path)
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(SYSTEM + [1, 2]), *kv(SYSTEM + [1, 2]))
    store.flush()
    start_from(store, "b", "a", len(SYSTEM), [7, 8, 9])
    store.flush()
    cut = []
    real = DiskTier.link

    def link(disk, source, name, key, new_name):
        made = real(disk, source, name, key, new_name)
        if key[1] == "b" and not cut:  # b's history is cut while this save runs: it commits nothing
            cut.append(True)
            with store.open_turn("b", FP, store.lookup("b", FP), torch.arange(len(SYSTEM) + 8)) as turn:
                turn.append(torch.tensor([9]), *kv([9]))
        return made

    DiskTier.link = link
    try:
        start_from(store, "b", "a", len(SYSTEM), [4] * 70)  # a new history over the same prompt
        store.flush(timeout=30)
    finally:
        DiskTier.link = real
    assert cut
    store.delete("a")
    store.flush(timeout=30)
    assert store.stats().disk_bytes_used == du_once(tmp_path)
    store.delete("b")
    store.flush(timeout=30)
    assert store.stats().disk_bytes_used == du_once(tmp_path) == 0
    assert store.stats().write_errors == 0
    store.close()


def test_chunks_of_another_kv_layout_are_never_linked(tmp_path):
    """Two sessions under one key with other KV dtypes (only the raw store API allows it): b writes its own
    chunks and loads back whole (found by review: linked float32 chunks in a float16 session lost it)."""
    store = disk_store(tmp_path)
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(SYSTEM + [1]), *kv(SYSTEM + [1]))
    store.flush()
    ids = SYSTEM + [7]
    keys, values = kv(ids)
    with store.open_turn("b", FP, None, torch.empty(0)) as turn:
        turn.append(torch.tensor(ids), [k.half() for k in keys], [v.half() for v in values])
    store.flush()
    manifest, _ = folder_files(tmp_path, "b")
    assert not any(s.owner for s in manifest.spans)
    store.evict("b")
    snap = store.lookup("b", FP)
    assert snap is not None and snap.token_ids.tolist() == ids
    assert torch.equal(layer_of(snap, 0)[0], keys[0].half())
    store.close()
