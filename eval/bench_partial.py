"""What a partially evicted session costs to resume: AS-disk TTFT per dropped head (issue 14).

    python eval/bench_partial.py --history 2048 --new 128 --reps 5 --heads 0,256,512,1024,1536

Sessions of `--history` tokens (SmolLM2's KV of one prefill) are written to a disk tier; then each loses
its first `head` tokens' chunks, as partial eviction drops them (`Eviction.drop_disk_head`, the store's own
bookkeeping and file operations). Interleaved per repetition and reported as medians:

  ttft   a store reopened on the folder (the session on disk only, its pages dropped from the page cache),
         the turn's cache built (the head recomputed while the rest loads) and the `--new` tokens prefilled;
         next to recomputation (RE) of history + new.
  disk   the session's bytes on disk.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, load_default_model
from hf_attnstore.store.format import session_dirname

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import drop_page_cache, history_snapshot  # noqa: E402
from hf_attnstore.cache.upstream import cache_kwargs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--heads", default="0,256,512,1024,1536")
    p.add_argument("--chunk", type=int, default=256, help="chunk_tokens of the disk tier (the unit dropped)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = load_default_model()
    H, N, R = args.history, args.new, args.reps
    heads = [int(h) for h in args.heads.split(",")]
    if any(h % args.chunk or not 0 <= h < H for h in heads):
        raise SystemExit(f"--heads must be multiples of --chunk ({args.chunk}) below --history")
    ids = torch.randint(100, model.config.vocab_size, (1, H + N), generator=torch.Generator().manual_seed(0))
    root = Path(tempfile.mkdtemp(prefix="attnstore-partial-"))
    _, fp, snapshot = history_snapshot(model, ids, H)
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
    model(ids[:, :8])  # warm-up

    rows = {k: [] for k in ["RE"] + heads}
    for rep in range(R):
        t = time.perf_counter()
        model(ids, **cache_kwargs(DynamicCache()))
        rows["RE"].append(time.perf_counter() - t)
        for head in random.Random(rep).sample(heads, len(heads)):
            store = AttnStore(disk_dir=str(root / str(head)), partial_eviction=True, **opts)
            drop_page_cache(root / str(head) / "sessions" / session_dirname(fp, f"s{rep}"))
            t = time.perf_counter()
            cache = AttnStoreCache(model, store, f"s{rep}", ids)
            model(cache.input_ids[:, H:], **cache_kwargs(cache))
            rows[head].append(time.perf_counter() - t)
            assert cache.reused_tokens == H and cache.recomputed_head == head and cache.kv_source == "disk"
            cache.close()
            store.close(flush=False)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"SmolLM2-135M fp32 on {model.device}, {torch.get_num_threads()} threads; history {H} + new {N}, "
          f"chunks of {args.chunk} tokens, {R} reps (medians)\n")
    print("| dropped head | bytes on disk | AS-disk TTFT | vs whole session | vs RE |\n| --- | --- | --- | --- | --- |")
    for head in heads:
        print(f"| {head} | {disk[head] / 1e6:.1f} MB | {1000 * med[head]:.0f} ms | "
              f"{med[head] / med[heads[0]]:.2f}x | {med[head] / med['RE']:.2f}x |")
    print(f"\nRE (recompute {H + N} tokens) {1000 * med['RE']:.0f} ms")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
