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
  * quest/sparq 80% host: the same with ``history_on_host=True`` (cache/host_history.py): the history stays in
                    host memory; the device keeps the sinks, the recent window on and what chooses (Quest: its page
                    summaries; SparQ: every key), and each decoding step copies its chosen rows from the host.

`--variants` picks some of them (comma-separated names, as printed).

Columns: device bytes per session, after the turn: the KV rows the layers keep on the device, Quest's page
summaries, and the buffer a step gathers into (one, shared by the layers); sessions per GiB and sessions in dense's
memory (how many such sessions fit in the device bytes of one dense session, dense measured in the same run: the
batch rows at equal memory) follow from it. History read per step: the KV a decoding step's attention reads, all layers (the query-aware policies: the
keys each step gathered). Moved from host per step: the bytes a decoding step copied from host memory, all layers
(the chosen rows: keys and values for Quest, values for SparQ, whose keys stay on the device; rows a window got
back); 0 where the history is on the device. On a CPU "device" and "host" are the same memory: the copies are real
copies, but what they would cost over PCIe is not measured here.

Reported (medians; variants in an order drawn afresh for every repetition, from `--seed`, printed): resume TTFT
(cache + prefill of the new tokens + the first token), decode tokens/s (64 tokens: a `generate` of 65 minus the
TTFT; the cache is built outside that timing, a few ms). The store keeps every token either way. A turn that did
not reuse the stored history or did not decode its tokens fails the run.
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
    "quest 80% host": SparseConfig(0.2, policy="quest", history_on_host=True),
    "sparq 80% host": SparseConfig(0.2, policy="sparq", history_on_host=True),
}


def held_bytes(cache: AttnStoreCache) -> int:
    """KV bytes the cache's layers hold on the device."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if getattr(layer, "keys", None)
               is not None)


def device_bytes(cache: AttnStoreCache) -> int:
    """Bytes a session keeps on the device: its layers' KV rows, Quest's page summaries and, with the history on the
    host, the buffers a step gathers into (one set, shared by the layers)."""
    selection = cache.turn.selection
    summaries = 0 if selection is None else sum(s.nbytes for s in selection.summaries.values())
    hosts = [] if selection is None else list(selection.host.values())
    buffers = {id(h.buffers): h.buffers.device_nbytes for h in hosts}
    return held_bytes(cache) + summaries + sum(buffers.values())


def moved_per_step(cache: AttnStoreCache) -> int:
    """Bytes a decoding step copied from host memory, all layers (0: the history is on the device)."""
    selection = cache.turn.selection
    hosts = [] if selection is None else list(selection.host.values())
    if not hosts or not hosts[0].steps:
        return 0
    return sum(h.step_bytes + h.refill_bytes for h in hosts) // hosts[0].steps


@torch.no_grad()
def run_turn(model, store, session, prompt, config, decode: int) -> tuple[float, float, int, int, int]:
    """(TTFT s, decode s per token, device bytes, history bytes read per decoding step, bytes moved from the host
    per decoding step) of one resumed turn that leaves the store as it was."""
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
    return ttft, max(total - ttft, 1e-9) / decode, device_bytes(cache), read, moved_per_step(cache)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--histories", default="1024,4096")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    args = parser.parse_args()
    variants = [name.strip() for name in args.variants.split(",")]
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown --variants {unknown}; choose among: {', '.join(VARIANTS)}")
    rng = random.Random(args.seed)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model(dtype="float32", device="cpu")
    histories = [int(h) for h in args.histories.split(",")]
    text = load_texts("sharegpt", tokenizer, 1, max(histories) + args.new)[0]
    print(f"{type(model).__name__} float32 on {model.device}; ShareGPT ids; new {args.new} tokens, decode "
          f"{args.decode}; medians of {args.reps}")
    print("| history | variant | resume TTFT | decode tok/s | device bytes per session | sessions per GiB | "
          "sessions in dense's memory | history read per step | moved from host per step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for H in histories:
        store = AttnStore(host_bytes="16GiB")
        session = f"h{H}"
        # The history, stored with its ALISA scores (what a session kept sparse, or scored, leaves).
        first = AttnStoreCache(model, store, session, text[:H].view(1, -1), kv_budget=SparseConfig(1.0))
        model(first.input_ids, **cache_kwargs(first))
        first.close()
        prompt = text[: H + args.new].view(1, -1)
        rows = {name: [] for name in variants}
        orders = []
        for _ in range(args.reps):
            order = list(variants)
            rng.shuffle(order)
            orders.append(order)
            for name in order:
                rows[name].append(run_turn(model, store, session, prompt, VARIANTS[name], args.decode))
        dense = rows["dense"][0][2] if "dense" in rows else None
        for name, runs in rows.items():
            ttft = statistics.median(r[0] for r in runs)
            per_token = statistics.median(r[1] for r in runs)
            held, read, moved = runs[0][2], runs[0][3], runs[0][4]
            fit = "—" if dense is None else f"{dense / held:.1f}"
            print(f"| {H} | {name} | {1000 * ttft:.0f} ms | {1 / per_token:.1f} | {held / 2**20:.1f} MiB | "
                  f"{2**30 / held:.0f} | {fit} | {read / 2**20:.2f} MiB | {moved / 2**20:.2f} MiB |", flush=True)
        store.close()
        print(f"  history {H}, order of the variants per repetition (seed {args.seed}): "
              + " | ".join(", ".join(o) for o in orders))
    return 0


if __name__ == "__main__":
    sys.exit(main())
