"""Every `attnstore serve` flag in a running server: built from the real argv by `cli.build_server` (what `serve`
runs under uvicorn), over a tiny random Llama saved to a folder, driven through FastAPI's TestClient."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from fastapi.testclient import TestClient

from hf_attnstore.cli import build_parser, build_server, main
from hf_attnstore.store.remote import RemoteUnavailableError

from .conftest import char_tokenizer, make_tiny
from .store.kvdata import chunk_metadata

SYSTEM = "You answer briefly and politely, in plain words, without lists or code. " * 3  # > 3 chunks of 64 chars


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@contextlib.contextmanager
def serving(model_dir, *flags):
    """A server as `attnstore serve --model DIR FLAGS` builds it, and a client of it; closed (flushed) on exit."""
    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--max-tokens", "4", *flags])
    server = build_server(args)
    try:
        with TestClient(server.app) as client:
            yield client, server
    finally:
        server.close()


def chat(client, messages, status=200, **extra):
    body = {"model": extra.pop("model", str(_MODEL[0])), "messages": messages, "temperature": 0, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    return r.json()


_MODEL: list = [None]  # the served model id (--model's path unless --served-model-name)


@pytest.fixture(autouse=True)
def _served_name(model_dir):
    _MODEL[0] = model_dir


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
        chat(client, conversation(), status=404)  # the path is no longer its name
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
