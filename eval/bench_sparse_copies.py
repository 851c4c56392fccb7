"""Sparse cold copies (`StoreConfig.sparse_copies`, ALISA): disk bytes per session, and the turn resumed from them.

    python eval/bench_sparse_copies.py --sessions 6 --history 1536 --new 32 --decode 32

For each of `--sessions` ShareGPT conversations (chat template, cut to `--history` tokens), turn 1 prefills the
history and decodes `--decode` tokens with ``kv_budget=0.2`` (ALISA), on a store with a disk tier holding
whole copies, sparse copies, int8 copies, or sparse int8 copies (`--chunk` tokens per chunk). The store is then
closed and reopened, so turn 2 resumes the session from disk: the conversation's next `--new` tokens after turn 1's
reply, `--decode` tokens decoded with the same budget.

Reported per copy: chunk bytes on disk per session (the state file with scores and selection not counted: the
same for every copy), turn 2's resume TTFT (median; the files were just written, so they are in the page cache),
the share of sessions whose turn-2 tokens equal those resumed from the whole copy, the tokens a sparse turn
reuses and those a dense turn reuses from the same copy. The run fails unless every sparse turn 2 reused stored KV,
and the lossless sparse copy gave every session the whole copy's turn-2 tokens (what the copy lacks is what the
turn's first forward drops). The temporary folders are removed also when a run fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_attnstore import AttnStore, AttnStoreCache, SparseConfig, load_default_model
from hf_attnstore.cache.upstream import cache_kwargs
from hf_attnstore.lab.evaluation.corpora import load_texts

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import scratch_folder  # noqa: E402

COPIES = {
    "whole": {},
    "sparse": {"sparse_copies": True},
    "int8": {"kv_codec": "int8"},
    "sparse + int8": {"sparse_copies": True, "kv_codec": "int8"},
}
GREEDY = dict(do_sample=False, pad_token_id=0)


def chunk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors") if not p.name.startswith("s-"))


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--history", type=int, default=1536)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()
    model, tokenizer = load_default_model(dtype="float32", device="cpu")
    texts = load_texts("sharegpt", tokenizer, args.sessions, args.history + args.new)
    config = SparseConfig(args.budget)
    print(f"{type(model).__name__} float32 on {model.device}; {args.sessions} ShareGPT sessions of {args.history} "
          f"tokens; kv_budget={args.budget} (ALISA); chunks of {args.chunk}; turn 2: {args.new} new tokens, "
          f"{args.decode} decoded")
    results, reference, problems = {}, {}, []
    for name, options in COPIES.items():
        with scratch_folder(None, "attnstore-sparse-copies-") as root:
            make = lambda: AttnStore("16GiB", root, chunk_tokens=args.chunk, fsync=False, **options)  # noqa: E731
            ttfts, same, reused, dense = [], 0, [], []
            for i, text in enumerate(texts):
                sid = f"c{i}"
                with make() as store:
                    cache = AttnStoreCache(model, store, sid, text[: args.history].view(1, -1), kv_budget=config)
                    first = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=args.decode, **GREEDY)
                    cache.close()
                    store.flush()
                prompt = torch.cat([first, text[args.history :].view(1, -1)], dim=1)
                with make() as store:
                    started = time.perf_counter()
                    cache = AttnStoreCache(model, store, sid, prompt, kv_budget=config, save=False)
                    model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=1, **GREEDY)
                    ttfts.append(time.perf_counter() - started)
                    cache = AttnStoreCache(model, store, sid, prompt, kv_budget=config, save=False)
                    second = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=args.decode,
                                            **GREEDY)
                    reused.append(cache.reused_tokens / (prompt.shape[1] - 1))
                    dense_cache = AttnStoreCache(model, store, sid, prompt, save=False)
                    dense.append(dense_cache.reused_tokens / (prompt.shape[1] - 1))
                if name == "whole":
                    reference[sid] = second
                same += torch.equal(second, reference[sid])
            results[name] = (chunk_bytes(root) / len(texts), statistics.median(ttfts), same / len(texts),
                             statistics.mean(reused), statistics.mean(dense))
        print(f"  {name}: done", flush=True)
        if min(reused) == 0:
            problems.append(f"a sparse turn 2 reused nothing of its {name} copy")
        if name == "sparse" and same != len(texts):
            problems.append(f"turn 2 from the sparse copy differs from the whole copy's in {len(texts) - same} "
                            "sessions")
    whole = results["whole"][0]
    print("| copy | chunk bytes per session | vs whole | resume TTFT | turn 2 = whole copy's | sparse turn reuses "
          "| dense turn reuses |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (size, ttft, same, reused, dense) in results.items():
        print(f"| {name} | {size / 2**20:.1f} MiB | {size / whole:.2f} | {1000 * ttft:.0f} ms | {100 * same:.0f}% "
              f"| {100 * reused:.0f}% | {100 * dense:.0f}% |")
    if problems:
        print("failed: " + "; ".join(problems), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
