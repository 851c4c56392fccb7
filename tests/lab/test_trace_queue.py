"""The load-driven queue of the trace simulator: FIFO service on G prefill instances, the look-ahead it gives the
policies, and TTFT with the waits."""

from __future__ import annotations

import pytest

from hf_attnstore.lab.simulation import PROFILES
from hf_attnstore.lab.trace_queue import PrefillCluster, no_cache_ttft_s, utilization
from hf_attnstore.lab.trace_report import format_tables, prefill_seconds, request_costs, run_table
from hf_attnstore.lab.trace_sim import TraceSimConfig, simulate_trace
from hf_attnstore.lab.traces import TraceRequest


def at(seconds, *chain):
    return TraceRequest(seconds * 1000.0, 512 * len(chain), 1, tuple(chain))


def one_second(request, host, disk):
    return 1.0


def test_requests_start_in_order_on_the_first_free_instance_and_see_who_arrived_behind_them():
    reqs = [at(0, 1), at(0, 2), at(0.5, 3), at(10, 4)]
    cluster = PrefillCluster(reqs, instances=2, service=lambda r, h, d: 2.0)
    queued = []
    for i in range(len(reqs)):
        queued.append(cluster.start(i))
        cluster.finish(i, 0)
    # 0 and 1 start at once on the two instances; 2 waits for the first to free at 2 s; 3 arrives to idle ones.
    assert cluster.waits_s == [0.0, 0.0, 1.5, 0.0]
    assert queued == [1, 0, 0, 0]  # when 0 started, 1 had arrived behind it (2 came at 0.5 s, after 1 started)
    assert cluster.ttft_s() == [2.0, 2.0, 3.5, 2.0]
    assert no_cache_ttft_s(reqs, 1, lambda r, h, d: 2.0) == [2.0, 4.0, 5.5, 2.0]
    assert utilization(reqs, 2, lambda r, h, d: 2.0) == pytest.approx(8.0 / (2 * 10))


def test_the_cluster_refuses_what_it_cannot_model():
    with pytest.raises(ValueError, match="`instances`=0"):
        PrefillCluster([at(0, 1)], 0, one_second)
    with pytest.raises(ValueError, match="request 1 arrives before request 0"):
        PrefillCluster([at(5, 1), at(1, 2)], 1, one_second)
    cluster = PrefillCluster([at(0, 1), at(0, 2)], 1, one_second)
    with pytest.raises(ValueError, match="request 1 started out of order"):
        cluster.start(1)
    cluster.start(0)
    with pytest.raises(ValueError, match="request 1 finished"):
        cluster.finish(1, 0)


@pytest.mark.parametrize("policy", ["lru-leaf", "slru"])
def test_the_look_ahead_is_what_the_load_queues(policy):
    # Room for two blocks. Request 2 asks again for request 0's blocks; request 1's blocks push them out unless the
    # policy knows request 2 is waiting. On one instance taking a second a request, request 2 (arriving at 0.5 s)
    # waits behind request 1, so the policy sees it; when it arrives late, nothing is queued and it misses.
    busy = [at(0, 1, 2), at(0, 3, 4), at(0.5, 1, 2)]
    quiet = [at(0, 1, 2), at(10, 3, 4), at(20, 1, 2)]
    config = TraceSimConfig(1024, policy)
    assert simulate_trace(busy, config, PrefillCluster(busy, 1, one_second)).host_hits == [0, 0, 1024]
    assert simulate_trace(quiet, config, PrefillCluster(quiet, 1, one_second)).host_hits == [0, 0, 0]
    # The window caps the queue shown: with a cap of one request, the one queued behind request 1 is still seen;
    # a cluster fast enough that request 2 never waits shows nothing.
    capped = TraceSimConfig(1024, policy, window=1)
    assert simulate_trace(busy, capped, PrefillCluster(busy, 1, one_second)).host_hits == [0, 0, 1024]
    assert simulate_trace(busy, config, PrefillCluster(busy, 3, one_second)).host_hits == [0, 0, 0]


def test_hits_shorten_the_queue_and_ttft_counts_the_wait():
    # Four requests for the same two blocks at once, one instance: each hit prefills nothing but still reads its
    # KV, so the waits behind it shrink against no cache.
    reqs = [at(0, 1, 2)] * 4
    profile = PROFILES["llama-70b"]
    service = prefill_seconds(profile)
    cluster = PrefillCluster(reqs, 1, service)
    result = simulate_trace(reqs, TraceSimConfig(1024, "lru-leaf"), cluster)
    assert result.host_hits == [0, 1024, 1024, 1024]
    full = 1024 * profile.prefill_s_per_token
    read = 1024 * profile.kv_bytes_per_token / 25e9
    assert cluster.services_s == pytest.approx([full, read, read, read])
    costs = request_costs(result, profile, cluster=cluster, no_cache=no_cache_ttft_s(reqs, 1, service))
    assert costs["ttft_mean_s"] == pytest.approx((full + (full + read) + (full + 2 * read) + (full + 3 * read)) / 4)
    assert costs["ttft_mean_none_s"] == pytest.approx(full * (1 + 2 + 3 + 4) / 4)
    assert costs["wait_mean_s"] == pytest.approx((0 + full + (full + read) + (full + 2 * read)) / 4)
    assert costs["queued_mean"] == pytest.approx((3 + 2 + 1 + 0) / 4)
    with pytest.raises(ValueError, match="no-cache TTFTs"):
        request_costs(result, profile, cluster=cluster)


def test_the_table_runs_one_model_on_its_cluster():
    reqs = [at(0, 1, 2), at(0, 3, 4), at(0.1, 1, 2)]  # 0.1 s: before request 1's start (request 0's 0.23 s prefill)
    table = run_table(reqs, [1024], ["lru", "lru-leaf"], models=["llama-70b"], instances=1)
    assert table["instances"] == 1 and table["utilization"] > 1
    by = {row["policy"]: row for row in table["results"]}
    assert by["lru-leaf"]["token_hit_rate"] > by["lru"]["token_hit_rate"]  # plain LRU ignores the queue
    assert by["lru-leaf"]["costs"]["llama-70b"]["ttft_mean_s"] < by["lru"]["costs"]["llama-70b"]["ttft_mean_s"]
    text = format_tables(table)
    assert "prefill cluster of 1 LLaMA-70B instances" in text and "queue seen (mean)" in text
    with pytest.raises(ValueError, match="name exactly one model"):
        run_table(reqs, [1024], ["lru"], models=["llama-13b", "llama-70b"], instances=4)
