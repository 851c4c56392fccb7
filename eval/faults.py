"""Reliability scorecard: every fault we know of, run many times, counting wrong KV, crashes and data lost.

    python eval/faults.py                  # the full scorecard (a few minutes on 2 cores)
    python eval/faults.py --quick          # fewer runs (the test suite runs this)
    python eval/faults.py --only kill,soak --json out.json

*Wrong KV*: a resumed forward whose logits differ from recomputing the whole prompt (tiny random Llama,
fp32, weights scaled up so that any mix-up shows; tolerance 1e-3), or synthetic KV that is not exactly what
was written. *Crash*: an exception other than the documented ones (a miss is never an exception; bad
arguments are `ValueError`/`TypeError`; a second opener is `DiskLockedError`; `flush` raises
`StoreIOError` for writes it could not make durable). *Data lost*: a session acknowledged as durable (a
`flush()` that returned) that a reopened store does not serve in full.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.store import StoreIOError
from hf_attnstore.store import disk as disk_module
from hf_attnstore.store.disk import DiskLockedError
from hf_attnstore.cache.upstream import cache_kwargs

VOCAB, TOL = 128, 1e-3
FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=20, chunk_tokens=8)


def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                      max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def sequence(session: int, n: int = 1024) -> torch.Tensor:
    """The token ids of session `session`: every run and every process derives the same ones."""
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(1000 + session))


@torch.no_grad()
def turn(model, store, sid: str, ids: torch.Tensor) -> None:
    with AttnStoreCache(model, store, sid, ids) as cache:
        model(cache.input_ids[:, cache.reused_tokens:], **cache_kwargs(cache), use_cache=True)


@torch.no_grad()
def resume_is_wrong(model, store, sid: str, ids: torch.Tensor) -> tuple[int, bool]:
    """(reused tokens, whether the resumed logits differ from recomputation) for prompt `ids`."""
    cache = AttnStoreCache(model, store, sid, ids, save=False)
    got = model(cache.input_ids[:, cache.reused_tokens:], **cache_kwargs(cache)).logits[0, -1]
    want = model(ids, **cache_kwargs(DynamicCache())).logits[0, -1]
    return cache.reused_tokens, bool((got - want).abs().max() > TOL)


class Row:
    def __init__(self, scenario: str):
        self.scenario, self.runs, self.wrong, self.crashes, self.lost, self.notes = scenario, 0, 0, 0, 0, []

    def crash(self, exc: BaseException) -> None:
        self.crashes += 1
        self.notes.append(f"crash: {type(exc).__name__}: {exc}")

    def as_dict(self) -> dict:
        return {"scenario": self.scenario, "runs": self.runs, "wrong_kv": self.wrong, "crashes": self.crashes,
                "data_lost": self.lost, "notes": "; ".join(dict.fromkeys(self.notes))}


def check_sessions(model, store, expected: dict[str, torch.Tensor], row: Row, durable: dict[str, int] | None = None):
    """Resumes every expected session one token past what it should hold; counts wrong KV and lost data."""
    for sid, ids in expected.items():
        stored = store.token_ids(sid, AttnStoreCache.fingerprint_of(model, store))
        n = 0 if stored is None else stored.numel()
        if durable is not None and n < durable.get(sid, 0):
            row.lost += 1
            row.notes.append(f"{sid}: {n} of {durable[sid]} durable tokens")
        prompt = ids[:, : max(n, 1) + 1]
        _, wrong = resume_is_wrong(model, store, sid, prompt)
        row.wrong += wrong


# -- kill -9 while saving ---------------------------------------------------------------------------------
CHILD = r"""
import sys, torch
sys.path.insert(0, {eval_dir!r})
from faults import tiny_model, sequence, turn, FAST
from hf_attnstore import AttnStore, AttnStoreCache
model, store = tiny_model(), AttnStore(host_bytes={host}, disk_dir={root!r}, **{{**FAST, "fsync": True}})
lengths = {{}}
for step in range(10_000):
    k = step % 5
    lengths[k] = lengths.get(k, 0) + 8
    turn(model, store, f"s{{k}}", sequence(k)[:, : lengths[k]])
    if step % 3 == 2:
        store.flush()  # acknowledged: what the store holds now is durable (a turn may have been refused)
        fp = AttnStoreCache.fingerprint_of(model, store)
        held = {{k: store.token_ids(f"s{{k}}", fp) for k in lengths}}
        print("durable", " ".join(f"s{{k}}={{t.numel()}}" for k, t in held.items() if t is not None), flush=True)
