"""Agents over real HTTP with the `openai` client: a tool result appended at every step, the workload whose
history grows fastest. `attnstore serve` (batching, and batch 1) against `transformers serve --continuous-batching`.

    python eval/bench_agents.py --agents 8 --steps 10 --systems attnstore,attnstore-b1,transformers-cb

Each agent starts from a ShareGPT user request (clipped to `--task-chars`) under a short agent system prompt,
then loops `--steps` times: it sends the whole conversation (streaming, greedy, `--max-tokens` per reply), and
appends the reply and a tool result (a `tool` message) of 200 to 2,000 tokens of real text (Python's
documentation, as a documentation-lookup tool returns it; lengths drawn log-uniformly with a fixed seed, the same
for every system). The conversation is kept inside SmolLM2's 8,192-token window: a tool result that would take
it past `--budget` tokens is cut to fit, so no system truncates and all run the same prompts. Requests carry no
`tools` field: the bundled model's chat template does not render tools (docs/serving.md, "Tools"), and the
measure is the growing history, not the parsing. With `--remote-mbit`, each attnstore server keeps its sessions
below host memory in a Redis of its own behind a shaped link (eval/bench_recompute.py), as in issue 33's run:

    python eval/bench_agents.py --agents 4 --steps 6 --systems attnstore,attnstore-cost --host-bytes 384MiB \
        --remote-mbit 400
 All agents start together; each system is a fresh server
process on the same machine, started and stopped by this script (eval/bench_serve.py's launcher).

Reported per system: TTFT per step (time to the first streamed content, queueing included) p50/p99 over all
steps and for the last three, steps/s over the run's wall time, generated tokens/s, and the share of prompt
tokens the server reports as cached. A run in which an agent did not finish every step exits non-zero, naming
them (eval/bench_serve.py's check).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import (  # noqa: E402  (the chat benchmark's launcher, systems, turns and checks)
    IncompleteRun, check_complete, server_tiers, start, stream_turn)

from hf_attnstore.store.redis_server import free_port  # noqa: E402

SYSTEM = ("You are an agent. To answer the user, you call tools; their results follow as tool messages. "
          "Read each result, then say briefly what you will do next.")


def tasks(n: int, chars: int) -> list[str]:
    from hf_attnstore.lab.data import load_sharegpt

    out = []
    for conv in load_sharegpt(limit=8 * n, min_user_turns=1):
        first = next((m["content"] for m in conv.messages if m["role"] == "user"), "")
        if len(first) >= 80:
            out.append(first[:chars])
        if len(out) == n:
            return out
    raise ValueError(f"not enough ShareGPT requests for {n} agents")


def tool_results(agents: int, steps: int, seed: int) -> list[list[str]]:
    """Per agent and step, a tool result: 200 to 2,000 tokens (log-uniform) of Python's documentation."""
    from hf_attnstore import load_default_model
    from hf_attnstore.lab.evaluation.corpora import load_texts

    _, tokenizer = load_default_model()
    pool = load_texts("pydoc", tokenizer, 15, 2000)  # all its documents that long; drawn from at offsets
    rng = random.Random(seed)
    out = []
    for a in range(agents):
        row = []
        for s in range(steps):
            n = int(math.exp(rng.uniform(math.log(200), math.log(2000))))
            doc = pool[(a * steps + s) % len(pool)]
            at = rng.randrange(0, len(doc) - n + 1)  # another part of the document for each use
            row.append(tokenizer.decode(doc[at:at + n], skip_special_tokens=True))
        out.append(row)
    return out, tokenizer


def agent(client, model: str, a: int, task: str, results: list[str], tokenizer, args, records: list, errors: list,
          lock: threading.Lock) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    used = len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    try:
        for step, result in enumerate(results):
            record = stream_turn(client, model, messages, args.max_tokens)
            reply = record.pop("reply")
            with lock:
                records.append(dict(agent=a, step=step, **record))
            used = (record["prompt"] or used) + record["completion"] + 16
            room = args.budget - used - args.max_tokens - 16
            ids = tokenizer(result, add_special_tokens=False)["input_ids"]
            if room < len(ids):
                result = tokenizer.decode(ids[:max(0, room)])
            messages += [{"role": "assistant", "content": reply},
                         {"role": "tool", "tool_call_id": f"call_{step}", "content": result}]
    except Exception as e:  # noqa: BLE001 - recorded and reported: the run fails, not this thread alone
        with lock:
            errors.append(f"agent {a}: {type(e).__name__}: {e}")


