"""The scheduler-aware policy, including the paper's Fig. 9 narrative, in a real store."""

from __future__ import annotations

from hf_attnstore.store.policy import make_policy
from hf_attnstore.store import AttnStore

from .kvdata import BYTES_PER_TOKEN, FP, write_turn

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=16)


def test_victim_order():
    p = make_policy("lookahead")
    for sid in ["a", "b", "c", "d", "e"]:
        p.insert((FP, sid))
    p.set_queue(["c", "a", "x", "d"])  # b and e have no queued job
    assert [k[1] for k in p.victims()] == ["b", "e", "d", "a", "c"]
    p.touch((FP, "b"))
    assert [k[1] for k in p.victims()][:2] == ["e", "b"]  # among idle sessions, least recently used first


def test_fig9_demote_nearest_tail_then_drop_last_arrived(tmp_path):
    tokens = list(range(16))  # every session: one 16-token segment, one chunk file of the same size
    probe = AttnStore(host_bytes="1MiB", disk_dir=str(tmp_path / "probe"), **FAST)
    write_turn(probe, "s0", tokens)
    probe.flush()
    file_bytes = probe.stats().disk_bytes_used
    probe.close()
    # The host holds 4 sessions, the disk 9. Tiers are inclusive: a clean session in host memory also has
    # its copy on disk.
    store = AttnStore(host_bytes=4 * 16 * BYTES_PER_TOKEN, disk_dir=str(tmp_path / "kv"), disk_bytes=9 * file_bytes,
                      policy="lookahead", **FAST)
    jobs = [f"s{i}" for i in range(1, 10)]  # waiting jobs 1..9, one session each; job 1 runs next
    store.set_schedule(jobs)
    for sid in jobs[4:]:
        write_turn(store, sid, tokens)
        store.flush()
        store.evict(sid)
    for sid in jobs[:4]:
        write_turn(store, sid, tokens)
    store.flush()
    assert [store.tier_of(s, FP) for s in jobs] == ["host"] * 4 + ["disk"] * 5
    assert store.stats().disk_sessions == 9  # the disk is full
    # The running job's session s0 (no queued job) arrives. The host holds only sessions with queued jobs:
    # the one nearest the tail of the window, job 4's, is demoted. The disk is full: the session of the
    # last-arrived job, job 9's, is dropped to make room.
    write_turn(store, "s0", tokens)
    store.flush()
    assert [store.tier_of(s, FP) for s in jobs] == ["host"] * 3 + ["disk"] * 5 + [None]
    assert store.tier_of("s0", FP) == "host"
    s = store.stats()
    assert (s.demotions, s.disk_drops) == (6, 1)  # five evict() calls + job 4's demotion
    store.close()
