"""Scorecard rows for the faults that adversarial runs found (issue 29), run by eval/faults.py.

Each row reproduces one finding end to end, many times, and counts what eval/faults.py counts: wrong KV,
crashes, data lost.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch

from faults import FAST, Row, resume_is_wrong, sequence, tiny_model, tolerance, turn
from hf_attnstore import AttnStore, AttnStoreCache

HUGE = 5  # a token whose layer-0 values no fp16 scale can hold (|v| > 65504)


def _huge_value_model():
    """The scorecard's tiny Llama, with token HUGE driving layer 0's values to ~72,000 (and no other token)."""
    model = tiny_model()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb[HUGE] = 0.0
        emb[HUGE, 0] = 1.0
        model.model.layers[0].self_attn.v_proj.weight[:, 0] = 72_000 / model.config.hidden_size ** 0.5
    return model


def _codec_ids(seed: int, first: int, rng: random.Random) -> torch.Tensor:
    """40 ids where every whole chunk before token `first` holds HUGE (they stay lossless), and so does the chunk
    a second turn rewrites after `first` (the lossy partial chunk it extends cannot be encoded again)."""
    ids = sequence(seed, 40)
    ids[ids == HUGE] = HUGE + 1
    for chunk in range(first // 8):
        ids[0, chunk * 8 + rng.randrange(8)] = HUGE
    ids[0, rng.randrange(first, first - first % 8 + 8)] = HUGE
    return ids


def scenario_codec_labels(runs: int, rng: random.Random) -> Row:
    """A lossy store rewrites a loaded lossy partial chunk with tokens its codec cannot encode; a lossless
    store reopened on the folder must not reuse the dequantized tokens (it did: labelled lossless), while a store
    of the same codec reopened on it serves them all (so a store that serves nothing does not pass)."""
    row = Row("lossy chunk rewritten over dequantized tokens, reopened lossless")
    model, lossy_reused = _huge_value_model(), 0
    tolerance(model, [_codec_ids(700 + i, 17, random.Random(i)) for i in range(4)], cuts=(8, 17, 25, 33))
    for run in range(runs):
        codec = ("int4", "int8")[run % 2]
        root = tempfile.mkdtemp(prefix="faults-codec-")
        try:
            first = rng.randrange(9, 24)  # ends inside a chunk (mostly): a lossy trailing partial chunk
            ids = _codec_ids(run, first, rng)
            held = first - first % 8 + 8
            with AttnStore(host_bytes="64MiB", disk_dir=root, kv_codec=codec, **FAST) as store:
                turn(model, store, "s", ids[:, :first])
                store.flush()
                store.evict("s")
                turn(model, store, "s", ids[:, :held])
                store.flush()
            prompt = ids[:, : held + 1]
            row.runs += 1
            with AttnStore(host_bytes="64MiB", disk_dir=root, kv_codec=codec, **FAST) as store:
                reused = AttnStoreCache(model, store, "s", prompt, save=False).reused_tokens
                lossy_reused += reused
                if reused < held:
                    row.lost += 1
                    row.notes.append(f"{codec}, {first} then {held} tokens: a {codec} store reused {reused}")
            with AttnStore(host_bytes="64MiB", disk_dir=root, **FAST) as store:
                reused, wrong = resume_is_wrong(model, store, "s", prompt)
                # A lossless store serves no dequantized token at all (a turn that ended on a chunk boundary
                # left no lossy partial chunk: then everything is exact, and reusing it is right).
                served_lossy = reused > 0 and first % 8 != 0
                row.wrong += wrong or served_lossy
                if wrong or served_lossy:
                    row.notes.append(f"{codec}, {first} then {held} tokens: reused {reused} lossless")
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{lossy_reused} tokens reused by stores of the chunks' codec, none of the dequantized ones by "
                     "lossless stores")
    if not lossy_reused:
        row.zero_work("no store of the chunks' codec reused them")
    return row


# -- the server: client-given sizes and session ids (faults 2 and 4) ------------------------------------
def _server(max_batch_size: int = 8):
    """An in-process OpenAI-compatible server over the scorecard's tiny Llama and the tests' character
    tokenizer (tests/conftest.py), with a short request timeout: a request that hangs shows in seconds."""
    import sys

    from fastapi.testclient import TestClient

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import char_tokenizer

    from hf_attnstore.serving.pipeline import ChatPipeline
    from hf_attnstore.serving import ChatEngine, create_app

    store = AttnStore("64MiB")
    pipe = ChatPipeline(tiny_model(), char_tokenizer(), store, max_new_tokens=8, max_batch_size=max_batch_size)
    app = create_app(ChatEngine(pipe), "tiny", default_max_tokens=8, request_timeout_s=30)
    return TestClient(app), pipe, store


@contextlib.contextmanager
def _serving(row: Row):
    """An in-process server (see `_server`) for one row: any exception is the row's crash, and the pipeline
    and store are closed whatever happens."""
    client, pipe, store = _server()
    try:
        yield client, pipe
    except Exception as exc:
        row.crash(exc)
    finally:
        pipe.close(timeout=60)
        store.close()


def _post(client, headers=None, content=None, **fields):
    if content is not None:
        return client.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 4,
            **fields}
    # json.dumps escapes what httpx's encoder refuses (a lone surrogate becomes the escape "\\ud800")
    return client.post("/v1/chat/completions", content=json.dumps(body).encode(),
                       headers={"Content-Type": "application/json", **(headers or {})})


def _client_error(row: Row, r, param: str | None, what: str) -> bool:
    """Counts a crash unless `r` is a 400 OpenAI error object naming `param`; returns whether it is."""
    row.runs += 1
    try:
        error = r.json()["error"]
        ok = (r.status_code == 400 and set(error) == {"message", "type", "param", "code"}
              and error["type"] == "invalid_request_error" and error["param"] == param)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        row.crashes += 1
        row.notes.append(f"{what}: {r.status_code} {r.text[:80]}")
    return ok


def _still_serves(row: Row, client, concurrent: int = 4) -> int:
    """Counts a crash unless `concurrent` normal requests, batched together, are all answered 200; returns how
    many were."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(concurrent) as pool:
        codes = list(pool.map(lambda i: _post(client, user=f"after-{i}").status_code, range(concurrent)))
    row.runs += 1
    if codes != [200] * concurrent:
        row.crashes += 1
        row.notes.append(f"later requests answered {codes}")
    return codes.count(200)


