"""Two servers (two stores, each with its own host and disk tiers) share one Redis: a conversation that
alternates between them reuses the other's KV at every turn, with the tokens of full recomputation."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.serving.pipeline import ChatPipeline
from hf_attnstore.lab.redis_server import RedisServer

from ..conftest import char_tokenizer, make_tiny, random_ids
from hf_attnstore.cache.upstream import cache_kwargs

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=16)


@pytest.mark.parametrize("disk", [True, False], ids=["disk+remote", "remote only"])
def test_a_conversation_alternating_between_two_stores_reuses_from_remote(tmp_path, disk):
    model = make_tiny("llama")
    with RedisServer(tmp_path / "redis") as server:
        stores = [AttnStore("16MiB", tmp_path / name if disk else None, remote=server.url, **FAST)
                  for name in ("a", "b")]
        hist = random_ids(24, 1)
        for turn in range(4):
            store = stores[turn % 2]
            cache = AttnStoreCache(model, store, "chat", hist)
            out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY)
            expected = model.generate(hist, **cache_kwargs(DynamicCache()), max_new_tokens=5, **GREEDY)
            assert torch.equal(out, expected), turn
            if turn:
                # Everything but the 6 new tokens and the last generated one came from the other store.
                assert cache.kv_source == "remote" and cache.reused_tokens == hist.shape[1] - 7, turn
            cache.close()
            store.flush()  # the turn is written to disk and copied to Redis (or written to Redis)
            hist = torch.cat([out, random_ids(6, 100 + turn)], dim=1)
        for store in stores:
            assert store.stats().remote_errors == 0
            store.close()


def test_two_chat_pipelines_alternate_on_one_conversation(tmp_path):
    """Two replicas (pipelines over their own stores) sharing the conversations and one Redis: every turn
    after the first resumes from the other replica's KV, and the replies are those of recomputation."""
    model, tok = make_tiny("llama"), char_tokenizer()
    messages = [f"message number {k}: " + "abc " * (3 + k) for k in range(5)]
    with ChatPipeline(model, tok, None, max_new_tokens=6) as alone:
        expected = [alone.chat("c", m, timeout=60) for m in messages]
    with RedisServer(tmp_path / "redis") as server:
        stores = [AttnStore("16MiB", tmp_path / name, remote=server.url, **FAST) for name in ("a", "b")]
        histories = {}
        # No prefetch: it would pull the session into host memory first, and the turn would report "host".
        pipes = [ChatPipeline(model, tok, store, max_new_tokens=6, histories=histories, prefetch_window=0)
                 for store in stores]
        for k, message in enumerate(messages):
            reply = pipes[k % 2].chat("c", message, timeout=60)
            stores[k % 2].flush()  # write-behind done before the user's next message
            assert reply.text == expected[k].text and reply.greedy_ids == expected[k].greedy_ids, k
            if k:
                assert reply.kv_source == "remote" and reply.reused_tokens > 0, k
        for pipe, store in zip(pipes, stores):
            pipe.close()
            assert store.stats().remote_errors == 0
            store.close()


REPLICA = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from hf_attnstore import AttnStore
    from hf_attnstore.serving.pipeline import ChatPipeline
    from tests.conftest import char_tokenizer, make_tiny

    model, tok = make_tiny("llama"), char_tokenizer()
    with AttnStore("16MiB", {disk!r}, remote={url!r}, fsync=False, chunk_tokens=16) as store:
        with ChatPipeline(model, tok, store, max_new_tokens=6, prefetch_window=0) as pipe:
            r = pipe.chat("c", {message!r}, timeout=60)
    print(json.dumps(dict(text=r.text, greedy=list(r.greedy_ids), source=r.kv_source, reused=r.reused_tokens)))
""")


def test_two_processes_alternate_on_one_conversation(tmp_path):
    """Each turn runs in a fresh process, alternately with disk folder a or b: nothing is shared but Redis.
    A process that never saw the conversation (or saw an older part of it) takes it from the remote tier."""
    model, tok = make_tiny("llama"), char_tokenizer()
    messages = [f"turn {k}: " + "xyz " * (2 + k) for k in range(4)]
    expected, lengths = [], []  # each turn's reply, and the conversation's length in tokens after it
    with ChatPipeline(model, tok, None, max_new_tokens=6) as alone:
        for m in messages:
            expected.append(alone.chat("c", m, timeout=60))
            lengths.append(alone.session_stats("c")["tokens"])
    root = str(Path(__file__).resolve().parents[1])
    with RedisServer(tmp_path / "redis") as server:
        for k, message in enumerate(messages):
            script = REPLICA.format(root=root, disk=str(tmp_path / "ab"[k % 2]), url=server.url, message=message)
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-2000:]
            got = json.loads(done.stdout.strip().splitlines()[-1])
            assert got["text"] == expected[k].text and got["greedy"] == list(expected[k].greedy_ids), k
            if k:  # the other process wrote the previous turn: found only in (or longer in) Redis, all of it
                # (replies are cut by max_new_tokens: the last generated token must be stored too)
                assert got["source"] == "remote" and got["reused"] == lengths[k - 1], (k, got)
