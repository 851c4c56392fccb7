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

With `--tools` (issue 46), the agents call tools: every request offers two functions (`lookup_docs`,
`read_section`), and the chat template is one that renders them (examples/templates/chatml_tools.jinja, with
the response template that parses the calls, hermes_response.json), given to every system:

    python eval/bench_agents.py --tools --agents 4 --steps 6 --systems attnstore,transformers-cb

Each step is two requests: a **call** (our servers force it: a named `tool_choice` at even steps, `"required"`
at odd ones, one call; `transformers serve` refuses `tool_choice`, so it gets `auto`, its only choice), then the
call and its result (the documentation text above) go back and a **reply** follows (`tool_choice: "none"` on
ours, `auto` on transformers; a call in it is answered "not run"), and the user says "Go on". A call request that returns no call, or a
call whose arguments do not satisfy its schema, is counted, and the agent goes on with the call it would have
made (`lookup_docs` with its task's first words), so every system runs the same number of requests.
`transformers serve` gets a copy of the bundled model's folder (links) whose `chat_template.jinja` and
`response_template` are those two files, so both render and parse the same format. Reported besides the above:
TTFT of call requests (to the first content or call delta: a forced call's first delta comes once its name is
written, as OpenAI streams it) and of reply requests, the share of call requests that returned a schema-valid
call, and how much of each agent's previous request (its prompt and reply) the next one reused (cached tokens
over that request's prompt and completion: the conversation sent back is that and more).
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
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import (  # noqa: E402  (the chat benchmark's launcher, systems, turns and checks)
    IncompleteRun, check_complete, server_tiers, start, stream_turn)

from hf_attnstore.lab.redis_server import free_port  # noqa: E402

FOLLOW_UP = "Go on: look up what you still need."
TEMPLATES = Path(__file__).resolve().parent.parent / "examples" / "templates"
CHAT_TEMPLATE, RESPONSE_TEMPLATE = TEMPLATES / "chatml_tools.jinja", TEMPLATES / "hermes_response.json"
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup_docs", "description": "Look a topic up in Python's documentation; returns its page.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40}},
                       "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "read_section", "description": "Read a numbered section of the page looked up last.",
        "parameters": {"type": "object", "properties": {"section": {"type": "integer", "minimum": 1, "maximum": 20}},
                       "required": ["section"], "additionalProperties": False}}},
]

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


def tool_results(agents: int, steps: int, seed: int) -> tuple[list[list[str]], object]:
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
            record.pop("calls")
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


def valid_call(call: dict) -> bool:
    """Whether a returned call is of an offered function with arguments that satisfy its schema (TOOLS)."""
    try:
        arguments = json.loads(call["arguments"])
    except (TypeError, ValueError):
        return False
    if call["name"] == "lookup_docs":
        return (isinstance(arguments, dict) and set(arguments) == {"query"} and isinstance(arguments["query"], str)
                and len(arguments["query"]) <= 40)
    if call["name"] == "read_section":
        return (isinstance(arguments, dict) and set(arguments) == {"section"} and type(arguments["section"]) is int
                and 1 <= arguments["section"] <= 20)
    return False


def reused(request: dict, previous: dict | None) -> float | None:
    """The share of the agent's previous request (its prompt and reply) that this one's cached tokens cover: the
    conversation sent back with a call, its result or a follow-up is that request's prompt and reply and more."""
    if previous is None or request["cached"] is None:
        return None
    return min(1.0, request["cached"] / max(1, previous["prompt"] + previous["completion"]))


