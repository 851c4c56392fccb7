"""Reliability scorecard: every fault we know of, run many times, counting wrong KV, crashes and data lost.

    python eval/faults.py                  # the full scorecard (a few minutes on 2 cores)
    python eval/faults.py --quick          # fewer runs (the test suite runs this)
    python eval/faults.py --only kill,soak --json out.json

*Wrong KV*: a resumed forward whose logits differ from recomputing the whole prompt (tiny random Llama,
fp32, weights scaled up so that any mix-up shows) by more than a tolerance measured at the start (`tolerance`:
between the largest difference of correct resumes and the smallest of resumes over a history one token off),
or synthetic KV that is not exactly what was written (its values encode session, layer and position).
*Crash*: an exception other than the documented ones (a miss is never an exception; bad arguments are
`ValueError`/`TypeError`; a second opener is `DiskLockedError`; `flush` raises `StoreIOError` for writes it
could not make durable), a child process that died by itself, or a row that did no work. *Data lost*: a session
acknowledged as durable (a `flush()` that returned) that a reopened store does not serve in full, or a resume
that reused less than the store holds where nothing was damaged.

Every row states the work it did (tokens acknowledged and reused, damages applied, kills that landed, failed
writes...) and fails when that work is zero: a row that exercised nothing passes nothing.
"""

from __future__ import annotations

import argparse
import errno
import json
import multiprocessing.util
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.store import StoreIOError, StoreStats
from hf_attnstore.store.tiers import disk as disk_module
from hf_attnstore.store.tiers.disk import DiskLockedError
from hf_attnstore.cache.upstream import cache_kwargs

VOCAB = 128
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
def separation(model, histories: list[torch.Tensor], cuts=(8, 64, 200)) -> tuple[float, float]:
    """(largest |Δlogit| of a correct resume, smallest of a resume over a history one token off) over
    `histories` cut at `cuts`: the prompt's last token is computed over a cache of the rest, and compared with
    recomputing the whole prompt. A correct resume differs by fp32 rounding only; one changed token moves the
    logits by what the model makes of it, the subtlest mix-up there is."""
    correct, wrong = 0.0, float("inf")
    for i, ids in enumerate(histories):
        for n in cuts:
            if ids.shape[1] <= n:
                continue
            want = model(ids[:, : n + 1], **cache_kwargs(DynamicCache())).logits[0, -1]
            for history, is_wrong in ((ids[:, :n], False), (_one_token_off(ids[:, :n], i), True)):
                cache = DynamicCache()
                model(history, **cache_kwargs(cache), use_cache=True)
                diff = float((model(ids[:, n : n + 1], **cache_kwargs(cache)).logits[0, -1] - want).abs().max())
                correct, wrong = (correct, min(wrong, diff)) if is_wrong else (max(correct, diff), wrong)
    return correct, wrong


def _one_token_off(ids: torch.Tensor, seed: int) -> torch.Tensor:
    other = ids.clone()
    pos = int(torch.randint(0, ids.shape[1], (1,), generator=torch.Generator().manual_seed(seed)))
    other[0, pos] = 3 + (int(other[0, pos]) - 3 + 1) % (VOCAB - 3)
    return other


_TOLERANCES: dict[int, tuple] = {}


def tolerance(model, histories: list[torch.Tensor] | None = None, cuts=(8, 64, 200)) -> float:
    """The |Δlogit| above which a resume is wrong KV for `model`: the geometric mean of the separation's two
    sides, measured at the model's first use (over `histories`, by default four random ones), which must be at
    least 100x apart so each side has a 10x margin."""
    if id(model) not in _TOLERANCES:
        histories = histories if histories is not None else [sequence(900 + i, 240) for i in range(4)]
        correct, wrong = separation(model, histories, cuts)
        correct = max(correct, torch.finfo(torch.float32).eps)  # a bit-identical resume: fp32's own step
        assert wrong > 100 * correct, f"correct resumes ({correct:.1e}) and wrong ones ({wrong:.1e}) overlap"
        tol = (correct * wrong) ** 0.5
        _TOLERANCES[id(model)] = (model, tol)
        print(f"[tolerance] correct resumes differ by <= {correct:.1e}, a history one token off by >= {wrong:.1e}: "
              f"wrong KV above {tol:.1e}", file=sys.stderr)
    return _TOLERANCES[id(model)][1]