"""


def scenario_kill(model, runs: int, rng: random.Random) -> Row:
    row, acked = Row("kill -9 during saves (fsync on)"), 0
    for run in range(runs):
        root = Path(tempfile.mkdtemp(prefix="faults-kill-"))
        code = CHILD.format(eval_dir=str(Path(__file__).parent), host=rng.choice([30_000, 200_000]), root=str(root))
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        durable, deadline = {}, time.monotonic() + rng.uniform(3.0, 6.0)  # the child needs ~2 s to start
        reader = threading.Thread(target=lambda: [durable.update(
            {kv.split("=")[0]: int(kv.split("=")[1]) for kv in line.split()[1:]}) for line in proc.stdout])
        reader.start()
        time.sleep(max(0.0, deadline - time.monotonic()))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        reader.join(30)
        row.runs += 1
        acked += sum(durable.values())
        try:
            with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
                snapshot = dict(durable)
                check_sessions(model, store, {f"s{k}": sequence(k) for k in range(5)}, row, snapshot)
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{acked:,} tokens acknowledged durable before the kills, all checked")
    return row


# -- damaged, swapped, foreign and stray files -------------------------------------------------------------
def _session_dirs(root: Path) -> list[Path]:
    return sorted(p for p in (root / "sessions").iterdir() if p.is_dir())


def _damage(kind: str, root: Path, foreign: Path, rng: random.Random) -> None:
    folders = _session_dirs(root)
    folder = rng.choice(folders)
    chunks = sorted(folder.glob("*.safetensors"))
    chunk = rng.choice(chunks)
    data = chunk.read_bytes()
    if kind == "cut":
        chunk.write_bytes(data[: rng.randrange(len(data))])
    elif kind == "flip":
        pos = rng.randrange(len(data))
        chunk.write_bytes(data[:pos] + bytes([data[pos] ^ (1 << rng.randrange(8))]) + data[pos + 1 :])
    elif kind == "flip manifest":
        m = folder / "manifest.json"
        raw = m.read_bytes()
        pos = rng.randrange(len(raw))
        m.write_bytes(raw[:pos] + bytes([raw[pos] ^ (1 << rng.randrange(8))]) + raw[pos + 1 :])
    elif kind == "swap within session" and len(chunks) > 1:
        a, b = rng.sample(chunks, 2)
        tmp = a.with_suffix(".x")
        a.rename(tmp), b.rename(a), tmp.rename(b)
    elif kind == "swap across sessions":
        other = rng.choice([f for f in folders if f != folder])
        target = rng.choice(sorted(other.glob("*.safetensors")))
        shutil.copy(chunk, target)
    elif kind == "foreign (same session, other history)":
        twin = foreign / "sessions" / folder.name
        candidates = sorted(twin.glob("*.safetensors")) if twin.exists() else []
        if candidates:
            src = rng.choice(candidates)
            shutil.copy(src, folder / src.name)
    elif kind == "stale manifest (rollback)":
        twin = foreign / "sessions" / folder.name
        if (twin / "manifest.json").exists():
            shutil.copy(twin / "manifest.json", folder / "manifest.json")
    elif kind == "stray entries":
        (folder / ".tmp-dir").mkdir(exist_ok=True)
        (folder / f"{rng.randrange(10**8):08d}.safetensors").mkdir(exist_ok=True)
        (root / "sessions" / "stray-file").write_bytes(b"x")
        (root / "sessions" / "stray-dir").mkdir(exist_ok=True)
    elif kind == "delete chunk":
        chunk.unlink()


CORRUPTIONS = ["cut", "flip", "flip manifest", "swap within session", "swap across sessions",
               "foreign (same session, other history)", "stale manifest (rollback)", "stray entries", "delete chunk"]


def _write_sessions(model, root: Path, variant: int) -> dict[str, torch.Tensor]:
    """Five sessions; `variant` 1 gives the same session ids other histories (a foreign store)."""
    expected = {}
    with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
        for k in range(5):
            ids = sequence(k + 50 * variant)
            for n in (20, 36, 50):  # three turns: several chunks, one partial
                turn(model, store, f"s{k}", ids[:, :n])
            expected[f"s{k}"] = ids
    return expected


def scenario_corruption(model, runs: int, rng: random.Random) -> list[Row]:
    base, foreign = Path(tempfile.mkdtemp(prefix="faults-base-")), Path(tempfile.mkdtemp(prefix="faults-foreign-"))
    expected = _write_sessions(model, base, 0)
    _write_sessions(model, foreign, 1)
    rows = []
    for kind in CORRUPTIONS:
        row = Row(f"corruption: {kind}")
        for _ in range(runs):
            root = Path(tempfile.mkdtemp(prefix="faults-corrupt-"))
            shutil.copytree(base, root, dirs_exist_ok=True)
            (root / "LOCK").unlink(missing_ok=True)
            row.runs += 1
            try:
                _damage(kind, root, foreign, rng)
                with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
                    check_sessions(model, store, expected, row)
            except Exception as exc:
                row.crash(exc)
            shutil.rmtree(root, ignore_errors=True)
        rows.append(row)
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(foreign, ignore_errors=True)
    return rows


# -- two openers -------------------------------------------------------------------------------------------
def scenario_two_openers(runs: int) -> Row:
    row = Row("two openers (same process, other process)")
    for _ in range(runs):
        root = tempfile.mkdtemp(prefix="faults-lock-")
        row.runs += 1
        try:
            with AttnStore(disk_dir=root, **FAST):
                try:
                    AttnStore(disk_dir=root, **FAST)
                    row.notes.append("a second opener in this process was not refused")
                    row.crashes += 1
                except DiskLockedError:
                    pass
                code = ("import sys; from hf_attnstore import AttnStore; from hf_attnstore.store.disk import "
                        f"DiskLockedError\ntry:\n AttnStore(disk_dir={root!r})\nexcept DiskLockedError: sys.exit(3)")
                if subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 3:
                    row.notes.append("a second opener in another process was not refused")
                    row.crashes += 1
            AttnStore(disk_dir=root, **FAST).close()  # free again once the first closed
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    return row


# -- hostile ids -------------------------------------------------------------------------------------------
HOSTILE_OK = ["../x", "/etc/passwd", "a\0b", "..", "é" * 2048, "🙂\n\t", "\0", " ", "con", "x" * 4096]
HOSTILE_BAD = ["\ud800", "x" * 4097, "", None, 123, b"s", ["s"]]


def scenario_hostile_ids(model) -> Row:
    row = Row("hostile session ids (10 kept, 7 refused)")
    root = tempfile.mkdtemp(prefix="faults-ids-")
    try:
        with AttnStore(host_bytes="64MiB", disk_dir=root, **FAST) as store:
            for i, sid in enumerate(HOSTILE_OK):
                turn(model, store, sid, sequence(i)[:, :12])
            for bad in HOSTILE_BAD:
                row.runs += 1
                try:
                    turn(model, store, bad, sequence(0)[:, :12])
                    row.notes.append(f"{bad!r:.20} was accepted")
                    row.crashes += 1
                except (TypeError, ValueError):
                    pass
        with AttnStore(host_bytes="64MiB", disk_dir=root, **FAST) as store:
            row.runs += len(HOSTILE_OK)
            row.lost += len(set(HOSTILE_OK) - set(store.sessions()))
            check_sessions(model, store, {sid: sequence(i)[:, :13] for i, sid in enumerate(HOSTILE_OK)}, row)
        outside = [p for p in Path(root).parent.iterdir() if p.name in ("x", "passwd")]
        row.crashes += len(outside)
    except Exception as exc:
        row.crash(exc)
    shutil.rmtree(root, ignore_errors=True)
    return row


# -- a full disk ---------------------------------------------------------------------------------------
def _mount_tmpfs(path: Path, size: str) -> bool:
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True).returncode == 0
    except OSError:
        return False


def scenario_full_disk(model, turns: int) -> Row:
    root = Path(tempfile.mkdtemp(prefix="faults-full-"))
    mounted = _mount_tmpfs(root, "256k")
    row = Row("full disk (" + ("a 256 KiB tmpfs" if mounted else "injected ENOSPC") + ", 1 MiB disk_bytes)")
    real, full = disk_module._write_bytes, [not mounted]

    def injected(fd, data):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    disk_module._write_bytes = injected
    worst, expected, durable, errors = 0.0, {}, {}, 0
    try:
        with AttnStore(host_bytes=200_000, disk_dir=str(root), disk_bytes="1MiB", **FAST) as store:
            for step in range(turns):
                k = step % 6
                n = 16 + 8 * (step // 6)
                started = time.monotonic()
                turn(model, store, f"s{k}", sequence(k)[:, :n])
                worst = max(worst, time.monotonic() - started)
                expected[f"s{k}"] = sequence(k)
                row.runs += 1
                try:
                    store.flush()
                except StoreIOError:
                    pass  # documented: not durable, said so
            check_sessions(model, store, expected, row)
            errors = store.stats().write_errors
            full[0] = False
            if mounted:
                subprocess.run(["mount", "-o", "remount,size=16m", str(root)], capture_output=True)
            store.flush()  # room again: every pending write is retried and succeeds
            durable = {sid: store.token_ids(sid, AttnStoreCache.fingerprint_of(model, store)).numel() for sid in store.sessions()}
        with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
            check_sessions(model, store, expected, row, durable)
    except Exception as exc:
        row.crash(exc)
    finally:
        disk_module._write_bytes = real
        if mounted:
            subprocess.run(["umount", str(root)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{errors} failed writes, slowest turn {worst * 1000:.0f} ms, all durable after room came back")
    return row


# -- capacity: measured bytes against each limit ----------------------------------------------------------------
def _du(root: Path) -> int:
    """Bytes of the files under `root` in 4 KiB blocks, measured from the writer thread while the save thread
    may be deleting: a file gone between listing and stat counts nothing."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            if name == "LOCK":
                continue
            try:
                total += -(-os.stat(os.path.join(folder, name)).st_size // 4096) * 4096
            except FileNotFoundError:
                continue
    return total


def scenario_capacity(model, turns: int) -> Row:
    root = Path(tempfile.mkdtemp(prefix="faults-cap-"))
    host_limit, disk_limit = 120_000, 600_000
    row = Row(f"capacity (host {host_limit // 1000} kB, disk {disk_limit // 1000} kB)")
    peak_disk, real = [0], disk_module._write_bytes

    def measured(fd, data):
        real(fd, data)
        peak_disk[0] = max(peak_disk[0], _du(root))

    disk_module._write_bytes = measured
    peak_host, expected, largest = 0, {}, 0
    try:
        with AttnStore(host_bytes=host_limit, disk_dir=str(root), disk_bytes=disk_limit, **FAST) as store:
            for step in range(turns):
                k = step % 9
                n = 16 + 16 * (step // 9)
                turn(model, store, f"s{k}", sequence(k)[:, :n])
                expected[f"s{k}"] = sequence(k)
                peak_host = max(peak_host, store.stats().host_bytes_used)
                with store._index.lock:  # the largest session in host memory (the documented bound's one exception)
                    largest = max([largest] + [e.host_accounted for e in store._index.entries.values()])
                row.runs += 1
            store.flush()
            check_sessions(model, store, expected, row)
    except Exception as exc:
        row.crash(exc)
    finally:
        disk_module._write_bytes = real
        shutil.rmtree(root, ignore_errors=True)
    # host_bytes may be exceeded by one session: the disk load a turn waits for starts at once while the
    # sessions it displaces are still being written out (StoreConfig.host_bytes). Anything beyond is a bug.
    row.notes.append(f"peak host {peak_host:,} B of {host_limit:,} + one loading session ({largest:,}) allowed; "
                     f"peak disk files {peak_disk[0]:,} B of {disk_limit:,} (hard)")
    if peak_host > host_limit + largest or peak_disk[0] > disk_limit:
        row.crashes += 1
        row.notes.append("a limit was exceeded")
    return row


# -- 16 threads ----------------------------------------------------------------------------------------------
def _synthetic(ids: list[int], session: int):
    t = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    keys = [(t + 1000 * layer + 100_000 * session).expand(1, 2, len(ids), 4).contiguous() for layer in range(3)]
    return keys, [k + 0.5 for k in keys]


def scenario_threads(turns_per_thread: int, threads: int = 16) -> Row:
    root = tempfile.mkdtemp(prefix="faults-threads-")
    row = Row(f"{threads} threads (turns, evict, prefetch, delete)")
    fp = "f" * 64
    errors, lock = [], threading.Lock()
    store = AttnStore(host_bytes=60_000, disk_dir=root, **{**FAST, "chunk_tokens": 4})

    def check(snap, session):
        ids = snap.token_ids.tolist()
        keys, values = _synthetic(ids, session)
        for layer in range(3):
            parts = snap.layer_parts(layer)
            k, v = torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)
            if not (torch.equal(k, keys[layer]) and torch.equal(v, values[layer])):
                return True
        return False

    def worker(t: int):
        rng = random.Random(t)
        for step in range(turns_per_thread):
            sid = f"t{t}-{rng.randrange(3)}"
            session = int(sid[1:].split("-")[0]) * 10 + int(sid[-1])
            try:
                op = rng.random()
                if op < 0.1:
                    store.evict(sid)
                elif op < 0.15:
                    store.delete(sid)
                elif op < 0.2:
                    store.prefetch([f"t{rng.randrange(threads)}-{rng.randrange(3)}"], fp)
                else:
                    snap = store.lookup(sid, fp)
                    wrong = False
                    if snap is not None:
                        try:
                            wrong = check(snap, session)
                        except Exception as exc:  # a documented miss: the load failed or was removed
                            if type(exc).__name__ != "LoadError":
                                raise
                            snap = None
                    start = snap.length if snap is not None else 0
                    ids = list(range(start, start + rng.randrange(1, 6)))
                    keep = torch.arange(start)
                    with store.open_turn(sid, fp, snap, keep) as writer:
                        writer.append(torch.tensor(ids), *_synthetic(ids, session))
                    with lock:
                        row.runs += 1
                        row.wrong += wrong
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
    try:
        store.close()
        with AttnStore(host_bytes="64MiB", disk_dir=root, **FAST) as reopened:
            for sid in reopened.sessions():
                session = int(sid[1:].split("-")[0]) * 10 + int(sid[-1])
                row.wrong += check(reopened.lookup(sid, fp), session)
    except Exception as exc:
        row.crash(exc)
    shutil.rmtree(root, ignore_errors=True)
    return row


# -- soak --------------------------------------------------------------------------------------------------
def _rss_fds_threads() -> tuple[int, int, int]:
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss, len(os.listdir("/proc/self/fd")), threading.active_count()


def scenario_soak(model, turns: int) -> Row:
    root = tempfile.mkdtemp(prefix="faults-soak-")
    row = Row(f"soak: {turns} turns, 12 sessions, host tier for 3")
    lengths, first = {}, None
    try:
        with AttnStore(host_bytes=100_000, disk_dir=root, **FAST) as store:
            for step in range(turns):
                k = step % 12
                lengths[k] = lengths.get(k, 0) + 8
                if lengths[k] > 400:
                    lengths[k] = 8
                    store.delete(f"s{k}")
                turn(model, store, f"s{k}", sequence(k)[:, : lengths[k]])
                row.runs += 1
                if step == 50:
                    first = _rss_fds_threads()
            store.flush()
            last = _rss_fds_threads()
            check_sessions(model, store, {f"s{k}": sequence(k) for k in lengths}, row)
        row.notes.append(f"RSS {first[0] / 2**20:.1f} -> {last[0] / 2**20:.1f} MiB, fds {first[1]} -> {last[1]}, "
                         f"threads {first[2]} -> {last[2]} (turn 50 -> {turns})")
    except Exception as exc:
        row.crash(exc)
    shutil.rmtree(root, ignore_errors=True)
    return row


SCENARIOS = ["kill", "corruption", "openers", "ids", "full", "capacity", "threads", "soak", "codec", "sizes", "badids", "remote",
             "shared", "durable"]


def run(only: list[str], quick: bool, seed: int = 0) -> list[dict]:
    rng, model, rows = random.Random(seed), tiny_model(), []
    torch.set_num_threads(1)  # the store's threads and the model share 2 cores; tiny shapes gain nothing
    for name in only:
        started = time.monotonic()
        if name == "kill":
            rows.append(scenario_kill(model, 3 if quick else 20, rng))
        elif name == "corruption":
            rows += scenario_corruption(model, 2 if quick else 20, rng)
        elif name == "openers":
            rows.append(scenario_two_openers(1 if quick else 5))
        elif name == "ids":
            rows.append(scenario_hostile_ids(model))
        elif name == "full":
            rows.append(scenario_full_disk(model, 24 if quick else 120))
        elif name == "capacity":
            rows.append(scenario_capacity(model, 36 if quick else 180))
        elif name == "threads":
            rows.append(scenario_threads(15 if quick else 60))
        elif name == "soak":
            rows.append(scenario_soak(model, 120 if quick else 600))
        elif name == "codec":  # found by adversarial runs (issue 29): eval/faults_found.py
            from faults_found import scenario_codec_labels

            rows.append(scenario_codec_labels(4 if quick else 20, rng))
        elif name == "sizes":
            from faults_found import scenario_huge_sizes

            rows.append(scenario_huge_sizes(2 if quick else 8))
        elif name == "badids":
            from faults_found import scenario_bad_session_ids

            rows.append(scenario_bad_session_ids())
        elif name == "remote":
            from faults_found import scenario_remote_local_copy

            rows.append(scenario_remote_local_copy(4 if quick else 20))
        elif name == "shared":  # prefix sharing (issue 31): eval/faults_shared.py
            from faults_shared import scenario_damaged_shared, scenario_kill_shared

            rows.append(scenario_kill_shared(model, 2 if quick else 10, rng))
            rows.append(scenario_damaged_shared(model, 3 if quick else 20, rng))
        elif name == "durable":  # acknowledged sessions never lost (issue 43): eval/faults_durable.py
            from faults_durable import (scenario_new_history_in_flight, scenario_partial_limit, scenario_redis_restart,
                                        scenario_too_large)

            rows.append(scenario_new_history_in_flight(3 if quick else 20, rng))
            rows.append(scenario_redis_restart(2 if quick else 10, rng))
            rows.append(scenario_too_large(2 if quick else 10, rng))
            rows.append(scenario_partial_limit(1 if quick else 5, rng))
        print(f"[{name}] {time.monotonic() - started:.1f} s", file=sys.stderr)
    return [r.as_dict() for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer runs per scenario")
    parser.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated subset of {SCENARIOS}")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = run([s.strip() for s in args.only.split(",") if s.strip()], args.quick, args.seed)
    print("| scenario | runs | wrong KV | crashes | data lost | notes |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scenario']} | {r['runs']} | {r['wrong_kv']} | {r['crashes']} | {r['data_lost']} | {r['notes']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if any(r["wrong_kv"] or r["crashes"] or r["data_lost"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
