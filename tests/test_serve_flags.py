"""Every `attnstore serve` flag in a running server: built from the real argv by `cli.build_server` (what `serve`
runs under uvicorn), over a tiny random Llama saved to a folder, driven through FastAPI's TestClient."""

from __future__ import annotations

import contextlib
import json
import threading

import pytest
import torch
from fastapi.testclient import TestClient

from hf_attnstore import AttnStoreCache
from hf_attnstore.cli import build_parser, build_server, main
from hf_attnstore.store.tiers.redis import RemoteUnavailableError

from .store.kvdata import chunk_metadata

SYSTEM = "You answer briefly and politely, in plain words, without lists or code. " * 5  # > one 256-token chunk


@contextlib.contextmanager
def serving(model_dir, *flags):
    """A server as `attnstore serve --model DIR FLAGS` builds it, and a client of it; closed (flushed) on exit."""
    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--max-tokens", "4", *flags])
    server = build_server(args)
    try:
        with TestClient(server.app) as client:
            client.model_name = server.name  # what `chat` sends as `model` unless told otherwise
            yield client, server
    finally:
        server.close()


def chat(client, messages, status=200, headers=None, **extra):
    body = {"model": extra.pop("model", client.model_name), "messages": messages, "temperature": 0, **extra}
    r = client.post("/v1/chat/completions", json=body, headers=headers or {})
    assert r.status_code == status, r.text
    return r.json()


def conversation(turn: int = 0):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {turn}: why is the sky blue?"}]


def follow_up(messages, reply):
    return messages + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                       {"role": "user", "content": "and at night?"}]


def cached(reply) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_defaults_serve_the_model_under_its_path_with_max_tokens(model_dir):
    with serving(model_dir) as (client, server):
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [str(model_dir)]
        first = chat(client, conversation())
        assert first["usage"]["completion_tokens"] == 4  # --max-tokens 4 when the request sets none
        assert first["attnstore"]["kv_source"] == "miss"
        again = chat(client, follow_up(conversation(), first))
        assert again["attnstore"]["kv_source"] == "host" and cached(again) > 0
        assert server.store.config.disk_dir is None and server.store.config.remote is None
        assert server.store.config.policy == "lookahead" and server.pipeline.max_batch_size == 8


def test_served_model_name_and_dtype(model_dir):
    with serving(model_dir, "--served-model-name", "tiny-chat", "--dtype", "bfloat16") as (client, server):
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny-chat"]
        chat(client, conversation(), status=404, model=str(model_dir))  # the path is no longer its name
        assert chat(client, conversation(), model="tiny-chat")["usage"]["completion_tokens"] == 4
        assert server.pipeline.model.dtype == torch.bfloat16


def test_disk_dir_writes_sessions_a_restarted_server_resumes(model_dir, tmp_path):
    disk = tmp_path / "disk"
    with serving(model_dir, "--disk-dir", str(disk), "--disk-bytes", "64MiB") as (client, server):
        assert server.store.config.disk_bytes == 64 * 2**20
        first = chat(client, conversation())
    assert chunk_metadata(disk)  # closing flushed the session's chunks under --disk-dir
    with serving(model_dir, "--disk-dir", str(disk)) as (client, _):
        again = chat(client, follow_up(conversation(), first))
    assert again["attnstore"]["kv_source"] == "disk" and cached(again) >= len(SYSTEM)


def test_host_bytes_bounds_the_host_tier(model_dir):
    with serving(model_dir, "--host-bytes", "3MiB") as (client, server):
        assert server.store.config.host_bytes == 3 * 2**20
        chat(client, conversation())
        assert 0 < server.store.stats().host_bytes_used <= 3 * 2**20


class Gate:
    """Holds the model's forward passes until released (every wait bounded)."""

    def __init__(self, model):
        self.entered, self.release = threading.Event(), threading.Event()
        forward = model.forward

        def gated(*args, **kwargs):
            self.entered.set()
            assert self.release.wait(30), "the test never released the gate"
            return forward(*args, **kwargs)

        model.forward = gated