@torch.no_grad()
def resume_is_wrong(model, store, sid: str, ids: torch.Tensor) -> tuple[int, bool]:
    """(reused tokens, whether the resumed logits differ from recomputation) for prompt `ids`."""
    cache = AttnStoreCache(model, store, sid, ids, save=False)
    got = model(cache.input_ids[:, cache.reused_tokens:], **cache_kwargs(cache)).logits[0, -1]
    want = model(ids, **cache_kwargs(DynamicCache())).logits[0, -1]
    return cache.reused_tokens, bool((got - want).abs().max() > tolerance(model))


class Row:
    """One scorecard row: runs and what went wrong, the resumes it checked, and notes stating its work."""

    def __init__(self, scenario: str):
        self.scenario, self.runs, self.wrong, self.crashes, self.lost, self.notes = scenario, 0, 0, 0, 0, []
        self.resumed = self.reused = 0  # resumes checked by check_sessions, and the tokens they reused

    def crash(self, exc: BaseException) -> None:
        self.crashes += 1
        self.notes.append(f"crash: {type(exc).__name__}: {exc}")

    def zero_work(self, what: str) -> None:
        """A row whose work was zero fails: it exercised nothing, so its zeros say nothing."""
        self.crashes += 1
        self.notes.append(f"did no work: {what}")

    def as_dict(self) -> dict:
        return {"scenario": self.scenario, "runs": self.runs, "wrong_kv": self.wrong, "crashes": self.crashes,
                "data_lost": self.lost, "notes": "; ".join(dict.fromkeys(self.notes))}


def check_sessions(model, store, expected: dict[str, torch.Tensor], row: Row, must_serve: dict[str, int] | None = None,
                   may_miss=()) -> dict[str, int]:
    """Resumes every expected session one token past what the store holds; counts wrong KV and lost data, and
    returns the tokens each resume reused.

    `must_serve`: tokens a session must be served (acknowledged by a `flush()`, or written before a reopen).
    Every session not in `may_miss` (those a row damaged) must also be served all the store says it holds: a
    store that serves nothing after a reopen, or less than it holds, loses data."""
    reused_by = {}
    for sid, ids in expected.items():
        stored = store.token_ids(sid, AttnStoreCache.fingerprint_of(model, store))
        n = 0 if stored is None else stored.numel()
        need = (must_serve or {}).get(sid, 0)
        reused, wrong = resume_is_wrong(model, store, sid, ids[:, : max(n, 1) + 1])
        row.resumed += 1
        row.reused += reused
        row.wrong += wrong
        reused_by[sid] = reused
        required = need if sid in may_miss else max(n, need)
        if n < need or reused < required:
            row.lost += 1
            row.notes.append(f"{sid}: served {reused} tokens, holds {n}, {need} required")
    return reused_by


# -- damaged, swapped, foreign and stray files -------------------------------------------------------------
def _session_dirs(root: Path) -> list[Path]:
    return sorted(p for p in (root / "sessions").iterdir() if p.is_dir())


def _damage(kind: str, root: Path, foreign: Path, rng: random.Random) -> set[str] | None:
    """Applies one damage of `kind` to a copy of the store's folder; returns the session folders it touched
    (empty for stray entries, which touch none), or ``None`` when there was nothing to damage that way."""
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
    elif kind == "swap within session":
        if len(chunks) < 2:
            return None
        a, b = rng.sample(chunks, 2)
        tmp = a.with_suffix(".x")
        a.rename(tmp), b.rename(a), tmp.rename(b)
    elif kind == "swap across sessions":
        other = rng.choice([f for f in folders if f != folder])
        target = rng.choice(sorted(other.glob("*.safetensors")))
        shutil.copy(chunk, target)
        return {other.name}
    elif kind == "foreign (same session, other history)":
        twin = foreign / "sessions" / folder.name
        candidates = sorted(twin.glob("*.safetensors")) if twin.exists() else []
        if not candidates:
            return None
        src = rng.choice(candidates)
        shutil.copy(src, folder / src.name)
    elif kind == "stale manifest (rollback)":
        twin = foreign / "sessions" / folder.name
        if not (twin / "manifest.json").exists():
            return None
        shutil.copy(twin / "manifest.json", folder / "manifest.json")
    elif kind == "stray entries":
        (folder / ".tmp-dir").mkdir(exist_ok=True)
        (folder / f"{rng.randrange(10**8):08d}.safetensors").mkdir(exist_ok=True)
        (root / "sessions" / "stray-file").write_bytes(b"x")
        (root / "sessions" / "stray-dir").mkdir(exist_ok=True)
        return set()
    elif kind == "delete chunk":
        chunk.unlink()
    return {folder.name}


