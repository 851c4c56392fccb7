"""What sparse window attention (`kv_budget`, ALISA) costs and saves on a resumed session, against dense reuse.

    python eval/bench_sparse.py --histories 1024,4096 --new 32 --decode 64 --reps 3

For each history length H (a real ShareGPT conversation, its KV and importance scores stored in host memory),
a turn of `--new` tokens is resumed and `--decode` tokens are generated greedily, with:

  * dense:          AttnStoreCache reusing the whole history (attention over every token);
  * alisa/streaming 80%: the same with ``kv_budget=0.2`` (the device keeps 20% of the history);
  * scoring only:   ``kv_budget=1.0`` with ALISA's policy: dense attention plus the importance scores
                    (what keeping scores costs, e.g. for ``truncation="importance"``);
  * quest/sparq 80%: query-aware selection (cache/query_aware.py): the layers hold every token and each decoding
                    step gathers 20% of the history per layer and KV head, chosen for its query.

The last column, history read per step: the KV a decoding step's attention reads, all layers. Dense and the
query-aware policies hold the whole history on the device here; a design that kept it in host memory would move
the query-aware policies' share per step (measured: the keys each step gathered), plus what chooses them (Quest:
its page summaries, 1/page_tokens of the KV, on the device; SparQ: `sketch_dims` of the keys' head_dim components
per token). The window policies read only what they keep on the device.

Reported (medians; variants in an order drawn afresh for every repetition, from `--seed`, printed): resume TTFT
(cache + prefill of the new tokens + the first token), decode tokens/s (64 tokens: a `generate` of 65 minus the
TTFT; the cache is built outside that timing, a few ms), and the KV bytes the cache holds on the device per
session after the turn, with the sessions per GiB that makes. The store keeps every token either way. A turn that
did not reuse the stored history or did not decode its tokens fails the run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from hf_attnstore import AttnStore, AttnStoreCache, SparseConfig, load_default_model
from hf_attnstore.cache.upstream import cache_kwargs
from hf_attnstore.lab.evaluation.corpora import load_texts

VARIANTS = {
    "dense": None,
    "scoring only": SparseConfig(1.0),
    "streaming 80%": SparseConfig(0.2, policy="streaming"),
    "alisa 80%": SparseConfig(0.2),
    "quest 80%": SparseConfig(0.2, policy="quest"),
    "sparq 80%": SparseConfig(0.2, policy="sparq"),
}


def held_bytes(cache: AttnStoreCache) -> int:
    """KV bytes the cache's layers hold on the device."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if getattr(layer, "keys", None)
               is not None)


@torch.no_grad()
def run_turn(model, store, session, prompt, config, decode: int) -> tuple[float, float, int, int]:
    """(TTFT s, decode s per token, bytes held, history bytes read per decoding step) of one resumed turn that
    leaves the store as it was."""
    started = time.perf_counter()
    cache = AttnStoreCache(model, store, session, prompt, kv_budget=config, save=False)
    generate = dict(do_sample=False, pad_token_id=0)
    model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=1, **generate)
    ttft = time.perf_counter() - started
    assert cache.reused_tokens > 0 and cache.shared_from is None, "the turn did not resume its session"
    cache = AttnStoreCache(model, store, session, prompt, kv_budget=config, save=False)
    started = time.perf_counter()
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=decode + 1,
                         min_new_tokens=decode + 1, **generate)
    total = time.perf_counter() - started
    assert out.shape[1] == prompt.shape[1] + decode + 1, "the turn did not decode all its tokens"
    layer = next(layer for layer in cache.layers if getattr(layer, "keys", None) is not None)
    per_token = 2 * layer.keys.shape[-1] * layer.keys.element_size()  # one token's K and V, one layer and KV head
    selection = cache.turn.selection
    if selection is not None and selection.steps:
        layers = sum(getattr(layer, "keys", None) is not None for layer in cache.layers)
        read = selection.gathered * per_token * layers // selection.steps
    else:  # each step attends to all the layers hold
        read = held_bytes(cache)
    return ttft, max(total - ttft, 1e-9) / decode, held_bytes(cache), read


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--histories", default="1024,4096")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model(dtype="float32", device="cpu")
    histories = [int(h) for h in args.histories.split(",")]
    text = load_texts("sharegpt", tokenizer, 1, max(histories) + args.new)[0]
    print(f"{type(model).__name__} float32 on {model.device}; ShareGPT ids; new {args.new} tokens, decode "
          f"{args.decode}; medians of {args.reps}")
    print("| history | variant | resume TTFT | decode tok/s | KV held on device | sessions per GiB | "
          "history read per step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for H in histories:
        store = AttnStore(host_bytes="16GiB")
        session = f"h{H}"
        # The history, stored with its ALISA scores (what a session kept sparse, or scored, leaves).
        first = AttnStoreCache(model, store, session, text[:H].view(1, -1), kv_budget=SparseConfig(1.0))
        model(first.input_ids, **cache_kwargs(first))
        first.close()
        prompt = text[: H + args.new].view(1, -1)
        rows = {name: [] for name in VARIANTS}
        orders = []
        for _ in range(args.reps):
            order = list(VARIANTS)
            rng.shuffle(order)
            orders.append(order)
            for name in order:
                rows[name].append(run_turn(model, store, session, prompt, VARIANTS[name], args.decode))
        for name, runs in rows.items():
            ttft = statistics.median(r[0] for r in runs)
            per_token = statistics.median(r[1] for r in runs)
            held, read = runs[0][2], runs[0][3]
            print(f"| {H} | {name} | {1000 * ttft:.0f} ms | {1 / per_token:.1f} | {held / 2**20:.1f} MiB | "
                  f"{2**30 / held:.0f} | {read / 2**20:.2f} MiB |", flush=True)
        store.close()
        print(f"  history {H}, order of the variants per repetition (seed {args.seed}): "
              + " | ".join(", ".join(o) for o in orders))
    return 0


if __name__ == "__main__":
    sys.exit(main())