def test_remote_shares_sessions_between_servers_with_their_own_disks(model_dir, tmp_path):
    """Two servers behind a load balancer (the session named by X-Session-ID), each with its own disk: the
    second resumes the first's session from Redis."""
    from hf_attnstore.lab.redis_server import RedisServer

    session = {"X-Session-ID": "conv-1"}
    with RedisServer(tmp_path / "redis") as redis:
        with serving(model_dir, "--disk-dir", str(tmp_path / "a"), "--remote", redis.url) as (client, server):
            assert server.store.config.remote == redis.url
            first = chat(client, conversation(), headers=session)
        with serving(model_dir, "--disk-dir", str(tmp_path / "b"), "--remote", redis.url) as (client, server):
            again = chat(client, follow_up(conversation(), first), headers=session)
            stats = server.store.stats()
    # "host" when the server's prefetch brought the session up from Redis before the turn ran.
    assert again["attnstore"]["kv_source"] in ("remote", "host") and cached(again) >= len(SYSTEM), again["attnstore"]
    assert stats.remote_bytes_read > 0 and stats.hits_disk == 0 and stats.remote_errors == 0


@pytest.mark.parametrize("shared", [True, False], ids=["shared state", "--no-shared-state"])
def test_remote_shares_the_serving_state_unless_no_shared_state(model_dir, tmp_path, shared):
    """With --remote, a resent conversation (no session named) and a Responses chain continue on another server;
    --no-shared-state keeps the index, the memo and the stored responses per process."""
    from hf_attnstore.lab.redis_server import RedisServer

    flags = () if shared else ("--no-shared-state",)
    with RedisServer(tmp_path / "redis") as redis:
        with serving(model_dir, "--remote", redis.url, *flags) as (client, server):
            assert (server.engine.shared is not None) == shared
            # Ended turns are written for the other replicas at once (store/test_concurrency.py: behaviour).
            assert server.store.config.save_while_computing == shared
            first = chat(client, conversation())
            response = client.post("/v1/responses", json={"model": client.model_name, "input": "hello",
                                                          "max_output_tokens": 4, "temperature": 0}).json()
        with serving(model_dir, "--remote", redis.url, *flags) as (client, server):
            again = chat(client, follow_up(conversation(), first))
            chained = client.post("/v1/responses", json={"model": client.model_name, "input": "and then?",
                                                         "previous_response_id": response["id"],
                                                         "max_output_tokens": 4, "temperature": 0})
    assert (again["attnstore"]["session_id"] == first["attnstore"]["session_id"]) == shared
    assert chained.status_code == (200 if shared else 400), chained.text


def test_an_unreachable_remote_starts_down_unless_required(model_dir, tmp_path):
    url = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    with serving(model_dir, "--remote", url, "--disk-dir", str(tmp_path)) as (client, server):
        assert client.get("/health").json()["remote"] == "down"
        assert chat(client, conversation())["attnstore"]["kv_source"] == "miss"  # served without the remote tier
        assert server.store.stats().remote_errors >= 1
    with pytest.raises(RemoteUnavailableError, match="cannot be reached"):
        with serving(model_dir, "--remote", url, "--remote-required"):
            pass


def first_bytes_sent_to(url_scheme: str, model_dir) -> bytes:
    """What a server started with `--remote {url_scheme}://127.0.0.1:PORT/0 --remote-required` sends first to a
    listener on PORT (which then hangs up: the server fails to start)."""
    import socket

    received = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(30)

        def accept():
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(30)
                received.append(conn.recv(5))

        thread = threading.Thread(target=accept)
        thread.start()
        url = f"{url_scheme}://127.0.0.1:{listener.getsockname()[1]}/0"
        with pytest.raises(RemoteUnavailableError, match=f"the remote tier {url}"):
            with serving(model_dir, "--remote", url, "--remote-required"):
                pass
        thread.join(30)
    return received[0]