CORRUPTIONS = ["cut", "flip", "flip manifest", "swap within session", "swap across sessions",
               "foreign (same session, other history)", "stale manifest (rollback)", "stray entries", "delete chunk"]
WRITTEN = 50  # tokens of each session in the damaged folders (three turns: several chunks, one partial)


def _write_sessions(model, root: Path, variant: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Five sessions; `variant` 1 gives the same session ids other histories (a foreign store). Returns their ids
    and the session each folder holds."""
    from hf_attnstore.store.format import session_dirname

    expected = {}
    with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
        for k in range(5):
            ids = sequence(k + 50 * variant)
            for n in (20, 36, WRITTEN):
                turn(model, store, f"s{k}", ids[:, :n])
            expected[f"s{k}"] = ids
        fp = AttnStoreCache.fingerprint_of(model, store)
    return expected, {session_dirname(fp, sid): sid for sid in expected}


def outcome(reused: int, whole: int) -> str:
    """What a damaged session's resume got: nothing, a verified prefix, or all of it."""
    return "missed" if not reused else "served whole" if reused >= whole else "served a prefix"


def scenario_corruption(model, runs: int, rng: random.Random) -> list[Row]:
    """Each damage on a fresh copy of a closed store's folder. The damaged session may be a clean miss or a
    verified prefix, never wrong; every other session must be served whole (50 tokens)."""
    base, foreign = Path(tempfile.mkdtemp(prefix="faults-base-")), Path(tempfile.mkdtemp(prefix="faults-foreign-"))
    expected, sid_of = _write_sessions(model, base, 0)
    _write_sessions(model, foreign, 1)
    rows = []
    for kind in CORRUPTIONS:
        row, applied, hit = Row(f"corruption: {kind}"), 0, {"missed": 0, "served a prefix": 0, "served whole": 0}
        for _ in range(runs):
            root = Path(tempfile.mkdtemp(prefix="faults-corrupt-"))
            shutil.copytree(base, root, dirs_exist_ok=True)
            (root / "LOCK").unlink(missing_ok=True)
            row.runs += 1
            try:
                damaged = _damage(kind, root, foreign, rng)
                applied += damaged is not None
                damaged = {sid_of[name] for name in damaged or ()}
                with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
                    reused = check_sessions(model, store, expected, row, {sid: WRITTEN for sid in expected
                                                                         if sid not in damaged}, may_miss=damaged)
                for sid in damaged:
                    hit[outcome(reused[sid], WRITTEN)] += 1
            except Exception as exc:
                row.crash(exc)
            shutil.rmtree(root, ignore_errors=True)
        row.notes.append(f"{applied} damages applied; damaged sessions: " +
                         ", ".join(f"{n} {what}" for what, n in hit.items()) +
                         f"; {row.reused:,} tokens reused by {row.resumed} resumes")
        if not applied or not row.reused:
            row.zero_work("no damage applied or nothing reused")
        rows.append(row)
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(foreign, ignore_errors=True)
    return rows


# -- two openers -------------------------------------------------------------------------------------------
def scenario_two_openers(runs: int) -> Row:
    row, refused, reopened = Row("two openers (same process, other process)"), [0, 0], 0
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
                    refused[0] += 1
                code = ("import sys; from hf_attnstore import AttnStore; from hf_attnstore.store.tiers.disk import "
                        f"DiskLockedError\ntry:\n AttnStore(disk_dir={root!r})\nexcept DiskLockedError: sys.exit(3)")
                if subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 3:
                    row.notes.append("a second opener in another process was not refused")
                    row.crashes += 1
                else:
                    refused[1] += 1
            AttnStore(disk_dir=root, **FAST).close()  # free again once the first closed
            reopened += 1
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{refused[0]} second openers refused in this process, {refused[1]} in another; {reopened} "
                     "folders opened again after the first store closed")
    if not all(refused) or not reopened:
        row.zero_work("no opener refused or no folder opened again")
    return row


