"""Replicas behind a load balancer: the balancer, and a tiny-model replay with and without the shared tier."""

from __future__ import annotations

import pytest

from hf_attnstore.lab.replay import ReplayConfig, build_trace, same_outputs
from hf_attnstore.lab.replicas import choose_replica, run_replicas
from hf_attnstore.lab.redis_server import RedisServer

from ..conftest import char_tokenizer, make_tiny
from .test_replay import CONVS


def test_the_balancer_is_deterministic_sticky_keeps_a_session_random_spreads_it():
    assert all(choose_replica("sticky", 3, 0, s, 0) == choose_replica("sticky", 3, 0, s, k)
               for s in range(20) for k in range(6))
    assert {choose_replica("sticky", 3, 0, s, 0) for s in range(20)} == {0, 1, 2}
    draws = [choose_replica("random", 2, 7, 1, k) for k in range(40)]
    assert draws == [choose_replica("random", 2, 7, 1, k) for k in range(40)] and set(draws) == {0, 1}
    with pytest.raises(ValueError, match="balancer"):
        choose_replica("round-robin", 2, 0, 0, 0)


def test_a_shared_tier_gives_random_balancing_the_reuse_of_sticky_sessions(tmp_path):
    model, tok = make_tiny("llama"), char_tokenizer()
    cfg = ReplayConfig(conversations=5, max_user_tokens=40, max_reply_tokens=24, context_window=400,
                       arrival_rate=2.0, think_time_s=0.5, host_fraction=0.5, timeout_s=60)
    trace = build_trace(tok, cfg, CONVS)
    sticky = run_replicas(model, tok, trace, cfg, balancer="sticky", progress=False)
    alone = run_replicas(model, tok, trace, cfg, balancer="random", progress=False)
    with RedisServer(tmp_path / "redis") as server:
        shared = run_replicas(model, tok, trace, cfg, balancer="random", remote=server.url, progress=False)
    moved = {(r.session, r.turn) for r in alone.records
             if r.turn > 0 and r.replica != next(x.replica for x in alone.records
                                                  if (x.session, x.turn) == (r.session, r.turn - 1))}
    assert len(moved) >= 3  # turns that landed on the other replica than their session's previous turn

    def reused(run, turns):
        return sum(r.reply.reused_tokens for r in run.records if (r.session, r.turn) in turns)

    # Without a shared tier a moved turn reuses at best an older copy; with it, all that sticky reuses.
    assert reused(alone, moved) < reused(sticky, moved) == reused(shared, moved)
    assert {r.reply.tier for r in shared.records if (r.session, r.turn) in moved} == {"remote"}
    assert shared.stats.hits_remote == len(moved) and shared.stats.remote_errors == 0
    for run in (alone, shared):
        same, compared = same_outputs(sticky, run)
        assert compared >= 10 and same == compared  # the same greedy tokens on every (untruncated) turn
