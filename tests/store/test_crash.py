"""A process killed with SIGKILL during a stream of async saves: after reopening, every session is
bit-identical to a complete saved state, and every acknowledged (flushed) state survived."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hf_attnstore.store import AttnStore

from .kvdata import FP, expect

CHILD = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, {root!r})
    from hf_attnstore.store import AttnStore
    from tests.store.kvdata import FP, kv
    store = AttnStore(host_bytes="64MiB", disk_dir={kvdir!r}, chunk_tokens=8, idle_flush_s=0.01)
    lengths = {{}}
    def say(*words):
        # One write per line: with PYTHONUNBUFFERED, print writes each word apart, and a kill between two of
        # them would leave a torn line.
        sys.stdout.write(" ".join(words) + "\\n")
        sys.stdout.flush()
    for step in range(100000):
        sid = f"s{{step % 5}}"
        n = lengths.get(sid, 0)
        new = list(range(n, n + 1 + step % 7))
        snap = store.lookup(sid, FP)
        writer = store.open_turn(sid, FP, snap, torch.arange(n))
        say("TRY", sid, str(n + len(new)))
        writer.append(torch.tensor(new), *kv(new))
        lengths[sid] = n + len(new)
        if step % 3 == 0:
            store.flush()
            say("ACK", *(f"{{k}}={{v}}" for k, v in lengths.items()))
''')


@pytest.mark.parametrize("kill_after_acks", [3, 10, 25])
def test_sigkill_during_saves(tmp_path, kill_after_acks):
    kvdir = str(tmp_path / "kv")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(root=root, kvdir=kvdir)],
                             stdout=subprocess.PIPE, text=True)
    tried: dict[str, set[int]] = {}
    acked: dict[str, int] = {}
    acks, deadline = 0, time.monotonic() + 120
    try:
        for line in child.stdout:
            word, *rest = line.split()
            if word == "TRY":
                tried.setdefault(rest[0], set()).add(int(rest[1]))
            elif word == "ACK":
                acked = {k: int(v) for k, v in (item.split("=") for item in rest)}
                acks += 1
                if acks >= kill_after_acks:
                    break
            assert time.monotonic() < deadline, "the child made no progress"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    # The child may have gone on after the last ACK we read, and a state it saved then is a state it tried: the
    # TRY line is written whole before the append begins.
    for line in child.stdout:
        word, *rest = line.split() if line.endswith("\n") else ("",)
        if word == "TRY":
            tried.setdefault(rest[0], set()).add(int(rest[1]))
    with AttnStore(host_bytes="64MiB", disk_dir=kvdir) as store:
        for sid, sizes in tried.items():
            snap = store.lookup(sid, FP)
            if snap is None:
                assert sid not in acked, f"{sid} was acknowledged at {acked.get(sid)} tokens but is gone"
                continue
            assert snap.length in sizes, f"{sid}: {snap.length} tokens is not a state that was saved"
            assert snap.length >= acked.get(sid, 0), f"{sid}: lost acknowledged tokens"
            expect(snap, list(range(snap.length)))
    assert not list((tmp_path / "kv").rglob(".tmp-*"))
