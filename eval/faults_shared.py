"""Scorecard rows for prefix sharing (issue 31), run by eval/faults.py: sessions whose first chunks are one file
on disk (hard links, `Span.owner`), under kill -9 and damage. Counted as eval/faults.py counts: wrong KV,
crashes, data lost."""

from __future__ import annotations

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

from faults import FAST, Row, check_sessions, sequence, turn
from hf_attnstore import AttnStore

PREFIX = 80  # a shared "system prompt" of 10 chunks of FAST's 8 tokens (past the prefix table's 64-token block)


def shared_sequence(session: int, n: int = 400) -> torch.Tensor:
    """Session `session`'s ids: the shared prefix, then its own tokens."""
    return torch.cat([sequence(999)[:, :PREFIX], sequence(session)[:, : n - PREFIX]], 1)


CHILD = r"""
import sys, torch
sys.path.insert(0, {eval_dir!r})
from faults import tiny_model, turn, FAST
from faults_shared import shared_sequence, PREFIX
from hf_attnstore import AttnStore, AttnStoreCache
model, store = tiny_model(), AttnStore(host_bytes={host}, disk_dir={root!r}, **{{**FAST, "fsync": True}})
lengths = {{}}
for step in range(10_000):
    k = step % 5
    if step % 11 == 10 and k in lengths:  # the session others may share files with goes, and starts again
        print("forget", f"s{{k}}", flush=True)
        store.delete(f"s{{k}}")
        lengths.pop(k)
    lengths[k] = lengths.get(k, PREFIX) + 8
    turn(model, store, f"s{{k}}", shared_sequence(k)[:, : lengths[k]])
    if step % 3 == 2:
        store.flush()
        fp = AttnStoreCache.fingerprint_of(model, store)
        held = {{k: store.token_ids(f"s{{k}}", fp) for k in lengths}}
        print("durable", " ".join(f"s{{k}}={{t.numel()}}" for k, t in held.items() if t is not None), flush=True)
"""


def scenario_kill_shared(model, runs: int, rng: random.Random) -> Row:
    """kill -9 while five sessions over one shared prefix grow, and are deleted and started again: after
    reopening, every durable session is served whole and exact (no shared chunk went while a manifest named it)."""
    row, acked, linked = Row("kill -9 with shared prefix chunks (fsync on)"), 0, 0
    for _ in range(runs):
        root = Path(tempfile.mkdtemp(prefix="faults-shared-kill-"))
        code = CHILD.format(eval_dir=str(Path(__file__).parent), host=rng.choice([30_000, 200_000]), root=str(root))
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        durable = {}

        def read():
            for line in proc.stdout:
                word, *rest = line.split()
                if word == "forget":
                    durable.pop(rest[0], None)
                else:
                    durable.update({kv.split("=")[0]: int(kv.split("=")[1]) for kv in rest})

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(rng.uniform(3.0, 6.0))  # the child needs ~2 s to start
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        reader.join(30)
        row.runs += 1
        acked += sum(durable.values())
        linked += sum(os.stat(p).st_nlink > 1 for p in root.glob("sessions/*/*.safetensors"))
        try:
            with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
                check_sessions(model, store, {f"s{k}": shared_sequence(k) for k in range(5)}, row, dict(durable))
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{acked:,} tokens acknowledged durable before the kills, all checked; {linked} chunk files "
                     "named by several sessions at the kills")
    return row


def scenario_damaged_shared(model, runs: int, rng: random.Random) -> Row:
    """One byte of a chunk file that several sessions name (a shared prefix's) flipped: every session that
    names it is a clean miss or exact, never wrong."""
    row, users = Row("corruption: a shared chunk flipped"), 0
    base = Path(tempfile.mkdtemp(prefix="faults-shared-base-"))
    with AttnStore(host_bytes="64MiB", disk_dir=str(base), **FAST) as store:
        for k in range(5):
            for n in (PREFIX + 20, PREFIX + 36):
                turn(model, store, f"s{k}", shared_sequence(k)[:, :n])
            store.flush()  # on disk before the next session is saved: it links these chunks
    expected = {f"s{k}": shared_sequence(k) for k in range(5)}
    for _ in range(runs):
        root = Path(tempfile.mkdtemp(prefix="faults-shared-corrupt-"))
        shutil.copytree(base, root, dirs_exist_ok=True)
        (root / "LOCK").unlink(missing_ok=True)
        _relink(base, root)
        shared = sorted(p for p in root.glob("sessions/*/*.safetensors") if os.stat(p).st_nlink > 1)
        row.runs += 1
        try:
            chunk = rng.choice(shared)
            users += os.stat(chunk).st_nlink
            data = bytearray(chunk.read_bytes())
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
            with open(chunk, "r+b") as f:  # in place: every name of the file sees the damage
                f.write(data)
            with AttnStore(host_bytes="64MiB", disk_dir=str(root), **FAST) as store:
                check_sessions(model, store, expected, row)
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    row.notes.append(f"each flipped file was named by {users / max(row.runs, 1):.1f} sessions on average")
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
