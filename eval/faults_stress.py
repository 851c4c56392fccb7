"""Stress rows of the scorecard (eval/faults.py): 16 threads on one store, and a soak of many turns through a small
host tier. Counted as eval/faults.py counts: wrong KV, crashes, data lost; each row states its work and fails on
zero."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from faults import FAST, Row, check_sessions, sequence, turn
from hf_attnstore import AttnStore
from hf_attnstore.store import LoadError


# -- 16 threads ----------------------------------------------------------------------------------------------
def _synthetic(ids: list[int], session: int):
    """KV whose every value names its session, layer and token (the token ids are the positions)."""
    t = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    keys = [(t + 1000 * layer + 10_000 * (session + 1)).expand(1, 2, len(ids), 4).contiguous() for layer in range(3)]
    return keys, [k + 0.5 for k in keys]


def _mixed_up(snap, session: int) -> bool:
    """Whether a snapshot is not session `session`'s first positions with their KV (another session's, shifted)."""
    ids = snap.token_ids.tolist()
    if ids != list(range(len(ids))):
        return True
    keys, values = _synthetic(ids, session)
    for layer in range(3):
        parts = snap.layer_parts(layer)
        k, v = torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)
        if not (torch.equal(k, keys[layer]) and torch.equal(v, values[layer])):
            return True
    return False


def _judge(snap, session: int, written: int | None) -> tuple[bool, bool]:
    """(wrong KV, data lost) of a lookup's result for a session that holds `written` tokens (None: not known,
    after a refused append). More tokens than written is wrong KV; fewer, or a miss, is data lost."""
    if snap is None:
        return False, bool(written)
    wrong = _mixed_up(snap, session) or (written is not None and snap.length > written)
    return wrong, written is not None and snap.length < written


def scenario_threads(turns_per_thread: int, threads: int = 16) -> Row:
    """Each thread runs turns on 3 sessions of its own (so it knows what each holds: its positions 0..n-1, KV
    naming the session), evicts and deletes them, and prefetches other threads' sessions. Every snapshot must be
    exactly the session's n tokens: another session's KV, shifted positions or more tokens is wrong KV; fewer,
    or a miss, is data lost."""
    root = tempfile.mkdtemp(prefix="faults-threads-")
    row = Row(f"{threads} threads (turns, evict, prefetch, delete)")
    fp = "f" * 64
    errors, lock, written = [], threading.Lock(), {}  # written: sid -> tokens it holds (None: not known)
    checked, misses, refused = [0, 0], [0], [0]
    store = AttnStore(host_bytes=60_000, disk_dir=root, **{**FAST, "chunk_tokens": 4})

    def worker(t: int):
        rng = random.Random(t)
        for step in range(turns_per_thread):
            i = rng.randrange(3)
            sid, session = f"t{t}-{i}", t * 10 + i
            try:
                op = rng.random()
                if op < 0.1:
                    store.evict(sid)
                elif op < 0.15:
                    store.delete(sid)
                    written[sid] = 0
                elif op < 0.2:
                    store.prefetch([f"t{rng.randrange(threads)}-{rng.randrange(3)}"], fp)
                else:
                    snap = store.lookup(sid, fp)
                    try:
                        wrong, lost = _judge(snap, session, written.get(sid, 0))
                    except LoadError:  # the load failed: a miss
                        snap = None
                        wrong, lost = _judge(snap, session, written.get(sid, 0))
                    start = snap.length if snap is not None else 0
                    ids = list(range(start, start + rng.randrange(1, 6)))
                    with store.open_turn(sid, fp, snap, torch.arange(start)) as writer:
                        stored = writer.append(torch.tensor(ids), *_synthetic(ids, session))
                    written[sid] = start + len(ids) if stored else None
                    with lock:
                        row.runs += 1
                        row.wrong += wrong
                        row.lost += lost
                        if snap is not None:
                            checked[0], checked[1] = checked[0] + 1, checked[1] + snap.length
                        misses[0] += lost
                        refused[0] += not stored
            except Exception as exc:
                with lock:
                    errors.append(exc)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(300)
    if any(th.is_alive() for th in pool):
        row.crashes += 1
        row.notes.append("deadlock")
    for exc in errors:
        row.crash(exc)
    reopened_tokens = 0
    try:
        store.close()
        with AttnStore(host_bytes="64MiB", disk_dir=root, **FAST) as reopened:
            for sid, n in written.items():
                snap = reopened.lookup(sid, fp)
                wrong, lost = _judge(snap, int(sid[1:].split("-")[0]) * 10 + int(sid[-1]), n)
                row.wrong += wrong
                row.lost += lost
                reopened_tokens += 0 if snap is None else snap.length
    except Exception as exc:
        row.crash(exc)
    shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{checked[0]} snapshots ({checked[1]:,} tokens) checked against what their thread wrote, "
                     f"{refused[0]} appends refused; {reopened_tokens:,} tokens checked after a reopen")
    if misses[0]:
        row.notes.append(f"{misses[0]} lookups served less than the session held")
    if not checked[1] or not reopened_tokens:
        row.zero_work("no snapshot with tokens checked")
    return row


# -- soak --------------------------------------------------------------------------------------------------
def _rss_fds_threads() -> tuple[int, int, int]:
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss, len(os.listdir("/proc/self/fd")), threading.active_count()


def _tensor_bytes(model) -> int:
    """Bytes of the tensor storages alive in this process outside `model` (the store's KV among them)."""
    import gc
    import warnings

    gc.collect()
    seen = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some torch module objects warns of deprecations
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


SOAK_CAP, SOAK_HOST = 64, 150_000  # sessions restart at 64 tokens (49 kB); the host tier holds 3 of them


def scenario_soak(model, turns: int) -> Row:
    """Turns over 12 sessions through a host tier for 3 (a demotion and a disk load nearly every turn), sessions
    deleted and started again at 64 tokens. Nothing may grow: threads and open files stay as they were at turn
    50; the tensors alive outside the model stay within the geometric mean of `host_bytes` (what the store may
    keep) and the bytes loaded from disk (what a leak of the loads would keep); RSS, which the allocator's caching
    grows early on, grows less in the second half than that half loaded from disk."""
    root = tempfile.mkdtemp(prefix="faults-soak-")
    row = Row(f"soak: {turns} turns, 12 sessions, host tier for 3")
    lengths, marks = {}, {}
    try:
        with AttnStore(host_bytes=SOAK_HOST, disk_dir=root, **FAST) as store:
            for step in range(turns):
                k = step % 12
                lengths[k] = lengths.get(k, 0) + 8
                if lengths[k] > SOAK_CAP:
                    lengths[k] = 8
                    store.delete(f"s{k}")
                turn(model, store, f"s{k}", sequence(k)[:, : lengths[k]])
                row.runs += 1
                if step in (50, (50 + turns) // 2, turns - 1):
                    marks[step] = (*_rss_fds_threads(), store.stats().bytes_read)
            tensors, stats = _tensor_bytes(model), store.stats()
            store.flush()
            check_sessions(model, store, {f"s{k}": sequence(k) for k in lengths}, row)
        (rss0, fds0, threads0, read0), (rss1, _, _, read1), (rss2, fds2, threads2, read2) = marks.values()
        bound = (SOAK_HOST * (read2 - read0)) ** 0.5
        row.notes.append(f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} -> {rss2 / 2**20:.1f} MiB (second half "
                         f"+{(rss2 - rss1) / 2**10:,.0f} KiB, {(read2 - read1) / 2**10:,.0f} KiB loaded), "
                         f"fds {fds0} -> {fds2}, threads {threads0} -> {threads2} (turn 50 -> {turns}); tensors "
                         f"outside the model {tensors:,} B (bound {bound:,.0f}); {stats.demotions} demotions, "
                         f"{stats.hits_disk} loads; "
                         f"{row.reused:,} tokens reused by {row.resumed} resumes")
        grew = [what for what, bad in (("open files", fds2 > fds0), ("threads", threads2 > threads0),
                                       ("tensors", tensors > bound), ("RSS", rss2 - rss1 > read2 - read1)) if bad]
        if grew:
            row.crashes += 1
            row.notes.append("grew: " + ", ".join(grew))
        if not stats.demotions or not stats.hits_disk or not row.reused:
            row.zero_work("no demotion, no load or nothing reused")
    except Exception as exc:
        row.crash(exc)
    shutil.rmtree(root, ignore_errors=True)
    return row
