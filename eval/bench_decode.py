"""Decoding through AttnStoreCache vs a plain DynamicCache: what saving every token costs.

    python eval/bench_decode.py --prompt 64 --new 128 --reps 5

Both variants run greedy `generate` of exactly `--new` tokens after the same prompt, interleaved per
repetition (this machine drifts); medians and minimums are reported. The store variant keeps the session
in the host tier (no disk), so this measures the cache's own hot path: un-rotating the new keys and
handing them to the store after every forward.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, load_default_model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = load_default_model(dtype=args.dtype)
    ids = torch.randint(100, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    store = AttnStore(host_bytes="16GiB")

    def run(variant: str, rep: int) -> float:
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        if variant == "DynamicCache":
            model.generate(ids, past_key_values=DynamicCache(), **gen)
        else:
            with AttnStoreCache(model, store, f"s{rep}", ids) as cache:
                model.generate(cache.input_ids, past_key_values=cache, **gen)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run("DynamicCache", -1), run("AttnStoreCache", -1)  # warm-up
    rows = {"DynamicCache": [], "AttnStoreCache": []}
    for rep in range(args.reps):
        order = list(rows)
        random.Random(rep).shuffle(order)
        for v in order:
            rows[v].append(run(v, rep))
    base = statistics.median(rows["DynamicCache"])
    print(f"{model.config.model_type} {args.dtype} on {model.device}, {torch.get_num_threads()} threads; prompt "
          f"{args.prompt}, {args.new} new tokens, {args.reps} reps")
    for v, xs in rows.items():
        print(f"  {v:<15} median {statistics.median(xs):7.3f} s  min {min(xs):7.3f} s   "
              f"{statistics.median(xs) / base:6.3f} x (median)  {min(xs) / min(rows['DynamicCache']):6.3f} x (min)")


if __name__ == "__main__":
    main()