# -- hostile ids -------------------------------------------------------------------------------------------
HOSTILE_OK = ["../x", "/etc/passwd", "a\0b", "..", "é" * 2048, "🙂\n\t", "\0", " ", "con", "x" * 4096]
HOSTILE_BAD = ["\ud800", "x" * 4097, "", None, 123, b"s", ["s"]]


def scenario_hostile_ids(model) -> Row:
    row = Row("hostile session ids (10 kept, 7 refused)")
    root, refused = tempfile.mkdtemp(prefix="faults-ids-"), 0
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
                    refused += 1
        with AttnStore(host_bytes="64MiB", disk_dir=root, **FAST) as store:
            row.runs += len(HOSTILE_OK)
            row.lost += len(set(HOSTILE_OK) - set(store.sessions()))
            check_sessions(model, store, {sid: sequence(i)[:, :13] for i, sid in enumerate(HOSTILE_OK)}, row,
                           {sid: 12 for sid in HOSTILE_OK})
        outside = [p for p in Path(root).parent.iterdir() if p.name in ("x", "passwd")]
        row.crashes += len(outside)
    except Exception as exc:
        row.crash(exc)
    shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{refused} ids refused; {row.reused} tokens of the {len(HOSTILE_OK)} kept ids reused after a "
                     "reopen")
    if not refused or not row.reused:
        row.zero_work("no id refused or nothing reused")
    return row


# -- a full disk ---------------------------------------------------------------------------------------
def _mount_tmpfs(path: Path, size: str) -> bool:
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True).returncode == 0
    except OSError:
        return False


