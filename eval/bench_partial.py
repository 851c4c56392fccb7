"""What a partially evicted session costs to resume: AS-disk TTFT per dropped head (issue 14).

    python eval/bench_partial.py --history 2048 --new 128 --reps 5 --heads 0,256,512,1024,1536

Sessions of `--history` tokens (SmolLM2's KV of one prefill) are written to a disk tier; then each loses
its first `head` tokens' chunks, as partial eviction drops them (`Eviction.drop_disk_head`, the store's own
bookkeeping and file operations). RE and every head run once per repetition, in an order drawn afresh each time
(from `--seed`; printed), and are reported as medians:

  ttft   a store reopened on the folder (the session on disk only, its pages dropped from the page cache),
         the turn's cache built (the head recomputed while the rest loads) and the `--new` tokens prefilled;
         next to recomputation (RE) of history + new.
  disk   the session's bytes on disk.

Every measured resume has new tokens of its own (a repeated prompt would be served by prefix sharing from the
session that stored it first: a cache hit, not a resume) and fails the run unless it reused exactly its own
session's history from disk, with the head recomputed. The temporary folder is removed also when a run fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, load_default_model
from hf_attnstore.store.format import session_dirname

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import (  # noqa: E402
    Resumes, check_resume, drop_page_cache, history_snapshot, interleaved, orders_line, scratch_folder)
from hf_attnstore.cache.upstream import cache_kwargs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--heads", default="0,256,512,1024,1536")
    p.add_argument("--chunk", type=int, default=256, help="chunk_tokens of the disk tier (the unit dropped)")
    p.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    args = p.parse_args(argv)
    heads = [int(h) for h in args.heads.split(",")]
    if any(h % args.chunk or not 0 <= h < args.history for h in heads):
        raise SystemExit(f"--heads must be multiples of --chunk ({args.chunk}) below --history")
    torch.set_grad_enabled(False)
    model, _ = load_default_model()
    with scratch_folder(None, "attnstore-partial-") as root:
        run(model, args, heads, root)
    return 0


def run(model, args, heads: list[int], root: Path) -> None:
    H, R = args.history, args.reps
    history = torch.randint(100, model.config.vocab_size, (1, H), generator=torch.Generator().manual_seed(0))
    prompts = Resumes(history, args.new, model.config.vocab_size)
    _, fp, snapshot = history_snapshot(model, history, H)
    opts = dict(host_bytes="16GiB", chunk_tokens=args.chunk)
    disk = {}
    for head in heads:
        folder = root / str(head)
        with AttnStore(disk_dir=str(folder), partial_eviction=True, **opts) as store:
            for i in range(R):
                with store.open_turn(f"s{i}", fp, None, torch.arange(0)) as w:
                    w.append(*snapshot)
            store.flush()
            with store._index.cond:
                for i in range(R):
                    e = store._index.entries[(fp, f"s{i}")]
                    for _ in range(head // args.chunk):
                        store._eviction.drop_disk_head(e)
                deletes = store._index.take_deletes()
            store._eviction.run_deletes(deletes)
        disk[head] = sum(f.stat().st_size for f in (folder / "sessions" / session_dirname(fp, "s0")).iterdir())
    model(history[:, :8])  # warm-up

    def recompute(rep: int) -> float:
        t = time.perf_counter()
        model(prompts.next(), **cache_kwargs(DynamicCache()))
        return time.perf_counter() - t

    def resume(head: int):
        def measure(rep: int) -> float:
            with AttnStore(disk_dir=str(root / str(head)), partial_eviction=True, **opts) as store:
                drop_page_cache(root / str(head) / "sessions" / session_dirname(fp, f"s{rep}"))
                prompt = prompts.next()
                t = time.perf_counter()
                cache = AttnStoreCache(model, store, f"s{rep}", prompt)
                model(cache.input_ids[:, H:], **cache_kwargs(cache))
                seconds = time.perf_counter() - t
                check_resume(cache, H, ("disk",))
                assert cache.recomputed_head == head, f"recomputed a head of {cache.recomputed_head}, not {head}"
                cache.close()
                store.close(flush=False)
            return seconds
        return measure

    rows, orders = interleaved({"RE": recompute, **{head: resume(head) for head in heads}}, R, args.seed)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"SmolLM2-135M fp32 on {model.device}, {torch.get_num_threads()} threads; history {H} + new {args.new} "
          f"(drawn afresh for every turn), chunks of {args.chunk} tokens, {R} reps (medians)\n"
          f"{orders_line([[str(v) for v in o] for o in orders], args.seed)}\n")
    print("| dropped head | bytes on disk | AS-disk TTFT | vs whole session | vs RE |\n| --- | --- | --- | --- | --- |")
    for head in heads:
        print(f"| {head} | {disk[head] / 1e6:.1f} MB | {1000 * med[head]:,.0f} ms | "
              f"{med[head] / med[heads[0]]:.2f}x | {med[head] / med['RE']:.2f}x |")
    print(f"\nRE (recomputing all {H + args.new} tokens): {1000 * med['RE']:,.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