def test_rediss_speaks_tls(model_dir):
    """`rediss://` connects with TLS (its first bytes are a TLS handshake record, 0x16 0x03), `redis://` in
    plain RESP (a `*` array); a server that cannot complete either is a clear error naming the URL."""
    assert first_bytes_sent_to("rediss", model_dir)[:2] == b"\x16\x03"
    assert first_bytes_sent_to("redis", model_dir)[:1] == b"*"


def test_kv_codec_labels_the_chunks_it_writes(model_dir, tmp_path):
    with serving(model_dir, "--disk-dir", str(tmp_path), "--kv-codec", "int8") as (client, server):
        first = chat(client, conversation())
    metas = chunk_metadata(tmp_path)
    assert metas and all("int8" in m.get("codec", "") for m in metas), metas
    with serving(model_dir, "--disk-dir", str(tmp_path), "--kv-codec", "int8") as (client, _):
        assert chat(client, follow_up(conversation(), first))["attnstore"]["kv_source"] == "disk"
    assert main(["serve", "--model", str(model_dir), "--kv-codec", "int4"]) == 2  # no lower tier to encode for


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_policy(model_dir, policy):
    with serving(model_dir, "--policy", policy) as (client, server):
        assert server.store.config.policy == policy
        first = chat(client, conversation())
        assert cached(chat(client, follow_up(conversation(), first))) > 0


def test_ttl_expires_idle_sessions_but_those_retained_for_24h(model_dir):
    import time

    # (No prefix sharing: the two conversations share the system prompt, which would be reused from the other.)
    with serving(model_dir, "--ttl", "0.3", "--no-share-prefixes") as (client, server):
        assert server.store.config.ttl_s == 0.3
        kept = chat(client, conversation(1), prompt_cache_key="kept", prompt_cache_retention="24h")
        idle = chat(client, conversation(2), prompt_cache_key="idle")
        time.sleep(1.0)
        assert cached(chat(client, follow_up(conversation(2), idle), prompt_cache_key="idle")) == 0
        assert cached(chat(client, follow_up(conversation(1), kept), prompt_cache_key="kept")) > 0
        assert server.store.stats().ttl_expired >= 1


def test_recompute_by_cost(model_dir, tmp_path):
    """A session on disk only, with rates that make loading it slower than recomputing (a 1-byte load taking 1000 s,
    a million-token prefill in a millisecond, as tests/cache/test_load_or_recompute.py sets them): with the flag its
    head is recomputed, without it the same rates are ignored and everything is loaded. The session is named
    (`X-Session-ID`): a conversation found by its messages resumes through another session's prefix, which is
    loaded whole (docs/serving.md)."""
    session = {"X-Session-ID": "by-cost"}
    with serving(model_dir, "--disk-dir", str(tmp_path)) as (client, server):
        first = chat(client, conversation(), headers=session)
    recomputed = {}
    for flags in ((), ("--recompute-by-cost",)):
        with serving(model_dir, "--disk-dir", str(tmp_path), *flags) as (client, server):
            assert server.store.config.recompute_by_cost is bool(flags)
            server.store.costs.observe_load("disk", 1, 1000.0)
            # Prefill rates are kept per model and head layout, under the turn's `prefill_key`.
            server.store.costs.observe_prefill(AttnStoreCache.prefill_key_of(server.pipeline.model, server.store),
                                               0, 10**6, 1e-3)
            again = chat(client, follow_up(conversation(), first), headers=session)
            assert again["usage"]["completion_tokens"] == 4
            recomputed[flags] = server.store.stats().resume_recomputed_tokens
    assert recomputed == {(): 0, ("--recompute-by-cost",): recomputed[("--recompute-by-cost",)]}
    assert recomputed[("--recompute-by-cost",)] >= 256, recomputed  # at least the first whole chunk


