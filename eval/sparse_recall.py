"""Recall across turns with a session kept sparse (issue 33): a fact stated first, asked for turns later.

    python eval/sparse_recall.py --trials 20 --filler-turns 6 --sparsities 0.5,0.8

See `hf_attnstore.lab.evaluation.recall` for the protocol and docs/evaluation.md for the results.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_attnstore import SparseConfig, load_default_model
from hf_attnstore.lab.evaluation.recall import recall_across_turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--filler-turns", type=int, default=6)
    parser.add_argument("--filler-tokens", type=int, default=96)
    parser.add_argument("--sparsities", default="0.5,0.8")
    parser.add_argument("--policies", default="oracle,streaming,alisa,h2o,quest,sparq",
                        help="comma-separated kv_budget policies (oracle: each query head's true top-k keys, the bound)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model(dtype="float32", device="cpu")
    variants = {"dense": None}
    for s in (float(x) for x in args.sparsities.split(",")):
        for policy in args.policies.split(","):
            variants[f"{policy} {s:.0%}"] = SparseConfig(round(1.0 - s, 6), policy=policy)
    started = time.perf_counter()
    results = recall_across_turns(model, tokenizer, variants, trials=args.trials, filler_turns=args.filler_turns,
                                  filler_tokens=args.filler_tokens)
    print(f"{args.trials} chats, the fact then {args.filler_turns} ShareGPT exchanges (messages <= "
          f"{args.filler_tokens} tokens), then the question; SmolLM2 float32 on {model.device}")
    print("| variant | recalled | code NLL (nats/token) |\n| --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r.correct}/{r.trials} | {r.nll:.3f} |")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
