"""The replicas' model on paper (lab/replica_sim.py), exact on tiny traces."""

from __future__ import annotations

import pytest

from hf_attnstore.lab.replica_sim import ReplicaSimConfig, simulate_replicas
from hf_attnstore.lab.simulation import ModelProfile

# 1 MB a token, 1 ms a token of prefill, decoding free: times are easy to write down.
PROFILE = ModelProfile("toy", kv_bytes_per_token=1e6, prefill_s_per_token=1e-3, decode_s_per_step=0.0,
                       context_window=10_000)


def test_round_robin_moves_every_turn_of_a_lone_conversation_and_loads_it_from_the_shared_tier():
    # Turn 1 resumes 150 tokens (100 + 50), turn 2 250; 10 new tokens each.
    trace = [[(100, 50), (10, 40), (10, 10)]]
    rr = simulate_replicas(trace, PROFILE, ReplicaSimConfig(replicas=2, remote_gbps=1.0, host_gbps=10.0))
    assert rr.turns == 3 and rr.moved == 1.0
    assert rr.resumed_ttft_s == pytest.approx([150e6 / 1e9 + 10e-3, 200e6 / 1e9 + 10e-3])
    assert rr.recompute_ttft_s == pytest.approx([160e-3, 210e-3])
    sticky = simulate_replicas(trace, PROFILE, ReplicaSimConfig(replicas=2, remote_gbps=1.0, host_gbps=10.0,
                                                                routing="affinity"))
    assert sticky.moved == 0.0
    assert sticky.resumed_ttft_s == pytest.approx([150e6 / 10e9 + 10e-3, 200e6 / 10e9 + 10e-3])


def test_one_replica_never_moves_a_session():
    trace = [[(50, 50), (10, 10)]] * 20
    for routing in ("round_robin", "affinity"):
        assert simulate_replicas(trace, PROFILE, ReplicaSimConfig(replicas=1, routing=routing)).moved == 0.0


def test_the_shared_tier_becomes_the_bottleneck_of_round_robin_not_of_affinity():
    trace = [[(200, 200)] * 6] * 400
    ttft = {routing: [simulate_replicas(trace, PROFILE, ReplicaSimConfig(replicas=r, remote_gbps=5.0,
                                                                       routing=routing, rate_per_replica=0.5))
                      .mean_ttft() for r in (2, 8, 32)] for routing in ("round_robin", "affinity")}
    assert ttft["round_robin"][0] < ttft["round_robin"][1] < ttft["round_robin"][2]  # link waits grow with R
    assert ttft["affinity"][0] == pytest.approx(ttft["affinity"][2])  # host loads only, whatever R


def test_bad_configurations_say_what_to_change():
    with pytest.raises(ValueError, match="routing"):
        ReplicaSimConfig(routing="random")
    with pytest.raises(ValueError, match="remote_gbps"):
        ReplicaSimConfig(remote_gbps=0)