def scenario_full_disk(model, turns: int) -> Row:
    """Turns and a flush after each while the disk is full: no turn waits for the disk, flush() says what is not
    durable, every session is served what the store holds; once there is room, one flush() makes all durable."""
    root = Path(tempfile.mkdtemp(prefix="faults-full-"))
    mounted = _mount_tmpfs(root, "256k")
    row = Row("full disk (" + ("a 256 KiB tmpfs" if mounted else "injected ENOSPC") + ", 1 MiB disk_bytes)")
    real, full = disk_module._write_bytes, [not mounted]

    def injected(fd, data):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    disk_module._write_bytes = injected
    times, expected, durable, acked, errors, refused = [], {}, {}, {}, 0, 0
    try:
        with AttnStore(host_bytes=200_000, disk_dir=str(root), disk_bytes="1MiB", **FAST) as store:
            for step in range(turns):
                k = step % 6
                n = 16 + 8 * (step // 6)
                started = time.monotonic()
                turn(model, store, f"s{k}", sequence(k)[:, :n])
                times.append(time.monotonic() - started)
                expected[f"s{k}"] = sequence(k)
                row.runs += 1
                try:
                    store.flush()
                    fp = AttnStoreCache.fingerprint_of(model, store)  # acknowledged: what it holds is durable
                    for sid in store.sessions():
                        acked[sid] = max(acked.get(sid, 0), store.token_ids(sid, fp).numel())
                except StoreIOError:
                    refused += 1  # documented: not durable, said so
            check_sessions(model, store, expected, row, acked)
            errors = store.stats().write_errors
            full[0] = False
            if mounted:
                subprocess.run(["mount", "-o", "remount,size=16m", str(root)], capture_output=True)
            store.flush()  # room again: every pending write is retried and succeeds
            fp = AttnStoreCache.fingerprint_of(model, store)
            durable = {sid: store.token_ids(sid, fp).numel() for sid in store.sessions()}
        with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
            check_sessions(model, store, expected, row,
                           {sid: max(durable.get(sid, 0), acked.get(sid, 0)) for sid in {*durable, *acked}})
    except Exception as exc:
        row.crash(exc)
    finally:
        disk_module._write_bytes = real
        if mounted:
            subprocess.run(["umount", str(root)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    # A turn that waited for the full disk would wait io_timeout_s; one that did not takes what a turn takes, a few
    # ms here, but seconds on a machine busy with other jobs (a tighter bound failed under load). Half of
    # io_timeout_s still tells the two apart.
    times = sorted(times) or [0.0]
    bound = FAST["io_timeout_s"] / 2
    row.notes.append(f"{errors} failed writes, {refused} flushes refused with StoreIOError; slowest turn "
                     f"{times[-1] * 1000:.0f} ms (median {times[len(times) // 2] * 1000:.0f} ms, bound "
                     f"{bound * 1000:.0f} ms); {sum(acked.values()):,} tokens acknowledged while it was full, "
                     f"{sum(durable.values()):,} durable once there was room, "
                     f"{row.reused:,} reused by {row.resumed} resumes")
    if times[-1] > bound:
        row.crashes += 1
        row.notes.append("a turn waited for the disk")
    if not errors or not refused or not sum(durable.values()):
        row.zero_work("the disk never filled (no failed write or no refused flush), or nothing became durable")
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
    peak_host, expected, largest, stats = 0, {}, 0, StoreStats()
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
            stats = store.stats()
            check_sessions(model, store, expected, row)
    except Exception as exc:
        row.crash(exc)
    finally:
        disk_module._write_bytes = real
        shutil.rmtree(root, ignore_errors=True)
    # host_bytes may be exceeded by one session: the disk load a turn waits for starts at once while the
    # sessions it displaces are still being written out (StoreConfig.host_bytes). Anything beyond is a bug.
    row.notes.append(f"peak host {peak_host:,} B of {host_limit:,} + one loading session ({largest:,}) allowed; "
                     f"peak disk files {peak_disk[0]:,} B of {disk_limit:,} (hard); {stats.demotions} demotions, "
                     f"{stats.hits_disk} loads, {stats.disk_drops} sessions evicted from disk; {row.reused:,} tokens "
                     f"reused by {row.resumed} resumes")
    if peak_host > host_limit + largest or peak_disk[0] > disk_limit:
        row.crashes += 1
        row.notes.append("a limit was exceeded")
    if not stats.demotions or not stats.hits_disk or not stats.disk_drops or not row.reused:
        row.zero_work("a limit never reached (no demotion, load or disk eviction) or nothing reused")
    return row


SCENARIOS = ["kill", "corruption", "openers", "ids", "full", "capacity", "threads", "soak", "codec", "sizes", "badids", "remote",
             "shared", "durable"]


def run(only: list[str], quick: bool, seed: int = 0) -> list[dict]:
    """The rows of the scenarios `only`. Every temporary folder they make lies in one folder of the run, removed
    when it ends, also after a failure (a scenario that stops early leaves nothing behind)."""
    # multiprocessing makes its own folder on first use and removes it at exit, after this run's folder is gone:
    # made now, it lies outside this run's folder (in it, its removal at exit failed with FileNotFoundError).
    multiprocessing.util.get_temp_dir()
    previous = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="attnstore-faults-", ignore_cleanup_errors=True) as folder:
        tempfile.tempdir = folder
        try:
            return _run(only, quick, seed)
        finally:
            tempfile.tempdir = previous


def _run(only: list[str], quick: bool, seed: int) -> list[dict]:
    rng, model, rows = random.Random(seed), tiny_model(), []
    torch.set_num_threads(1)  # the store's threads and the model share 2 cores; tiny shapes gain nothing
    for name in only:
        started = time.monotonic()
        if name == "kill":  # eval/faults_kill.py
            from faults_kill import scenario_kill

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
        elif name == "threads":  # eval/faults_stress.py
            from faults_stress import scenario_threads

            rows.append(scenario_threads(15 if quick else 60))
        elif name == "soak":
            from faults_stress import scenario_soak

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
    sys.modules.setdefault("faults", sys.modules[__name__])  # the rows' modules import this one: one copy of it
    main()
