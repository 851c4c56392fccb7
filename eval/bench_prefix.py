"""Prefix sharing (issue 31): seven sessions whose prompts start with one shared system prompt of real prose.

    python eval/bench_prefix.py --system 1200 --question 40 --sessions 7 --new 16
    python eval/bench_prefix.py ... --disk /tmp/prefix-kv   # with a disk tier: its bytes too

The system prompt is the first `--system` tokens of a real ShareGPT conversation (the bundled dataset); each
session appends its own `--question` tokens (the next conversations' openings). For every session: the tokens it
reuses, whether its greedy reply equals recomputation's (fp32), its TTFT (prompt to first token) with sharing, and
the host bytes the store holds after it. The peer is the same store with ``share_prefixes=False`` (every new
session recomputes the system prompt), run in the same process, interleaved session by session in an order drawn
afresh for each session (from `--seed`; printed). With `--disk`,
both stores have a disk tier (flushed after each session, outside the timings), and the disk bytes are reported
as the store counts them and as the file system holds them (each file once, however many names it has).

The run fails unless every greedy reply equals recomputation's, every session after the first reused at least the
system prompt with sharing, and none reused anything without it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

from hf_attnstore import AttnStore, AttnStoreCache, cache_kwargs, load_default_model
from hf_attnstore.lab.evaluation.corpora import load_texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--system", type=int, default=1200)
    parser.add_argument("--question", type=int, default=40)
    parser.add_argument("--sessions", type=int, default=7)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--disk", help="a folder for the two stores' disk tiers")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="the stores' chunk_tokens (the disk's sharing unit)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stores' order for each session")
    args = parser.parse_args()
    rng, orders, problems = random.Random(args.seed), [], []
    torch.manual_seed(0)
    model, tokenizer = load_default_model()
    texts = load_texts("sharegpt", tokenizer, args.sessions + 1, max(args.system, args.question))
    system = texts[0][: args.system]
    prompts = [torch.cat([system, t[: args.question]]).view(1, -1) for t in texts[1:]]
    root = Path(args.disk) if args.disk else None
    disk = (lambda name: {"disk_dir": str(root / name), "fsync": False, "chunk_tokens": args.chunk_tokens}) if root \
        else (lambda name: {})
    stores = {"shared": AttnStore(host_bytes="4GiB", **disk("shared")),
              "unshared": AttnStore(host_bytes="4GiB", share_prefixes=False, **disk("unshared"))}
    print("| session | reused (shared) | reused (unshared) | TTFT shared | TTFT unshared | same greedy tokens as "
          "recomputation | host bytes shared | host bytes unshared |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, ids in enumerate(prompts):
        row = {}
        reference = model.generate(ids, max_new_tokens=args.new, do_sample=False)[0, ids.shape[1]:]
        order = list(stores)
        rng.shuffle(order)
        orders.append(order)
        for name in order:
            store = stores[name]
            with torch.no_grad():
                t = time.perf_counter()
                cache = AttnStoreCache(model, store, f"s{i}", ids)
                model(cache.input_ids[:, cache.get_seq_length():], **cache_kwargs(cache), use_cache=True)
                ttft = time.perf_counter() - t
                reused = cache.reused_tokens
                del cache
                cache = AttnStoreCache(model, store, f"check-{name}-{i}", ids, save=False)
                out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=args.new,
                                     do_sample=False)[0, ids.shape[1]:]
                del cache
            store.flush()
            row[name] = (reused, ttft, torch.equal(out, reference), store.stats().host_bytes_used)
        s, u = row["shared"], row["unshared"]
        if not (s[2] and u[2]):
            problems.append(f"session {i + 1}: greedy tokens differ from recomputation's")
        if (i > 0 and s[0] < args.system) or u[0] != 0:
            problems.append(f"session {i + 1}: reused {s[0]} tokens with sharing, {u[0]} without")
        print(f"| {i + 1} | {s[0]} | {u[0]} | {s[1] * 1e3:.0f} ms | {u[1] * 1e3:.0f} ms | {s[2] and u[2]} | "
              f"{s[3] / 2**20:.1f} MiB | {u[3] / 2**20:.1f} MiB |")
    print("order of the stores per session (seed %d): %s" % (args.seed, " | ".join(", ".join(o) for o in orders)))
    for name, store in stores.items():
        stats = store.stats()
        print(f"{name}: {stats.sessions} sessions, host {stats.host_bytes_used / 2**20:.1f} MiB, "
              f"prefix hits {stats.prefix_hits}")
        if root is not None:
            print(f"{name}: disk {stats.disk_bytes_used / 2**20:.1f} MiB counted by the store, "
                  f"{_du(root / name) / 2**20:.1f} MiB on the file system")
        store.close()
    if problems:
        print("failed: " + "; ".join(problems), file=sys.stderr)
    return 1 if problems else 0


def _du(folder: Path) -> int:
    """Bytes the folder's files occupy, in 4 KiB blocks, each file once (hard links counted once, as `du`)."""
    seen, total = set(), 0
    for path in folder.rglob("*"):
        st = os.lstat(path)
        if path.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += -(-st.st_size // 4096) * 4096
    return total


if __name__ == "__main__":
    sys.exit(main())
