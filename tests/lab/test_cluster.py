"""Two tiny replicas behind the real sglang-router (round robin) over one real redis-server: a Responses chain and a
resent chat conversation each reuse at least 90% of the previous prompt whichever replica serves each turn, and
go on doing so after one replica is SIGKILLed (the issue's "done when")."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import sglang_router  # noqa: F401  (the real router, a dev dependency in the lock: missing, the test fails, no stand-in)

from hf_attnstore.lab.cluster import Cluster, ClusterConfig, get_json

SYSTEM = "You answer briefly and politely, in plain words, without lists or code. " * 4


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc.code}: {exc.read()[:2000]!r}") from None


def settled(cluster: Cluster, live: list[int]) -> None:
    """Waits (at most 120 s) until every live replica has written its sessions' last turns to Redis: what a user's
    think time gives a real deployment."""
    deadline = time.monotonic() + 120
    while any(get_json(cluster.replica_urls[i] + "/health")["saves_pending"] for i in live):
        assert time.monotonic() < deadline, "a replica did not write its sessions within 120 s"
        time.sleep(0.1)


def test_chains_and_conversations_continue_on_any_replica_and_after_a_sigkill(model_dir, tmp_path):
    # No disk tier: Redis is the tier below host memory, so "saves_pending == 0" means "in Redis".
    config = ClusterConfig(tmp_path / "cluster", model=str(model_dir), replicas=2, policy="round_robin",
                           serve_args=("--max-tokens", "8", "--max-batch-size", "1"), disk=False)
    with Cluster(config) as cluster:
        assert get_json(cluster.url + "/v1/models")["data"][0]["id"] == str(model_dir)  # discoverable
        name = cluster.served_name
        live = [0, 1]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "why is the sky blue?"}]
        state = {"chain": None, "chain_prompt": None, "chat_prompt": None, "messages": messages}

        def chain_turn(turn: int) -> None:
            body = {"model": name, "input": (SYSTEM if turn == 0 else "") + f"question {turn}: and then?",
                    "max_output_tokens": 8, "temperature": 0}
            if state["chain"] is not None:
                body["previous_response_id"] = state["chain"]
            r = post(cluster.url + "/v1/responses", body)
            cached, prompt = r["usage"]["input_tokens_details"]["cached_tokens"], r["usage"]["input_tokens"]
            if state["chain_prompt"] is not None:
                assert cached >= 0.9 * state["chain_prompt"], (turn, cached, state["chain_prompt"], r["attnstore"])
            state["chain_prompt"], state["chain"] = prompt, r["id"]

        def chat_turn(turn: int) -> None:  # the conversation resent whole (no session named), as chat clients do
            c = post(cluster.url + "/v1/chat/completions", {"model": name, "messages": state["messages"],
                                                            "max_tokens": 8, "temperature": 0})
            cached, prompt = c["usage"]["prompt_tokens_details"]["cached_tokens"], c["usage"]["prompt_tokens"]
            if state["chat_prompt"] is not None:
                assert cached >= 0.9 * state["chat_prompt"], (turn, cached, state["chat_prompt"], c["attnstore"])
            state["chat_prompt"] = prompt
            state["messages"] = state["messages"] + [
                {"role": "assistant", "content": c["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"question {turn}: and then?"}]

        for turn in range(5):
            if turn == 3:
                remote_read = [remote_bytes_read(url) for url in cluster.replica_urls]
                cluster.kill(0)  # SIGKILL: nothing flushed, the router not told
                live = [1]
            # Round robin alternates replicas per request: swapping the order each turn moves each conversation
            # to the other replica every turn (while both live).
            for step in ((chain_turn, chat_turn) if turn % 2 == 0 else (chat_turn, chain_turn)):
                step(turn)
            settled(cluster, live)
        # Both replicas resumed sessions the other wrote (read from Redis; prefetched, so the turns report "host").
        assert all(read > 0 for read in remote_read), remote_read


def remote_bytes_read(url: str) -> float:
    for line in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines():
        if line.startswith('attnstore_store_bytes_total{direction="read",tier="remote"}'):
            return float(line.split()[-1])
    raise AssertionError("no remote read counter in /metrics")
