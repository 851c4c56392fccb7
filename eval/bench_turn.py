"""TTFT of one turn: recomputation (RE) vs resuming from the store (AS-host) vs the ideal (KV resident).

    python eval/bench_turn.py --history 2048 --new 128 --reps 5

Each repetition runs the three variants back to back on the same ids (interleaved, so machine noise hits
them alike) and the medians are reported. TTFT here is the wall time of the prefill forward that produces
the first token's logits, plus, for AS, building the cache (store lookup, reuse plan); KV loading and RoPE
re-application happen layer by layer inside that forward.
  * RE:    a fresh DynamicCache, prefill history + new tokens.
  * ideal: a DynamicCache already holding the history's KV (as if it never left the device), prefill new.
  * AS:    AttnStoreCache over an AttnStore whose host tier holds the session, prefill new (and save it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, load_default_model


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = load_default_model(dtype=args.dtype)
    H, N = args.history, args.new
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (1, H + N), generator=gen).to(model.device)
    store = AttnStore(host_bytes="8GiB")
    resident = DynamicCache()
    model(ids[:, :H], past_key_values=resident)
    model(ids[:, :8])  # warm-up
    rows = {"RE": [], "ideal": [], "AS-host": [], "AS-load-only": []}
    for rep in range(args.reps):
        session = f"bench-{rep}"
        seed = AttnStoreCache(model, store, session, ids[:, :H])
        model(seed.input_ids, past_key_values=seed)  # untimed: puts the history in the host tier

        t, _ = timed(lambda: model(ids, past_key_values=DynamicCache()))
        rows["RE"].append(t)

        ideal = DynamicCache()
        for i, layer in enumerate(resident.layers):
            ideal.update(layer.keys.clone(), layer.values.clone(), i)
        t, _ = timed(lambda: model(ids[:, H:], past_key_values=ideal))
        rows["ideal"].append(t)

        def resume():
            cache = AttnStoreCache(model, store, session, ids)
            assert cache.reused_tokens == H
            model(cache.input_ids[:, H:], past_key_values=cache)

        t, _ = timed(resume)
        rows["AS-host"].append(t)

        probe = AttnStoreCache(model, store, f"bench-{rep}", ids[:, : H + 1])
        t, _ = timed(lambda: [probe._load_layer(i, H, model.dtype, model.device) for i in range(len(probe.layers))])
        rows["AS-load-only"].append(t)
        store.delete(session)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"SmolLM2-135M {args.dtype}, history {H}, new {N}, {args.reps} reps, device {model.device}, "
          f"{torch.get_num_threads()} threads")
    for k, v in med.items():
        print(f"  {k:<13} median {1000 * v:8.1f} ms   (min {1000 * min(rows[k]):.1f}, max {1000 * max(rows[k]):.1f})")
    print(f"  AS-host / ideal = {med['AS-host'] / med['ideal']:.3f}   RE / AS-host = {med['RE'] / med['AS-host']:.2f}x")
    print(f"  loading {H} tokens x {len(resident.layers)} layers with RoPE re-applied: "
          f"{1000 * med['AS-load-only']:.1f} ms ({100 * med['AS-load-only'] / med['ideal']:.0f}% of ideal TTFT, "
          "done layer by layer inside the AS-host forward)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "median_s": med, "all_s": rows}, f, indent=2)


if __name__ == "__main__":
    main()
