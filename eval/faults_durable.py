"""Scorecard rows for the ways acknowledged sessions were lost (issue 43), run by eval/faults.py.

Each row states the work it did (acknowledged tokens checked, saves in flight, Redis restarts, refusals, writes
measured) and fails when that work is zero: a row that exercised nothing passes nothing. KV is synthetic (every
value encodes session, layer and token: tests/store/kvdata.py's scheme), so a mix-up is wrong KV, checked value
by value after a reopen.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from faults import Row
from hf_attnstore import AttnStore
from hf_attnstore.store import StoreIOError
from hf_attnstore.store.tiers import disk as disk_module
from hf_attnstore.store.saver import SavePlanner

FP = "d" * 64
LAYERS, HEADS, DIM = 3, 2, 4
FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, remote_timeout_s=2)


def _kv(ids: list[int], seed: float):
    t = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    keys = [(t + 1000 * layer + seed).expand(1, HEADS, len(ids), DIM).contiguous() for layer in range(LAYERS)]
    return keys, [k + 0.5 for k in keys]


def _append(store, sid, ids, seed, base=None):
    keep = torch.arange(base.length) if base is not None else torch.arange(0)
    with store.open_turn(sid, FP, base, keep) as writer:
        writer.append(torch.tensor(ids), *_kv(ids, seed))


def _served(store, sid, seed) -> tuple[list[int], bool]:
    """The ids the store serves for the session, and whether any value is not what was written."""
    snap = store.lookup(sid, FP)
    if snap is None:
        return [], False
    ids = snap.token_ids.tolist()
    keys, values = _kv(ids, seed)
    for layer in range(LAYERS):
        parts = snap.layer_parts(layer)
        k = torch.cat([p[0] for p in parts], dim=2)
        v = torch.cat([p[1] for p in parts], dim=2)
        if not (torch.equal(k, keys[layer]) and torch.equal(v, values[layer])):
            return ids, True
    return ids, False


def scenario_new_history_in_flight(runs: int, rng: random.Random) -> Row:
    """A session flushed, extended with its save held at a random write, then given a new history; the process
    dies before the new history is durable (every later write fails). The reopened store must serve the
    acknowledged tokens."""
    row = Row("new history while a save is in flight, then death before it is durable")
    acked = in_flight = 0
    for run in range(runs):
        root = Path(tempfile.mkdtemp(prefix="faults-durable-"))
        real_write, real_finish = disk_module._write_bytes, SavePlanner.finish_save
        try:
            row.runs += 1
            chunk = rng.choice([4, 8, 16])
            n, extra = rng.randint(20, 120), rng.randint(5, 60)
            old = [run * 10_000 + i for i in range(1, n + 1)]
            store = AttnStore(host_bytes="64MiB", disk_dir=str(root), chunk_tokens=chunk, **{**FAST, "idle_flush_s": 60})
            _append(store, "a", old, seed=run)
            store.flush()
            acked += n
            gate, entered, broken, hold_at = threading.Event(), threading.Event(), threading.Event(), rng.randint(0, 2)
            calls = [0]

            def held(fd, data):
                calls[0] += 1
                if calls[0] > hold_at:
                    entered.set()
                    gate.wait(10)
                if broken.is_set():
                    raise OSError(5, "Input/output error (the process is dead)")
                real_write(fd, data)

            def finish(self, job, result):
                real_finish(self, job, result)
                broken.set()

            disk_module._write_bytes, SavePlanner.finish_save = held, finish
            _append(store, "a", [run * 10_000 + n + i for i in range(1, extra + 1)], seed=run, base=store.lookup("a", FP))
            flusher = threading.Thread(target=lambda: _quiet(store.flush))
            flusher.start()
            in_flight += entered.wait(10)
            _append(store, "a", [7] + old[1:], seed=run)  # the new history (token 0 edited)
            gate.set()
            flusher.join(20)
            store.close(flush=False)
            disk_module._write_bytes, SavePlanner.finish_save = real_write, real_finish
            with AttnStore(host_bytes="64MiB", disk_dir=str(root), chunk_tokens=chunk, **FAST) as again:
                ids, wrong = _served(again, "a", seed=run)
                row.wrong += wrong
                if len(ids) < n or ids[:n] != old:
                    row.lost += 1
                    row.notes.append(f"served {len(ids)} tokens of the {n} acknowledged")
        except Exception as exc:
            row.crash(exc)
        finally:
            disk_module._write_bytes, SavePlanner.finish_save = real_write, real_finish
            shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{acked} tokens acknowledged before the new histories, all checked; {in_flight} of "
                     f"{row.runs} replaced with a save in flight")
    if not acked or not in_flight:
        row.zero_work("no acknowledged tokens or no save in flight")
    return row


def _quiet(fn) -> None:
    try:
        fn()
    except StoreIOError:
        pass  # the new history is not durable: expected (its writes fail)


def scenario_too_large(runs: int, rng: random.Random) -> Row:
    """Sessions flushed, then one larger than the whole disk tier: refused, and nothing else evicted for it."""
    row = Row("a session too large for the disk tier refused (nothing else evicted)")
    refused = checked = 0
    for run in range(runs):
        root = Path(tempfile.mkdtemp(prefix="faults-durable-"))
        try:
            row.runs += 1
            limit, share = 160_000, bool(run % 2)
            sessions = {f"s{i}": [run * 10_000 + i * 100 + j for j in range(rng.randint(8, 40))] for i in range(3)}
            with AttnStore(host_bytes="64MiB", disk_dir=str(root), disk_bytes=limit, chunk_tokens=4,
                           share_prefixes=share, **FAST) as store:
                for sid, ids in sessions.items():
                    _append(store, sid, ids, seed=run)
                store.flush()
                big = list(range(50_000, 50_000 + rng.randint(500, 900)))
                _append(store, "big", big, seed=run)
                try:
                    store.flush()
                    row.crashes += 1
                    row.notes.append("flush() returned for a session that is not durable")
                except StoreIOError:
                    pass
                stats = store.stats()
                refused += stats.rejected_too_large
                if stats.disk_drops or stats.head_drops:
                    row.lost += 1
                    row.notes.append(f"{stats.disk_drops + stats.head_drops} evictions for a refused session")
                store.close(flush=False)
            with AttnStore(host_bytes="64MiB", disk_dir=str(root), chunk_tokens=4, **FAST) as again:
                for sid, ids in sessions.items():
                    got, wrong = _served(again, sid, seed=run)
                    row.wrong += wrong
                    checked += len(got)
                    if got != ids:
                        row.lost += 1
                        row.notes.append(f"{sid}: {len(got)} of {len(ids)} durable tokens")
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{refused} refusals; {checked} acknowledged tokens of the other sessions checked after a reopen")
    if not refused or not checked:
        row.zero_work("no refusal or nothing checked")
    return row


def scenario_partial_limit(runs: int, rng: random.Random) -> Row:
    """Many sessions through a small disk tier with partial eviction; the folder is measured after every write
    (temporaries and manifests included): over `disk_bytes` counts as a crash (a limit exceeded)."""
    from faults import _du

    row = Row("disk_bytes with partial eviction, the folder measured after every write")
    writes, head_drops, peak = [0], 0, 0
    for run in range(runs):
        root = Path(tempfile.mkdtemp(prefix="faults-durable-"))
        real = disk_module._write_bytes
        measured = [0]

        def measure(fd, data):
            real(fd, data)
            writes[0] += 1
            measured[0] = max(measured[0], _du(root))

        try:
            row.runs += 1
            limit = rng.choice([200_000, 250_000, 300_000])
            disk_module._write_bytes = measure
            with AttnStore(host_bytes="64MiB", disk_dir=str(root), disk_bytes=limit, partial_eviction=True,
                           chunk_tokens=8, **FAST) as store:
                for i in range(14):
                    _append(store, f"s{i}", [i * 1000 + j for j in range(rng.randint(40, 120))], seed=run)
                    store.flush()
                head_drops += store.stats().head_drops
            peak = max(peak, measured[0])
            if measured[0] > limit:
                row.crashes += 1
                row.notes.append(f"the folder reached {measured[0]} bytes with a {limit} limit")
        except Exception as exc:
            row.crash(exc)
        finally:
            disk_module._write_bytes = real
        shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{writes[0]} writes measured, {head_drops} head drops, peak {peak:,} B")
    if not writes[0] or not head_drops:
        row.zero_work("no writes or no head drops")
    return row


def scenario_redis_restart(runs: int, rng: random.Random) -> Row:
    """A flushed session, then Redis restarted empty (really down: a PING fails in between), then a turn and a
    flush: another store must resume the whole session (remote only, and a disk tier mirrored to Redis)."""
    import redis

    from hf_attnstore.lab.redis_server import RedisServer

    row = Row("Redis restarted empty: flushed sessions written again (remote only; disk + mirror)")
    restarts = checked = 0
    for run in range(runs):
        root = Path(tempfile.mkdtemp(prefix="faults-durable-"))
        server = RedisServer(root / "redis").start()
        try:
            row.runs += 1
            mirror = bool(run % 2)
            local = (lambda name: {"disk_dir": str(root / name)}) if mirror else (lambda name: {})
            n, extra = rng.randint(20, 100), rng.randint(4, 40)
            ids = [run * 10_000 + i for i in range(n + extra)]
            a = AttnStore(host_bytes="64MiB", remote=server.url, chunk_tokens=4, **local("a"), **FAST)
            _append(a, "s", ids[:n], seed=run)
            a.flush()
            server.stop()
            try:
                redis.Redis(unix_socket_path=str(server.socket), socket_timeout=1).ping()
                row.notes.append("Redis was not down")
                row.crashes += 1
            except (redis.RedisError, OSError):
                pass
            server.start()
            _append(a, "s", ids[n:], seed=run, base=a.lookup("s", FP))
            a.flush()
            with AttnStore(host_bytes="64MiB", remote=server.url, chunk_tokens=4, **local("b"), **FAST) as b:
                got, wrong = _served(b, "s", seed=run)
                row.wrong += wrong
                checked += len(got)
                if got != ids:
                    row.lost += 1
                    row.notes.append(f"{'mirror' if mirror else 'remote only'}: another store resumed {len(got)} "
                                     f"of {len(ids)} flushed tokens")
            restarts += a.stats().remote_restarts
            a.close()
        except Exception as exc:
            row.crash(exc)
        finally:
            server.stop()
            shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{restarts} restarts noticed; {checked} flushed tokens resumed by another store")
    if not restarts or not checked:
        row.zero_work("no restart noticed or nothing resumed")
    return row