def test_a_shared_system_prompt_is_reused_unless_no_share_prefixes(model_dir):
    for flags, shared in (((), True), (("--no-share-prefixes",), False)):
        with serving(model_dir, *flags) as (client, server):
            chat(client, conversation(0))
            other = chat(client, conversation(1))  # another conversation, the same system prompt
            assert server.store.config.share_prefixes is shared
            assert (cached(other) >= 256) is shared, (flags, other["usage"])


def test_kv_budget_and_sparse_policy_make_the_pipeline_sparse(model_dir):
    with serving(model_dir, "--kv-budget", "0.5", "--sparse-policy", "h2o") as (client, server):
        assert server.pipeline.sparse is not None
        assert (server.pipeline.sparse.kv_budget, server.pipeline.sparse.policy) == (0.5, "h2o")
        first = chat(client, conversation())
        assert first["usage"]["completion_tokens"] == 4
        assert cached(chat(client, follow_up(conversation(), first))) > 0
    with serving(model_dir) as (_, server):
        assert server.pipeline.sparse is None


def test_sparse_copies_keep_only_the_kept_tokens_on_disk(model_dir, tmp_path):
    flags = ("--kv-budget", "0.25", "--sparse-policy", "alisa")
    with serving(model_dir, "--disk-dir", str(tmp_path / "all"), *flags) as (client, _):
        chat(client, conversation())
    with serving(model_dir, "--disk-dir", str(tmp_path / "sparse"), *flags, "--sparse-copies") as (client, server):
        assert server.store.config.sparse_copies is True
        chat(client, conversation())
    assert not any("kept" in m for m in chunk_metadata(tmp_path / "all"))
    assert any("kept" in m for m in chunk_metadata(tmp_path / "sparse"))
    assert main(["serve", "--model", str(model_dir), "--sparse-copies", *flags]) == 2  # no lower tier