def assistant_message(content: str, calls: list[dict]) -> dict:
    return {"role": "assistant", "content": content or None,
            "tool_calls": [{"id": c["id"] or f"call_{i}", "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]}} for i, c in enumerate(calls)]
            or None}


def tool_agent(client, model: str, a: int, task: str, results: list[str], tokenizer, args, records: list,
               errors: list, lock: threading.Lock, forced: bool) -> None:
    """One agent with tools: per step a call request, the call's result, a reply request (module docstring)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    used = len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)) + 300  # the tools
    previous = None
    fallback = {"id": None, "name": "lookup_docs", "arguments": json.dumps({"query": " ".join(task.split()[:4])[:40]})}
    try:
        for step, result in enumerate(results):
            choice = ({"tool_choice": {"type": "function", "function": {"name": "lookup_docs"}}} if step % 2 == 0
                      else {"tool_choice": "required", "parallel_tool_calls": False}) if forced else {}
            call = stream_turn(client, model, messages, args.call_tokens, tools=TOOLS, **choice)
            valid = bool(call["calls"]) and all(valid_call(c) for c in call["calls"])
            calls = call["calls"] if valid else [dict(fallback, id=f"call_{a}_{step}")]
            with lock:
                records.append(dict(agent=a, step=step, kind="call", valid=valid, reused=reused(call, previous),
                                    **{k: call[k] for k in ("ttft", "total", "prompt", "completion", "cached")}))
            previous = call
            used = (call["prompt"] or used) + call["completion"] + 16
            room = args.budget - used - args.max_tokens - 40
            ids = tokenizer(result, add_special_tokens=False)["input_ids"]
            if room < len(ids):
                result = tokenizer.decode(ids[:max(0, room)])
            messages += [assistant_message(call["reply"] if valid else "", calls),
                         {"role": "tool", "tool_call_id": calls[0]["id"], "content": result}]
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "Not run: one call per step."}
                         for c in calls[1:]]
            reply = stream_turn(client, model, messages, args.max_tokens, tools=TOOLS,
                                **({"tool_choice": "none"} if forced else {}))
            with lock:
                records.append(dict(agent=a, step=step, kind="reply", valid=None, reused=reused(reply, previous),
                                    **{k: reply[k] for k in ("ttft", "total", "prompt", "completion", "cached")}))
            previous = reply
            used = (reply["prompt"] or used) + reply["completion"] + 16
            messages.append(assistant_message(reply["reply"], reply["calls"]))
            messages += [{"role": "tool", "tool_call_id": c["id"] or f"call_{i}", "content": "Not run."}
                         for i, c in enumerate(reply["calls"])]
            messages.append({"role": "user", "content": FOLLOW_UP})
    except Exception as e:  # noqa: BLE001 - recorded and reported: the run fails, not this thread alone
        with lock:
            errors.append(f"agent {a}: {type(e).__name__}: {e}")


def templated_model_dir(model_dir: str, folder: Path) -> str:
    """A copy of `model_dir` (links to its files) whose chat template renders tools and whose tokenizer carries
    the response template that parses the calls: what `transformers serve` reads (it has no --chat-template)."""
    for f in Path(model_dir).iterdir():
        if f.name not in ("chat_template.jinja", "tokenizer_config.json"):
            (folder / f.name).symlink_to(f.resolve())
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    config["response_template"] = json.loads(RESPONSE_TEMPLATE.read_text(encoding="utf-8"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(folder)


def run(system: str, agents: int, convs, results, tokenizer, model_dir: str, args) -> dict:
    with contextlib.ExitStack() as stack:
        server_tiers(stack, system, args)
        return measure(system, agents, convs, results, tokenizer, model_dir, args)


def measure(system: str, agents: int, convs, results, tokenizer, model_dir: str, args) -> dict:
    port = free_port()
    forced = system.startswith("attnstore")
    with tempfile.TemporaryDirectory() as folder:
        if args.tools and not forced:
            model_dir = templated_model_dir(model_dir, Path(folder))
        extra = (("--chat-template", str(CHAT_TEMPLATE), "--response-template", str(RESPONSE_TEMPLATE))
                 if args.tools and forced else ())
        proc = start(system, port, model_dir, args, extra)
        return serve_agents(system, proc, port, agents, convs, results, tokenizer, model_dir, args, forced)


def serve_agents(system: str, proc, port: int, agents: int, convs, results, tokenizer, model_dir: str, args,
                 forced: bool) -> dict:
    import openai

    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=3600)
        model = client.models.list().data[0].id if system.startswith("attnstore") else model_dir
        warm = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, temperature=0)
        assert warm.choices
        records, errors, lock = [], [], threading.Lock()
        target, more = (tool_agent, (forced,)) if args.tools else (agent, ())
        threads = [threading.Thread(target=target, args=(client, model, a, convs[a], results[a], tokenizer, args,
                                                         records, errors, lock, *more)) for a in range(agents)]
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
    check_complete({(r["agent"], r["step"]) for r in records if r.get("kind") != "call"},
                   {(a, s) for a in range(agents) for s in range(len(results[a]))}, errors, "agent", "step")

    def pct(values, q):
        values = sorted(values)
        return 1000 * values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    ttfts = [r["ttft"] for r in records]
    late = [r["ttft"] for r in records if r["step"] >= args.steps - 3]
    cached = [r for r in records if r["cached"] is not None]
    steps = len({(r["agent"], r["step"]) for r in records})
    tools = {}
    if args.tools:
        calls = [r for r in records if r["kind"] == "call"]
        tools = dict(tool_choice="forced" if forced else "auto",
                     call_ttft_p50_ms=1000 * statistics.median(r["ttft"] for r in calls),
                     reply_ttft_p50_ms=1000 * statistics.median(r["ttft"] for r in records if r["kind"] == "reply"),
                     valid_calls=sum(r["valid"] for r in calls) / len(calls),
                     reused=([r["reused"] for r in records if r["reused"] is not None] or None))
        if tools["reused"]:
            tools["reused"] = statistics.mean(tools["reused"])
    return dict(system=system, agents=agents, steps=steps, requests=len(records), wall_s=wall,
                steps_per_s=steps / wall, **tools,
                tokens_per_s=sum(r["completion"] for r in records) / wall,
                ttft_p50_ms=1000 * statistics.median(ttfts), ttft_p99_ms=pct(ttfts, 0.99),
                late_ttft_p50_ms=1000 * statistics.median(late) if late else float("nan"),
                cached_share=(sum(r["cached"] for r in cached) / max(1, sum(r["prompt"] for r in cached))
                              if cached else None),
                prompt_tokens_mean=statistics.mean(r["prompt"] for r in records),
                prompt_tokens_last=statistics.mean(r["prompt"] for r in records if r["step"] == args.steps - 1))


def cell(share: float | None) -> str:
    return f"{100 * share:.1f}%" if share is not None else "–"


def chat_table(rows: list[dict]) -> None:
    print("\n| system | steps/s | tokens/s | TTFT p50 | p99 | last 3 steps p50 | cached share | mean prompt | "
          "last prompt | wall |")
    print("| --- " * 10 + "|")
    for r in rows:
        print(f"| {r['system']} | {r['steps_per_s']:.3f} | {r['tokens_per_s']:.2f} | {r['ttft_p50_ms']:.0f} ms | "
              f"{r['ttft_p99_ms']:.0f} ms | {r['late_ttft_p50_ms']:.0f} ms | {cell(r['cached_share'])} | "
              f"{r['prompt_tokens_mean']:.0f} | {r['prompt_tokens_last']:.0f} | {r['wall_s']:.0f} s |")


def tools_table(rows: list[dict]) -> None:
    print("\n| system | tool_choice | steps/s | call TTFT p50 | reply TTFT p50 | TTFT p99 | valid calls | "
          "cached share | previous request reused | mean prompt | last prompt | wall |")
    print("| --- " * 12 + "|")
    for r in rows:
        print(f"| {r['system']} | {r['tool_choice']} | {r['steps_per_s']:.3f} | {r['call_ttft_p50_ms']:.0f} ms | "
              f"{r['reply_ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | {100 * r['valid_calls']:.0f}% | "
              f"{cell(r['cached_share'])} | {cell(r['reused'])} | {r['prompt_tokens_mean']:.0f} | "
              f"{r['prompt_tokens_last']:.0f} | {r['wall_s']:.0f} s |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--task-chars", type=int, default=600)
    p.add_argument("--budget", type=int, default=7900, help="conversation tokens at most (SmolLM2's window: 8192)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tools", action="store_true", help="agents call tools: a call and a reply request per step")
    p.add_argument("--call-tokens", type=int, default=64, help="with --tools: max_tokens of a call request")
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
    (tools_table if args.tools else chat_table)(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