def scenario_huge_sizes(runs: int) -> Row:
    """Huge `max_tokens` at batch 8 used to kill the batch runner: every later request timed out."""
    row = Row("huge max_tokens / n / stop / messages at batch 8, then normal requests")
    refused = served = 0
    with _serving(row) as (client, _):
        for i in range(runs):
            value = (10**12, 2**63, 2**63 - 1, 10**6)[i % 4]
            for field in ("max_tokens", "max_completion_tokens"):
                refused += _client_error(row, _post(client, **{field: value}), field, f"{field}={value}")
            refused += _client_error(row, _post(client, stop=["x"] * 1000), "stop", "1000 stop strings")
            refused += _client_error(row, _post(client, messages=[{"role": "user", "content": "a"}] * 10_000),
                                     "messages", "10,000 messages")
            served += _still_serves(row, client)
    _served_after(row, refused, served)
    return row


def _served_after(row: Row, refused: int, served: int) -> None:
    row.notes.append(f"{refused} requests refused with a 400 naming the field, {served} normal requests answered 200 "
                     "after them")
    if not refused or not served:
        row.zero_work("nothing refused or nothing served")


def scenario_bad_session_ids() -> Row:
    """Bad `user` / X-Session-ID used to get 503 "shutting_down" (clients retry forever), a NUL no answer, and
    an invalid UTF-8 body FastAPI's own error shape. Then a real shutdown must still be a 503."""
    row = Row("bad session ids and bodies over HTTP (400 naming the field; 503 only when shutting down)")
    refused = served = 0
    with _serving(row) as (client, pipe):
        for bad in ["x" * 5000, "a\x00b", "\ud800", "line\nbreak", " padded", "日本"]:
            refused += _client_error(row, _post(client, user=bad), "user", f"user={bad[:12]!r}")
        for bad in [b"x" * 5000, b"a\x00b", b"\xff\xfe", "日本".encode()]:
            r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user",
                            "content": "hi"}], "max_tokens": 2}, headers={"X-Session-ID": bad})
            refused += _client_error(row, r, "X-Session-ID", f"X-Session-ID={bad[:12]!r}")
        refused += _client_error(row, _post(client, content=b'{"model": "tiny", "messages": [\xff]}'), None,
                                 "invalid UTF-8")
        served += _still_serves(row, client)
        pipe.close(timeout=60)
        r = _post(client)
        row.runs += 1
        if r.status_code != 503 or r.json()["error"]["code"] != "shutting_down":
            row.crashes += 1
            row.notes.append(f"after close: {r.status_code} {r.text[:80]}")
    _served_after(row, refused, served)
    return row


# -- the shared remote tier: a remote fault never costs a store its durable local copy (fault 3) ---------
REMOTE_VARIANTS = ["lossier codec", "Redis killed mid-verify", "Redis killed mid-load", "damaged bytes"]