def test_batch_limits(model_dir):
    flags = ("--max-batch-size", "2", "--max-batch-tokens", "64", "--max-batch-kv", "1MiB")
    with serving(model_dir, *flags) as (client, server):
        runner = server.pipeline.batch_runner
        assert (server.pipeline.max_batch_size, runner.max, runner.max_tokens, runner.max_kv_bytes) == \
            (2, 2, 64, 2**20)
        replies = []
        threads = [threading.Thread(target=lambda k=k: replies.append(chat(client, conversation(k))))
                   for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(replies) == 3 and all(r["usage"]["completion_tokens"] == 4 for r in replies)
    with serving(model_dir, "--max-batch-size", "1") as (client, server):
        assert server.pipeline.max_batch_size == 1 and not hasattr(server.pipeline, "batch_runner")
        assert chat(client, conversation())["usage"]["completion_tokens"] == 4
    # A byte bound on a batch cache that one-at-a-time serving does not have is refused at start.
    assert main(["serve", "--model", str(model_dir), "--max-batch-size", "1", "--max-batch-kv", "1MiB"]) == 2
    assert main(["serve", "--model", str(model_dir), "--max-batch-size", "4", "--max-batch-tokens", "4"]) == 2


def test_max_batch_kv_makes_turns_wait_for_room(model_dir):
    """Three conversations at once in a batch of up to 3: with `--max-batch-kv` below two rows' KV (a ~440-token
    prompt and its reply, 768 bytes a token on the tiny Llama) turns wait for room and the batch never holds two;
    without it they join (which shows the three overlapped)."""
    peaks, waits = {}, {}
    for flags in ((), ("--max-batch-kv", "450KiB")):
        with serving(model_dir, "--max-batch-size", "3", "--max-tokens", "24", *flags) as (client, server):
            replies, start, done = [], threading.Barrier(3), threading.Event()
            rows = []

            def watch():
                while not done.is_set():
                    rows.append(server.pipeline.batch_memory()["rows"])
                    done.wait(0.002)

            def user(k):
                start.wait(10)
                replies.append(chat(client, conversation(k)))
            watcher = threading.Thread(target=watch)
            watcher.start()
            threads = [threading.Thread(target=user, args=(k,)) for k in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            done.set()
            watcher.join(10)
            assert len(replies) == 3 and all(r["usage"]["completion_tokens"] == 24 for r in replies)
            peaks[flags], waits[flags] = max(rows), server.pipeline.batch_runner.memory_waits
    assert peaks[()] >= 2 and waits[()] == 0, (peaks, waits)
    assert peaks[("--max-batch-kv", "450KiB")] == 1 and waits[("--max-batch-kv", "450KiB")] >= 1, (peaks, waits)


def test_context_window_truncates(model_dir):
    with serving(model_dir, "--context-window", "128") as (client, server):
        reply = chat(client, conversation())
        assert reply["attnstore"]["dropped_tokens"] > 0 or reply["attnstore"]["kv_source"] == "truncated", reply
    with serving(model_dir) as (client, _):
        assert chat(client, conversation())["attnstore"]["dropped_tokens"] == 0


def test_chat_template_renders_the_prompt(model_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("PREFIX-{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with serving(model_dir) as (client, _):
        plain = chat(client, conversation())["usage"]["prompt_tokens"]
    with serving(model_dir, "--chat-template", str(template)) as (client, _):
        assert chat(client, conversation())["usage"]["prompt_tokens"] == plain + len("PREFIX-")
    assert main(["serve", "--model", str(model_dir), "--chat-template", str(tmp_path / "missing.jinja")]) == 2


def test_response_template_is_the_engines(model_dir, tmp_path):
    template = {"start_anchor": "<|assistant|>", "fields": {"content": {"close_pattern": r"<\|end\|>",
                                                                         "content": "text"}}}
    path = tmp_path / "response.json"
    path.write_text(json.dumps(template))
    with serving(model_dir, "--response-template", str(path)) as (client, server):
        assert server.engine.response_template == template
        assert chat(client, conversation())["usage"]["completion_tokens"] == 4
    path.write_text("{not json")
    assert main(["serve", "--model", str(model_dir), "--response-template", str(path)]) == 2


def test_max_pending_answers_429(model_dir):
    with serving(model_dir, "--max-pending", "1", "--max-batch-size", "1") as (client, server):
        gate = Gate(server.pipeline.model)
        results = []
        first = threading.Thread(target=lambda: results.append(chat(client, conversation())))
        first.start()
        assert gate.entered.wait(30)
        r = client.post("/v1/chat/completions", json={"model": str(model_dir), "messages": conversation(1)})
        gate.release.set()
        first.join(60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
        assert len(results) == 1


def test_request_timeout_answers_504(model_dir):
    with serving(model_dir, "--request-timeout", "0.5", "--max-batch-size", "1") as (client, server):
        gate = Gate(server.pipeline.model)
        try:
            r = client.post("/v1/chat/completions", json={"model": str(model_dir), "messages": conversation()})
        finally:
            gate.release.set()
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text


def test_serve_runs_uvicorn_on_host_and_port(model_dir, monkeypatch):
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    assert main(["-v", "serve", "--model", str(model_dir), "--host", "0.0.0.0", "--port", "8123"]) == 0
    (app, kw), = calls
    assert kw == {"host": "0.0.0.0", "port": 8123, "log_level": "info"}


def test_serve_says_what_was_not_durable_at_shutdown(model_dir, monkeypatch, capsys):
    """Redis down and no disk tier: the conversation served cannot be made durable; `serve` stops with one line
    naming it (exit 1), not a traceback."""
    import uvicorn

    def run(app, **kw):
        with TestClient(app) as client:
            client.model_name = str(model_dir)
            chat(client, conversation())

    monkeypatch.setattr(uvicorn, "run", run)
    assert main(["serve", "--model", str(model_dir), "--max-tokens", "4", "--remote", "redis://127.0.0.1:1/0"]) == 1
    err = capsys.readouterr().err
    assert "stopped;" in err and "not durable" in err and "Traceback" not in err