def run(system: str, agents: int, convs, results, tokenizer, model_dir: str, args) -> dict:
    with contextlib.ExitStack() as stack:
        server_tiers(stack, system, args)
        return measure(system, agents, convs, results, tokenizer, model_dir, args)


def measure(system: str, agents: int, convs, results, tokenizer, model_dir: str, args) -> dict:
    import openai

    port = free_port()
    proc = start(system, port, model_dir, args)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=3600)
        model = client.models.list().data[0].id if system.startswith("attnstore") else model_dir
        warm = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, temperature=0)
        assert warm.choices
        records, errors, lock = [], [], threading.Lock()
        threads = [threading.Thread(target=agent, args=(client, model, a, convs[a], results[a], tokenizer, args,
                                                        records, errors, lock)) for a in range(agents)]
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
        except Exception:  # noqa: BLE001 - a server that does not stop is killed
            proc.kill()
            proc.wait(60)
    check_complete({(r["agent"], r["step"]) for r in records},
                   {(a, s) for a in range(agents) for s in range(len(results[a]))}, errors, "agent", "step")

    def pct(values, q):
        values = sorted(values)
        return 1000 * values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    ttfts = [r["ttft"] for r in records]
    late = [r["ttft"] for r in records if r["step"] >= args.steps - 3]
    cached = [r for r in records if r["cached"] is not None]
    return dict(system=system, agents=agents, steps=len(records), wall_s=wall, steps_per_s=len(records) / wall,
                tokens_per_s=sum(r["completion"] for r in records) / wall,
                ttft_p50_ms=1000 * statistics.median(ttfts), ttft_p99_ms=pct(ttfts, 0.99),
                late_ttft_p50_ms=1000 * statistics.median(late) if late else float("nan"),
                cached_share=(sum(r["cached"] for r in cached) / max(1, sum(r["prompt"] for r in cached))
                              if cached else None),
                prompt_tokens_mean=statistics.mean(r["prompt"] for r in records),
                prompt_tokens_last=statistics.mean(r["prompt"] for r in records if r["step"] == args.steps - 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--task-chars", type=int, default=600)
    p.add_argument("--budget", type=int, default=7900, help="conversation tokens at most (SmolLM2's window: 8192)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="attnstore,attnstore-b1,transformers-cb")
    p.add_argument("--json", default=None)
    # bench_serve's launcher reads these
    p.add_argument("--host-bytes", default=None)
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--cb-num-blocks", type=int, default=None)
    p.add_argument("--remote-mbit", type=int, default=None,
                   help="each attnstore server's only lower tier: a Redis behind a link of this many Mbit/s (root)")
    args = p.parse_args(argv)
    from hf_attnstore import load_default_model

    model, _ = load_default_model()
    model_dir = model.name_or_path
    del model
    convs = tasks(args.agents, args.task_chars)
    results, tokenizer = tool_results(args.agents, args.steps, args.seed)
    rows = []
    for system in args.systems.split(","):
        try:
            row = run(system, args.agents, convs, results, tokenizer, model_dir, args)
        except IncompleteRun as e:
            print(f"{system}: the run is incomplete, so nothing is reported: {e}", file=sys.stderr)
            return 1
        rows.append(row)
        print(f"{system}: {row['steps_per_s']:.3f} steps/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms", flush=True)
    print("\n| system | steps/s | tokens/s | TTFT p50 | p99 | last 3 steps p50 | cached share | mean prompt | "
          "last prompt | wall |")
    print("| --- " * 10 + "|")
    for r in rows:
        cached = f"{100 * r['cached_share']:.1f}%" if r["cached_share"] is not None else "–"
        print(f"| {r['system']} | {r['steps_per_s']:.3f} | {r['tokens_per_s']:.2f} | {r['ttft_p50_ms']:.0f} ms | "
              f"{r['ttft_p99_ms']:.0f} ms | {r['late_ttft_p50_ms']:.0f} ms | {cached} | "
              f"{r['prompt_tokens_mean']:.0f} | {r['prompt_tokens_last']:.0f} | {r['wall_s']:.0f} s |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
