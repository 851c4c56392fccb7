"""`namespace` over a shared disk folder and a shared Redis (tenants never see each other's sessions, a store of
the same namespace resumes them), and `idle_flush_s` (an idle session is written without a flush)."""

from __future__ import annotations

import time

import pytest

from hf_attnstore import AttnStore
from hf_attnstore.serving.pipeline import ChatPipeline
from hf_attnstore.lab.redis_server import RedisServer

from ..conftest import char_tokenizer, make_tiny
from .kvdata import chunk_metadata, write_turn

FAST = dict(fsync=False, chunk_tokens=16)


def resume(model, tok, store, histories, message):
    """One turn of session "s" (its history from `histories`, as a load balancer's replicas share it)."""
    with ChatPipeline(model, tok, store, max_new_tokens=3, histories=histories, prefetch_window=0) as pipe:
        return pipe.chat("s", message, timeout=60)


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_namespaces_over_one_folder_or_one_redis_do_not_share_sessions(tmp_path, tier):
    model, tok = make_tiny("llama"), char_tokenizer()
    with RedisServer(tmp_path / "redis") as redis:
        def store(namespace, name):
            # disk: every store on the one folder (one at a time: it is locked); redis: each its own folder.
            folder = tmp_path / ("shared" if tier == "disk" else name)
            return AttnStore("16MiB", folder, namespace=namespace, remote=redis.url if tier == "redis" else None,
                             **FAST)

        histories = {}
        with store("tenant-a", "a1") as a:
            assert resume(model, tok, a, histories, "hello there, tenant a speaking").kv_source == "miss"
        with store("tenant-b", "b") as b:  # the same session id and history, another namespace
            other = resume(model, tok, b, dict(histories), "and now?")
        with store("tenant-a", "a2") as a:
            same = resume(model, tok, a, dict(histories), "and now?")
    assert other.kv_source == "miss" and other.reused_tokens == 0
    assert same.kv_source == tier.replace("redis", "remote") and same.reused_tokens > 0


def test_idle_flush_s_writes_an_idle_session_without_a_flush(tmp_path):
    """Whole chunks are written as soon as the model is idle; a trailing partial chunk (here the whole session:
    10 tokens, chunks of 16) waits until its session's last write is `idle_flush_s` old."""
    ids = list(range(10))
    with AttnStore("16MiB", tmp_path / "slow", idle_flush_s=60, **FAST) as slow, \
            AttnStore("16MiB", tmp_path / "fast", idle_flush_s=0.05, **FAST) as fast:
        write_turn(slow, "s", ids)
        write_turn(fast, "s", ids)
        deadline = time.monotonic() + 20
        while not chunk_metadata(tmp_path / "fast") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert chunk_metadata(tmp_path / "fast"), "the idle session was not written within 20 s"
        time.sleep(0.5)  # ten gaps of the fast store's: the slow store, not idle for 60 s yet, wrote nothing
        assert not chunk_metadata(tmp_path / "slow")
