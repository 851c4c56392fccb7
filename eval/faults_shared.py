"""Scorecard rows for prefix sharing (issue 31), run by eval/faults.py: sessions whose first chunks are one file
on disk (hard links, `Span.owner`), under kill -9 and damage. Counted as eval/faults.py counts: wrong KV,
crashes, data lost."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from faults import FAST, Row, check_sessions, outcome, sequence, turn
from faults_kill import kill_rows
from hf_attnstore import AttnStore

PREFIX = 80  # a shared "system prompt" of 10 chunks of FAST's 8 tokens (past the prefix table's 64-token block)


def shared_sequence(session: int, n: int = 400) -> torch.Tensor:
    """Session `session`'s ids: the shared prefix, then its own tokens."""
    return torch.cat([sequence(999)[:, :PREFIX], sequence(session)[:, : n - PREFIX]], 1)


def scenario_kill_shared(model, runs: int, rng: random.Random) -> Row:
    """kill -9 while five sessions over one shared prefix grow, and are deleted and started again: after
    reopening, every durable session is served whole and exact (no shared chunk went while a manifest named it).
    A host tier of 150 kB or 300 kB holds one or two of the sessions (88 to 168 tokens, 68 to 129 kB)."""
    row, linked = Row("kill -9 with shared prefix chunks (fsync on)"), [0]

    def count_links(root: Path) -> None:
        linked[0] += sum(os.stat(p).st_nlink > 1 for p in root.glob("sessions/*/*.safetensors"))

    work = kill_rows(model, row, runs, rng, True, [(150_000, 400), (300_000, 400)], on_killed=count_links)
    row.notes.append(f"{work}; {linked[0]} chunk files named by several sessions at the kills")
    if not linked[0]:
        row.zero_work("no chunk file named by several sessions")
    return row


def scenario_damaged_shared(model, runs: int, rng: random.Random) -> Row:
    """One byte of a chunk file that several sessions name (a shared prefix's) flipped: every session that
    names it is a clean miss or exact, never wrong; the others (a sixth session of its own among them) are served
    whole."""
    from hf_attnstore import AttnStoreCache
    from hf_attnstore.store.format import session_dirname

    row, users = Row("corruption: a shared chunk flipped"), 0
    hit = {"missed": 0, "served a prefix": 0, "served whole": 0}
    base, written = Path(tempfile.mkdtemp(prefix="faults-shared-base-")), PREFIX + 36
    expected = {**{f"s{k}": shared_sequence(k) for k in range(5)}, "own": sequence(77)}
    with AttnStore(host_bytes="64MiB", disk_dir=str(base), **FAST) as store:
        for sid, ids in expected.items():
            for n in (PREFIX + 20, written):
                turn(model, store, sid, ids[:, :n])
            store.flush()  # on disk before the next session is saved: it links these chunks
        sid_of = {session_dirname(AttnStoreCache.fingerprint_of(model, store), sid): sid for sid in expected}
    for _ in range(runs):
        root = Path(tempfile.mkdtemp(prefix="faults-shared-corrupt-"))
        shutil.copytree(base, root, dirs_exist_ok=True)
        (root / "LOCK").unlink(missing_ok=True)
        _relink(base, root)
        shared = sorted(p for p in root.glob("sessions/*/*.safetensors") if os.stat(p).st_nlink > 1)
        row.runs += 1
        try:
            chunk = rng.choice(shared)
            named = {sid_of[p.parent.name] for p in root.glob("sessions/*/*.safetensors") if p.samefile(chunk)}
            users += len(named)
            data = bytearray(chunk.read_bytes())
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
            with open(chunk, "r+b") as f:  # in place: every name of the file sees the damage
                f.write(data)
            with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
                reused = check_sessions(model, store, expected, row, {sid: written for sid in expected
                                                                     if sid not in named}, may_miss=named)
            for sid in named:
                hit[outcome(reused[sid], written)] += 1
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    row.notes.append(f"each flipped file was named by {users / max(row.runs, 1):.1f} sessions on average; they were "
                     + ", ".join(f"{n} {what}" for what, n in hit.items())
                     + f"; {row.reused:,} tokens reused by {row.resumed} resumes")
    if users < 2 * row.runs or not row.reused:
        row.zero_work("a flipped file named by fewer than two sessions, or nothing reused")
    return row


def _relink(base: Path, root: Path) -> None:
    """Makes the copy's files share inodes as the original's do (copytree copies each name as its own file)."""
    first: dict[tuple, Path] = {}
    for src in sorted(base.glob("sessions/*/*.safetensors")):
        st = os.stat(src)
        dst = root / src.relative_to(base)
        if st.st_nlink > 1:
            ino = (st.st_dev, st.st_ino)
            if ino in first:
                dst.unlink()
                os.link(first[ino], dst)
            else:
                first[ino] = dst
