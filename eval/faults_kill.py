"""kill -9 rows of the scorecard (eval/faults.py): a child process writes sessions with `fsync=True` and says what
each acknowledged `flush()` covered; the parent waits for several acknowledgements, kills the child with SIGKILL at
a random moment while it keeps writing, reopens its folder and resumes every session.

Children are forked from a server that has already imported torch, transformers and the store
(`multiprocessing`'s forkserver): a fresh interpreter needs 2-12 s to import them, so a kill timed from the
start used to land before the first acknowledgement. Now the row waits for acknowledgements, and one that never
comes (60 s) is a crash. So is a child that died by itself (its exit code is not SIGKILL's) or wrote a traceback
(its stderr is kept in a file). A script that runs these rows must start them under `if __name__ == "__main__":`:
each child imports the script again (as multiprocessing does for every start method but fork).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from faults import FAST, Row, check_sessions, sequence

ACK_TIMEOUT_S = 60.0
_CONTEXT = []


def _context():
    """The forkserver context, started once per process with the modules every child needs already imported."""
    if not _CONTEXT:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["faults_kill"])
        # Python 3.11's forkserver imports the preloaded modules before it applies our sys.path: it finds this
        # folder through PYTHONPATH, set while it starts (else every child would import torch itself).
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), saved]))
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def session_of(name: str, shared: bool):
    """The ids of the child's session `name`: `s{k}` over the shared prefix, or `s{k}.{generation}` (its own)."""
    if shared:
        from faults_shared import shared_sequence

        return shared_sequence(int(name[1:]))
    k, generation = map(int, name[1:].split("."))
    return sequence(10 * generation + k)