def _remote_variant(model, variant: str, run: int, root: Path) -> tuple[int, bool, int]:
    """Store A (lossless, its own disk) flushes 30 tokens; store B extends the session in Redis to 60; then
    `variant` strikes while A resumes. Returns (tokens A reused, whether its logits were wrong, tokens A's
    folder serves once reopened without Redis, and for a kill whether it landed with Redis really down: ``None``
    when the struck call never came)."""
    from unittest import mock

    from hf_attnstore.lab.redis_server import RedisServer
    from hf_attnstore.store.tiers.redis import RemoteChunk, RemoteTier

    fast = {**FAST, "remote_timeout_s": 2}
    ids = sequence(run, 64)
    with RedisServer(root / "redis") as server:
        with AttnStore(host_bytes="64MiB", disk_dir=str(root / "a"), remote=server.url, **fast) as a:
            turn(model, a, "s", ids[:, :30])
            a.flush()
            a.evict("s")
            codec = {"kv_codec": "int4"} if variant == "lossier codec" else {}
            with AttnStore(host_bytes="64MiB", disk_dir=str(root / "b"), remote=server.url, **fast, **codec) as b:
                turn(model, b, "s", ids[:, :60])
                b.flush()
            if variant == "damaged bytes":
                remote = a._remote  # the scorecard damages the shared tier's bytes where they lie
                manifest = remote.manifest((AttnStoreCache.fingerprint_of(model, a), "s"))
                target = remote.key_of((AttnStoreCache.fingerprint_of(model, a), "s"), "c:" + manifest.spans[-1].chunk)
                value = bytearray(remote.client.get(target))
                value[-3] ^= 0x10
                remote.client.set(target, bytes(value))
            strike = {"Redis killed mid-verify": (RemoteTier, "get"),
                      "Redis killed mid-load": (RemoteChunk, "read_layer_into")}.get(variant)
            fired = []  # for a kill: whether Redis was really down after it (a PING refused)
            if strike is not None:
                original = getattr(*strike)

                def kill_first(*args, _original=original, **kwargs):
                    if not fired:
                        server.stop()
                        fired.append(_down(server))
                    return _original(*args, **kwargs)

                with mock.patch.object(*strike, kill_first):
                    reused, wrong = resume_is_wrong(model, a, "s", ids[:, :61])
            else:
                reused, wrong = resume_is_wrong(model, a, "s", ids[:, :61])
            for _ in range(2):  # the next turns: the local copy (or the verified remote one) is reused exactly
                again, wrong_again = resume_is_wrong(model, a, "s", ids[:, :61])
                wrong = wrong or wrong_again
    with AttnStore(host_bytes="64MiB", disk_dir=str(root / "a"), **FAST) as reopened:
        stored = reopened.token_ids("s", AttnStoreCache.fingerprint_of(model, reopened))
        kept = 0 if stored is None else int(stored.numel())
        _, wrong_reopened = resume_is_wrong(model, reopened, "s", ids[:, : max(kept, 1) + 1])
    return max(reused, again), wrong or wrong_reopened, kept, (fired[0] if fired else None) if strike else "n/a"


def _down(server) -> bool:
    import redis

    try:
        redis.Redis(unix_socket_path=str(server.socket), socket_timeout=1).ping()
        return False
    except (redis.RedisError, OSError):
        return True


def scenario_remote_local_copy(runs: int) -> Row:
    """A lossless store's flushed session used to be deleted when a longer remote copy it could not serve
    (another codec) or could not load (Redis killed) was found: data lost to a remote fault."""
    row = Row("remote copy refused or failing mid-load (codec, kill, damage): local durable copy kept")
    model, kills, reused_total = tiny_model(), [0, 0], 0
    for run in range(runs):
        variant = REMOTE_VARIANTS[run % len(REMOTE_VARIANTS)]
        root = Path(tempfile.mkdtemp(prefix="faults-remote-"))
        try:
            row.runs += 1
            reused, wrong, kept, killed = _remote_variant(model, variant, run, root)
            row.wrong += wrong
            reused_total += reused
            if kept < 30:
                row.lost += 1
                row.notes.append(f"{variant}: {kept} of 30 durable tokens after a reopen")
            if reused < 30:  # the local copy (30) or the verified remote one (60) is reused, at once or next turn
                row.lost += 1
                row.notes.append(f"{variant}: reused {reused} of the 30 durable tokens")
            if killed != "n/a":
                kills[0] += killed is not None
                kills[1] += bool(killed)
                if not killed:
                    row.crashes += 1
                    row.notes.append(f"{variant}: " + ("the struck call never came" if killed is None else
                                                        "Redis was not down after the kill"))
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    row.notes.append(f"{kills[0]} kills of Redis mid-resume, {kills[1]} with Redis really down after (a PING "
                     f"refused); {reused_total} tokens reused over {row.runs} resumes (30 each at least)")
    if not kills[1] or not reused_total:
        row.zero_work("no kill landed with Redis down, or nothing reused")
    return row
