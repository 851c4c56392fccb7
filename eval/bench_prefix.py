"""Prefix sharing (issue 31): seven sessions whose prompts start with one shared system prompt of real prose.

    python eval/bench_prefix.py --system 1200 --question 40 --sessions 7 --new 16

The system prompt is the first `--system` tokens of a real ShareGPT conversation (the bundled dataset); each
session appends its own `--question` tokens (the next conversations' openings). For every session: the tokens it
reuses, whether its greedy reply equals recomputation's (fp32), its TTFT (prompt to first token) with sharing, and
the host bytes the store holds after it. The peer is the same store with ``share_prefixes=False`` (every new
session recomputes the system prompt), run in the same process, interleaved session by session.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_attnstore import AttnStore, AttnStoreCache, cache_kwargs, load_default_model
from hf_attnstore.lab.evaluation.corpora import load_texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--system", type=int, default=1200)
    parser.add_argument("--question", type=int, default=40)
    parser.add_argument("--sessions", type=int, default=7)
    parser.add_argument("--new", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_default_model()
    texts = load_texts("sharegpt", tokenizer, args.sessions + 1, max(args.system, args.question))
    system = texts[0][: args.system]
    prompts = [torch.cat([system, t[: args.question]]).view(1, -1) for t in texts[1:]]
    stores = {"shared": AttnStore(host_bytes="4GiB"), "unshared": AttnStore(host_bytes="4GiB", share_prefixes=False)}
    print("| session | reused (shared) | reused (unshared) | TTFT shared | TTFT unshared | same greedy tokens as "
          "recomputation | host bytes shared | host bytes unshared |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, ids in enumerate(prompts):
        row = {}
        reference = model.generate(ids, max_new_tokens=args.new, do_sample=False)[0, ids.shape[1]:]
        for name, store in stores.items():
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
            row[name] = (reused, ttft, torch.equal(out, reference), store.stats().host_bytes_used)
        s, u = row["shared"], row["unshared"]
        print(f"| {i + 1} | {s[0]} | {u[0]} | {s[1] * 1e3:.0f} ms | {u[1] * 1e3:.0f} ms | {s[2] and u[2]} | "
              f"{s[3] / 2**20:.1f} MiB | {u[3] / 2**20:.1f} MiB |")
    for name, store in stores.items():
        stats = store.stats()
        print(f"{name}: {stats.sessions} sessions, host {stats.host_bytes_used / 2**20:.1f} MiB, "
              f"prefix hits {stats.prefix_hits}")


if __name__ == "__main__":
    main()