def _writer(root: str, host: int, cap: int, shared: bool, acks: str, errors: str) -> None:
    """The child: turns on 5 sessions, a `flush()` every third turn, then one line "ack s=n ..." naming what the
    store holds (so what is durable now). A session that reaches `cap` tokens goes on as a new session (its old
    one stays, durable), so the store never stops writing; with `shared`, every eleventh step instead deletes one
    session (after a line "forget s") and starts it again over the shared prefix."""
    os.dup2(os.open(errors, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)  # the parent reads it after the kill
    import torch

    from faults import tiny_model, turn
    from hf_attnstore import AttnStore, AttnStoreCache

    torch.set_num_threads(1)
    out = os.open(acks, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    model = tiny_model()
    store = AttnStore(host_bytes=host, disk_dir=root, **{**FAST, "fsync": True})
    fp = AttnStoreCache.fingerprint_of(model, store)
    start = 0
    if shared:  # every session begins with the shared prefix
        from faults_shared import PREFIX as start
    lengths, generation = {}, [0] * 5

    def name(k):
        return f"s{k}" if shared else f"s{k}.{generation[k]}"

    for step in range(10**7):
        k = step % 5
        if shared and step % 11 == 10 and k in lengths:
            os.write(out, f"forget {name(k)}\n".encode())  # before the deletion: the parent expects it no more
            store.delete(name(k))
            lengths.pop(k)
        if lengths.get(k, start) + 8 > cap:
            generation[k] += 1
            lengths.pop(k)
        lengths[k] = lengths.get(k, start) + 8
        turn(model, store, name(k), session_of(name(k), shared)[:, : lengths[k]])
        if step % 3 == 2:
            store.flush()  # acknowledged: what the store holds now is durable (a turn may have been refused)
            held = {name(j): store.token_ids(name(j), fp) for j in lengths}
            line = " ".join(f"{sid}={ids.numel()}" for sid, ids in held.items() if ids is not None)
            os.write(out, f"ack {line}\n".encode())  # one write: the parent never reads half a line


@dataclass
class Killed:
    """What one kill left: the tokens each session was acknowledged durable with, and how the kill went."""

    durable: dict = field(default_factory=dict)
    acks: int = 0
    landed: bool = False  # SIGKILL reached a live child after the acknowledgements waited for
    growing: bool = False  # ... and its last acknowledgement held more than the one before (still writing)
    problem: str = ""  # a crash: no acknowledgement in time, died by itself, a traceback


def _read_acks(path: Path, killed: Killed) -> list[dict]:
    """Replays the acknowledgement file (whole lines only) into `killed.durable`; returns each ack's holdings."""
    killed.durable, held = {}, []
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        word, *rest = line.split()
        if word == "forget":
            killed.durable.pop(rest[0], None)
        else:
            now = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in rest}
            killed.durable.update(now)
            held.append(now)
    killed.acks = len(held)
    return held


def kill_while_writing(root: Path, rng: random.Random, host: int, cap: int, shared: bool, need: int) -> Killed:
    """Runs a writer child on `root`, waits for `need` acknowledged flushes, then kills it at a random moment
    within two of its flush intervals."""
    killed, work = Killed(), Path(tempfile.mkdtemp(prefix="faults-child-"))
    acks, errors = work / "acks", work / "stderr"
    try:
        proc = _context().Process(target=_writer, args=(str(root), host, cap, shared, str(acks), str(errors)),
                                  daemon=True)
        proc.start()
        try:
            deadline, times = time.monotonic() + ACK_TIMEOUT_S, []
            while proc.is_alive() and time.monotonic() < deadline:
                n = len(_read_acks(acks, killed))
                times += [time.monotonic()] * (n - len(times))
                if n >= need:
                    interval = (times[-1] - times[0]) / max(len(times) - 1, 1)
                    time.sleep(rng.uniform(0.0, 2 * interval))  # anywhere in the write/flush cycle
                    break
                time.sleep(0.01)
        finally:  # the child never outlives its run, whatever happened here
            alive = proc.is_alive()
            if alive:
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
        held = _read_acks(acks, killed)
        stderr = errors.read_text(errors="replace") if errors.exists() else ""
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not alive or proc.exitcode != -signal.SIGKILL:
        killed.problem = f"the child died by itself (exit code {proc.exitcode})"
    elif killed.acks < need:
        killed.problem = f"{killed.acks} of {need} acknowledgements in {ACK_TIMEOUT_S:.0f} s"
    else:
        killed.landed = True
        last, before = held[-1], held[-2] if len(held) > 1 else {}
        killed.growing = any(n > before.get(sid, 0) for sid, n in last.items())
    if "Traceback" in stderr:
        killed.problem = killed.problem or "the child wrote a traceback"
    if killed.problem and stderr.strip():
        killed.problem += ": " + stderr.strip().splitlines()[-1][:200]
    return killed


def check_after_kill(model, root: Path, killed: Killed, row: Row, shared: bool) -> None:
    """Reopens the killed child's folder: every acknowledged session is served at least as acknowledged, and
    every session the folder holds is served whole and exact."""
    from hf_attnstore import AttnStore

    with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
        names = set(killed.durable) | set(store.sessions())
        check_sessions(model, store, {sid: session_of(sid, shared) for sid in sorted(names)}, row,
                       dict(killed.durable))


def kill_rows(model, row: Row, runs: int, rng: random.Random, shared: bool, configs, on_killed=None) -> str:
    """`runs` kills of writer children, each with a (host tier bytes, session cap) drawn from `configs`; returns
    the row's statement of its work, and counts zero work as a failure. `on_killed(root)` looks at the folder
    before it is reopened."""
    acks = landed = growing = acked = 0
    for _ in range(runs):
        root = Path(tempfile.mkdtemp(prefix="faults-kill-"))
        row.runs += 1
        try:
            host, cap = rng.choice(configs)
            killed = kill_while_writing(root, rng, host, cap, shared, rng.randint(2, 12))
            if killed.problem:
                row.crashes += 1
                row.notes.append(f"crash: {killed.problem}")
            acks, landed, growing = acks + killed.acks, landed + killed.landed, growing + killed.growing
            acked += sum(killed.durable.values())
            if on_killed is not None:
                on_killed(root)
            check_after_kill(model, root, killed, row, shared)
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    if not landed or not acked or not row.reused:
        row.zero_work("no kill landed after acknowledgements, nothing acknowledged, or nothing reused")
    return (f"{landed} of {runs} kills landed after {acks} acknowledged flushes, {growing} while sessions were "
            f"growing; {acked:,} tokens acknowledged, {row.reused:,} reused by {row.resumed} resumes after the reopens")


def scenario_kill(model, runs: int, rng: random.Random) -> Row:
    """kill -9 while 5 sessions grow (each going on as a new session at its cap). A host tier of 30 kB holds 38
    tokens of a session, 200 kB 256: demotions, loads and sessions outgrowing the host tier all happen."""
    row = Row("kill -9 during saves (fsync on)")
    configs = [(30_000, 32), (30_000, 56), (200_000, 128), (200_000, 320)]
    row.notes.append(kill_rows(model, row, runs, rng, False, configs))
    return row
