"""The cache's hot path: decoding through AttnStoreCache vs a DynamicCache, and resuming from the host tier.

    python eval/bench_decode.py --prompt 64 --new 128 --reps 5            # decode
    python eval/bench_decode.py --resume --history 2048 --new 128 --reps 9  # resume vs the ideal

Both variants run greedy `generate` of exactly `--new` tokens after the same prompt, once per repetition in an
order drawn afresh each time (from `--seed`; printed: this machine drifts); medians and minimums are reported.
The store variant keeps the session in the host tier (no disk), so this measures the cache's own hot path:
un-rotating the new keys and handing them to the store after every forward. Each repetition has a prompt of its
own: with one prompt for all, prefix sharing would let a later session start from an earlier one's stored prompt
(a cache hit instead of the prefill the DynamicCache does), and a turn that reuses anything fails the run. With
`--resume`, every resume has new tokens of its own and must reuse exactly its own session's history.
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
from hf_attnstore.cache.upstream import cache_kwargs

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import Resumes, check_resume, history_snapshot, ideal_prefill, interleaved, orders_line  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--resume", action="store_true", help="measure resuming --history tokens from the host tier")
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = load_default_model(dtype=args.dtype)
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    store = AttnStore(host_bytes="16GiB")

    def prompt(rep: int) -> torch.Tensor:  # both variants of a repetition decode after the same prompt
        g = torch.Generator().manual_seed(1000 + rep)
        return torch.randint(100, model.config.vocab_size, (1, args.prompt), generator=g).to(model.device)

    def run(variant: str, rep: int) -> float:
        ids = prompt(rep)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        if variant == "DynamicCache":
            model.generate(ids, **cache_kwargs(DynamicCache()), **gen)
        else:
            with AttnStoreCache(model, store, f"s{rep}", ids) as cache:
                model.generate(cache.input_ids, **cache_kwargs(cache), **gen)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        assert variant == "DynamicCache" or cache.reused_tokens == 0, f"the turn reused {cache.reused_tokens} tokens"
        return seconds

    # The wall-clock difference of two ~5 s runs drowns in this machine's drift (+-5-10%), so the cache's own
    # work is also timed directly: every call of its forward hooks (before and after each forward, and each
    # layer's update), as a share of the whole generate.
    # Layers' `update` is timed too (for both caches: the ideal's concatenation is the baseline), counting
    # only the outermost timed call.
    spent, depth = [0.0], [0]

    def timed(fn):
        def wrapper(*a, **k):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - t
        return wrapper

    from transformers.cache_utils import DynamicLayer

    from hf_attnstore.cache.layers import AttnStoreLayer

    from hf_attnstore.cache.load import ReuseLoader
    from hf_attnstore.cache.record import Recorder
    from hf_attnstore.cache.turn import CacheTurn

    setattr(AttnStoreCache, "__init__", timed(AttnStoreCache.__init__))
    for cls, name in ((CacheTurn, "begin_forward"), (CacheTurn, "end_forward"), (Recorder, "record"),
                      (ReuseLoader, "load_layer")):  # the layers record and load through these two directly
        setattr(cls, name, timed(getattr(cls, name)))
    for cls in (DynamicLayer, AttnStoreLayer):
        cls.update = timed(cls.update)
    if args.resume:
        return resume(model, args, spent)
    run("DynamicCache", -1), run("AttnStoreCache", -1)  # warm-up
    spent[0], hook_share = 0.0, []

    def counted(v: str):  # also records the time spent in the cache's hooks during the run
        def measure(rep: int) -> float:
            before = spent[0]
            seconds = run(v, rep)
            hook_share.append((v, spent[0] - before))
            return seconds
        return measure

    rows, orders = interleaved({v: counted(v) for v in ("DynamicCache", "AttnStoreCache")}, args.reps, args.seed)
    base = statistics.median(rows["DynamicCache"])
    print(f"{model.config.model_type} {args.dtype} on {model.device}, {torch.get_num_threads()} threads; prompt "
          f"{args.prompt} (one per repetition), {args.new} new tokens, {args.reps} reps")
    print(f"  {orders_line(orders, args.seed)}")
    for v, xs in rows.items():
        print(f"  {v:<15} median {statistics.median(xs):7.3f} s  min {min(xs):7.3f} s   "
              f"{statistics.median(xs) / base:6.3f} x (median)  {min(xs) / min(rows['DynamicCache']):6.3f} x (min)")
    own = statistics.median([x for v, x in hook_share if v == "AttnStoreCache"])
    dyn = statistics.median([x for v, x in hook_share if v == "DynamicCache"])
    print(f"  time in the cache: AttnStoreCache {1000 * own:.0f} ms, DynamicCache {1000 * dyn:.0f} ms (its updates): "
          f"{100 * (own - dyn) / base:.2f}% of the DynamicCache generate beyond it")
    return 0


def resume(model, args, spent) -> int:
    """One prefill of `--new` tokens after `--history` tokens: KV resident in a DynamicCache (the ideal) vs a
    session in the host tier (loaded and re-rotated layer by layer), interleaved."""
    H, N = args.history, args.new
    history = torch.randint(100, model.config.vocab_size, (1, H), generator=torch.Generator().manual_seed(0))
    history = history.to(model.device)
    prompts = Resumes(history, N, model.config.vocab_size)
    resident, fp, snapshot = history_snapshot(model, history, H)
    store = AttnStore(host_bytes="16GiB")

    def ideal(_):
        return ideal_prefill(model, resident, prompts.next()[:, H:])

    def host(rep):
        with store.open_turn(f"h{rep}", fp, None, torch.arange(0)) as writer:
            writer.append(*snapshot)
        prompt = prompts.next()
        t = time.perf_counter()
        with AttnStoreCache(model, store, f"h{rep}", prompt) as cache:
            model(cache.input_ids[:, H:], **cache_kwargs(cache))
        seconds = time.perf_counter() - t
        check_resume(cache, H, ("host",))
        return seconds

    ideal(0), host(-1)
    share = {"ideal": [], "AS-host": []}

    def counted(name, fn):  # also records the time spent in the cache's hooks during the run
        def run(rep):
            before = spent[0]
            elapsed = fn(rep)
            share[name].append(spent[0] - before)
            return elapsed
        return run

    rows, orders = interleaved({"ideal": counted("ideal", ideal), "AS-host": counted("AS-host", host)}, args.reps,
                               args.seed)
    print(f"resume {H} + {N} new tokens (drawn afresh for every turn) from the host tier, {args.reps} interleaved reps")
    print(f"  {orders_line(orders, args.seed)}")
    for v, xs in rows.items():
        print(f"  {v:<8} median {1000 * statistics.median(xs):7.1f} ms  min {1000 * min(xs):7.1f} ms   "
              f"{statistics.median(xs) / statistics.median(rows['ideal']):6.3f} x (median)  "
              f"{min(xs) / min(rows['ideal']):6.3f} x (min)")
    own, base = statistics.median(share["AS-host"]), statistics.median(share["ideal"])
    print(f"  time in the cache: AS-host {1000 * own:.1f} ms (lookup, load, re-rotation into the layer, saving), "
          f"ideal {1000 * base:.1f} ms (its concatenation): {100 * (own - base) / statistics.median(rows['ideal']):.2f}%"
          " of the ideal's turn beyond it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
