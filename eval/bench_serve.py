"""Closed-loop chat users over real HTTP with the `openai` client: `attnstore serve` vs `transformers serve`.

    python eval/bench_serve.py --users 1,4,8 --turns 4 --systems attnstore,attnstore-b1,transformers-cb,transformers

Each user replays one ShareGPT conversation: its user messages (clipped to `--message-chars` characters of
real text), resending the whole conversation each turn as OpenAI clients do, streaming, greedy, `--max-tokens`
per reply, `--think` seconds between a reply and the next message. All users start together; a run ends
when every user has done its turns. The same conversations and settings for every system; each system is
a fresh server process (same model, same machine), started and stopped by this script.

Many sessions whose KV does not fit in memory (`--host-bytes` for ours, `--cb-num-blocks` for transformers'
continuous batching; `--disk-dir` gives ours its disk tier):

    python eval/bench_serve.py --users 64 --turns 2 --systems attnstore,attnstore-b1,transformers-cb \
        --host-bytes 512MiB --disk-dir /tmp --cb-num-blocks 90

A shared system prompt (prefix sharing, issue 31): every user's conversation starts with the same system message
of `--system-tokens` tokens of real prose (a ShareGPT conversation's text); first-turn TTFT is reported too:

    python eval/bench_serve.py --users 8 --turns 2 --system-tokens 1000 \
        --systems attnstore,attnstore-noshare,transformers-cb

Sessions kept in a shared Redis behind a slow link, loaded or partly recomputed by cost (issue 33; needs root):
every attnstore server gets its own redis-server in a network namespace, reached over a veth link shaped to
`--remote-mbit` Mbit/s (eval/bench_recompute.py), as its only tier below host memory:

    python eval/bench_serve.py --users 4 --turns 4 --systems attnstore,attnstore-cost --host-bytes 64MiB \
        --remote-mbit 200

Systems: `attnstore` (continuous batching, `--max-batch-size 8`), `attnstore-noshare` (the same without prefix
sharing, `--no-share-prefixes`), `attnstore-cost` (the same with `--recompute-by-cost`), `attnstore-b1` (one turn at a time: the batch-1 pipeline), `transformers-cb` (`transformers serve --continuous-batching`), `transformers` (plain
`transformers serve`). Reported per system and concurrency: completed turns/s and generated tokens/s over the run's wall time;
TTFT of resumed turns (a user's second turn on: time to the first streamed content, queueing included)
p50 / p99; the share of prompt tokens the server reports as cached (`usage.prompt_tokens_details.
cached_tokens`, where the server reports it).

A run in which a user did not finish every turn (its request failed, or its thread died) exits non-zero, naming the
users and turns missing: its throughput would be measured over fewer turns than the table says. Each server's disk
folder (`--disk-dir`) is removed when the server stops, also when the run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from hf_attnstore.lab.redis_server import free_port  # noqa: E402


def attnstore(port: int, args, batch: int) -> list[str]:
    cmd = [sys.executable, "-m", "hf_attnstore", "serve", "--port", str(port), "--max-tokens", str(args.max_tokens),
           "--max-batch-size", str(batch), "--max-pending", "256"]
    if args.host_bytes:
        cmd += ["--host-bytes", args.host_bytes]
    if args.server_disk:
        cmd += ["--disk-dir", args.server_disk]
    if args.remote_url:
        cmd += ["--remote", args.remote_url, "--remote-required"]
    return cmd


SYSTEMS = {
    "attnstore": lambda port, model_dir, args: attnstore(port, args, 8),
    "attnstore-b1": lambda port, model_dir, args: attnstore(port, args, 1),
    "attnstore-noshare": lambda port, model_dir, args: attnstore(port, args, 8) + ["--no-share-prefixes"],
    "attnstore-cost": lambda port, model_dir, args: attnstore(port, args, 8) + ["--recompute-by-cost"],
    "transformers-cb": lambda port, model_dir, args: ["transformers", "serve", model_dir, "--port", str(port),
                                                      "--continuous-batching", "--dtype", "float32", "--device", "cpu"]
    + (["--cb-num-blocks", str(args.cb_num_blocks)] if args.cb_num_blocks else []),
    "transformers": lambda port, model_dir, args: ["transformers", "serve", model_dir, "--port", str(port),
                                                   "--dtype", "float32", "--device", "cpu"],
}


def server_tiers(stack: contextlib.ExitStack, system: str, args) -> None:
    """Sets `args.server_disk` and `args.remote_url` for the next attnstore server: a fresh disk folder under
    `--disk-dir` (no session survives from an earlier run) and a fresh, empty Redis behind a shaped link
    (`--remote-mbit`), each removed when `stack` closes, after the server has stopped."""
    args.server_disk = args.remote_url = None
    if not system.startswith("attnstore"):
        return
    if args.disk_dir:
        args.server_disk = stack.enter_context(tempfile.TemporaryDirectory(prefix="attnstore-bench-",
                                                                           dir=args.disk_dir))
    if args.remote_mbit:
        from bench_recompute import shaped_redis

        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="attnstore-redis-"))
        args.remote_url = stack.enter_context(shaped_redis(args.remote_mbit, Path(folder)))


class IncompleteRun(RuntimeError):
    """A benchmark run that did not do all the work it reports on."""


def check_complete(done: set, expected: set, errors: list[str], client: str, step: str) -> None:
    """Raises IncompleteRun unless every expected (client, step) pair is in `done` and no client failed."""
    missing = sorted(expected - done)
    if missing or errors:
        shown = ", ".join(f"{client} {c} {step} {t}" for c, t in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise IncompleteRun(f"{len(missing)} of {len(expected)} {step}s not finished ({shown or 'none'}); "
                            f"{len(errors)} {client}s failed: {'; '.join(errors[:3]) or '-'}")


def conversations(n: int, turns: int, chars: int) -> list[list[str]]:
    from hf_attnstore.lab.data import load_sharegpt

    out = []
    for conv in load_sharegpt(limit=4 * n, min_user_turns=1):
        users = [m["content"][:chars] for m in conv.messages if m["role"] == "user" and len(m["content"]) >= 200]
        if users:
            out.append((users * turns)[:turns])  # short conversations repeat their messages
        if len(out) == n:
            return out
    raise ValueError(f"not enough ShareGPT conversations with long user messages for {n} users")


def start(system: str, port: int, model_dir: str, args, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """Starts `system` (one of SYSTEMS) on `port` with `extra` command-line arguments, and waits for /health."""
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": venv_bin + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.Popen([*SYSTEMS[system](port, model_dir, args), *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{system} did not start")
            time.sleep(0.5)


def system_prompt(tokens: int) -> str | None:
    """`tokens` tokens (SmolLM2's tokenizer) of real prose: the text of a ShareGPT conversation none of the users
    replays, cut at a token boundary."""
    if not tokens:
        return None
    from hf_attnstore import load_default_model
    from hf_attnstore.lab.evaluation.corpora import load_texts

    _, tokenizer = load_default_model()
    ids = load_texts("sharegpt", tokenizer, 1, tokens)[0][:tokens]
    return tokenizer.decode(ids)


def stream_turn(client, model: str, messages: list[dict], max_tokens: int, **extra) -> dict:
    """One streamed, greedy turn (`extra`: more request fields, e.g. `tools`): its reply, its tool calls (deltas
    joined by index), TTFT (to the first content or call delta), total time and usage."""
    t0 = time.perf_counter()
    first, reply, calls, usage = None, "", {}, None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            **extra)
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and (delta.content or delta.tool_calls) and first is None:
            first = time.perf_counter()
        reply += (delta.content or "") if delta is not None else ""
        for piece in (delta.tool_calls or []) if delta is not None else []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
        usage = chunk.usage or usage
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return dict(ttft=(first or end) - t0, total=end - t0, prompt=usage.prompt_tokens if usage else 0,
                completion=usage.completion_tokens if usage else 0,
                cached=getattr(details, "cached_tokens", None) if details else None, reply=reply,
                calls=[calls[i] for i in sorted(calls)])


def user(client, model: str, u: int, messages_in: list[str], args, records: list, errors: list,
         lock: threading.Lock) -> None:
    messages = [{"role": "system", "content": args.system_text}] if args.system_text else []
    try:
        for turn, text in enumerate(messages_in):
            messages.append({"role": "user", "content": text})
            record = stream_turn(client, model, messages, args.max_tokens)
            record.pop("calls")
            with lock:
                records.append(dict(user=u, turn=turn, **record))
            messages.append({"role": "assistant", "content": record["reply"]})
            time.sleep(args.think)
    except Exception as e:  # noqa: BLE001 - recorded and reported: the run fails, not this thread alone
        with lock:
            errors.append(f"user {u}: {type(e).__name__}: {e}")


def run(system: str, users: int, convs, model_dir: str, args) -> dict:
    with contextlib.ExitStack() as stack:
        server_tiers(stack, system, args)
        return measure(system, users, convs, model_dir, args, free_port())


def measure(system: str, users: int, convs, model_dir: str, args, port: int) -> dict:
    import openai

    proc = start(system, port, model_dir, args)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=3600)
        model = client.models.list().data[0].id if system.startswith("attnstore") else model_dir
        warm = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, temperature=0)
        assert warm.choices
        records, errors, lock = [], [], threading.Lock()
        threads = [threading.Thread(target=user, args=(client, model, u, convs[u], args, records, errors, lock))
                   for u in range(users)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60)
    check_complete({(r["user"], r["turn"]) for r in records},
                   {(u, t) for u in range(users) for t in range(len(convs[u]))}, errors, "user", "turn")
    resumed = sorted(r["ttft"] for r in records if r["turn"] > 0)
    first = sorted(r["ttft"] for r in records if r["turn"] == 0)
    cached = [r for r in records if r["cached"] is not None]
    return dict(system=system, users=users, turns=len(records), wall_s=wall, turns_per_s=len(records) / wall,
                tokens_per_s=sum(r["completion"] for r in records) / wall,
                ttft_resumed_p50_ms=1000 * statistics.median(resumed) if resumed else float("nan"),
                ttft_resumed_p99_ms=1000 * resumed[min(len(resumed) - 1, int(0.99 * len(resumed)))] if resumed
                else float("nan"),
                ttft_first_p50_ms=1000 * statistics.median(first) if first else float("nan"),
                ttft_first_max_ms=1000 * first[-1] if first else float("nan"),
                cached_share=(sum(r["cached"] for r in cached) / max(1, sum(r["prompt"] for r in cached))
                              if cached else None),
                prompt_tokens_mean=statistics.mean(r["prompt"] for r in records),
                replies=[r["reply"] for r in sorted(records, key=lambda r: r["turn"])])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", default="1,4,8")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--message-chars", type=int, default=1200)
    p.add_argument("--think", type=float, default=0.0)
    p.add_argument("--systems", default="attnstore,attnstore-b1,transformers-cb,transformers")
    p.add_argument("--json", default=None)
    p.add_argument("--system-tokens", type=int, default=0, help="a shared system prompt of this many tokens")
    # Memory limits, for the many-sessions run: the sessions' KV does not fit in the servers' KV memory.
    p.add_argument("--host-bytes", default=None, help="attnstore's host tier (default: the server's)")
    p.add_argument("--disk-dir", default=None, help="give attnstore a disk tier (a fresh folder under this one)")
    p.add_argument("--remote-mbit", type=int, default=None,
                   help="give each attnstore server a Redis tier behind a link of this many Mbit/s (needs root)")
    p.add_argument("--cb-num-blocks", type=int, default=None,
                   help="transformers' continuous batching KV memory, in blocks of 256 tokens of every layer")
    args = p.parse_args(argv)
    args.system_text = system_prompt(args.system_tokens)
    from hf_attnstore import load_default_model

    model, _ = load_default_model()
    model_dir = model.name_or_path
    del model
    levels = [int(x) for x in args.users.split(",")]
    convs = conversations(max(levels), args.turns, args.message_chars)
    rows = []
    for users in levels:
        for system in args.systems.split(","):
            try:
                row = run(system, users, convs, model_dir, args)
            except IncompleteRun as e:
                print(f"{system} x{users}: the run is incomplete, so nothing is reported: {e}", file=sys.stderr)
                return 1
            rows.append(row)
            print(f"{system} x{users}: {row['turns_per_s']:.3f} turns/s, resumed TTFT p50 "
                  f"{row['ttft_resumed_p50_ms']:.0f} ms", flush=True)
    print("\n| users | system | turns/s | tokens/s | first-turn TTFT p50 | max | resumed TTFT p50 | p99 | "
          "cached share | mean prompt | wall |")
    print("| --- " * 11 + "|")
    for r in rows:
        cached = f"{100 * r['cached_share']:.1f}%" if r["cached_share"] is not None else "–"
        print(f"| {r['users']} | {r['system']} | {r['turns_per_s']:.3f} | {r['tokens_per_s']:.2f} | "
              f"{r['ttft_first_p50_ms']:.0f} ms | {r['ttft_first_max_ms']:.0f} ms | "
              f"{r['ttft_resumed_p50_ms']:.0f} ms | {r['ttft_resumed_p99_ms']:.0f} ms | {cached} | "
              f"{r['prompt_tokens_mean']:.0f} | {r['wall_s']:.0f} s |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
