"""Batched turns vs solo turns on SmolLM2 and real ShareGPT messages: identical replies, per dtype.

    python eval/batch_fidelity.py --sessions 8 --turns 3 --dtypes float32,bfloat16
    python eval/batch_fidelity.py --dtypes float32 --max-batch-tokens 64     # with chunked prefill
    python eval/batch_fidelity.py --dtypes float32 --sessions 8 --turns 1 \
        --options '{"repetition_penalty": 1.6, "no_repeat_ngram_size": 2, "min_new_tokens": 20}'

The same conversations run through a ChatPipeline twice: one turn at a time (`max_batch_size=1`) and
with continuous batching (`--batch`), each over a fresh store, greedy. All sessions' turns of one round
are submitted together, so the batched run decodes them together. `--options`: `generate` options (JSON) for
both runs. Prints how many turns have identical
generated ids, and the first differing step of those that do not.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hf_attnstore import AttnStore, ChatPipeline, load_default_model
from hf_attnstore.cache.chat import clip_text
from hf_attnstore.lab.data import load_sharegpt


def run(model, tokenizer, conversations, batch: int, max_new: int, max_batch_tokens: int | None = None,
        options: dict | None = None) -> dict:
    out = {}
    with AttnStore(host_bytes="8GiB") as store, \
            ChatPipeline(model, tokenizer, store, max_new_tokens=max_new, max_batch_size=batch,
                         max_batch_tokens=max_batch_tokens, **(options or {})) as pipe:
        for k in range(max(len(c) for c in conversations)):
            futures = {i: pipe.submit(f"s{i}", c[k]) for i, c in enumerate(conversations) if k < len(c)}
            for i, f in futures.items():
                out[(i, k)] = f.result(1200).generated_ids
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-user-tokens", type=int, default=128)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="chunked prefill in the batched run")
    p.add_argument("--options", default="{}", help="generate options for both runs, as JSON")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    ok = True
    print("| dtype | turns | identical to solo | first differing steps |")
    print("| --- | --- | --- | --- |")
    for dtype in args.dtypes.split(","):
        model, tokenizer = load_default_model(dtype=dtype)
        convs = [[clip_text(tokenizer, m["content"], args.max_user_tokens) for m in c.messages if m["role"] == "user"]
                 [: args.turns] for c in load_sharegpt(limit=args.sessions, min_user_turns=2)]
        options = json.loads(args.options)
        solo = run(model, tokenizer, convs, 1, args.max_new_tokens, options=options)
        batched = run(model, tokenizer, convs, args.batch, args.max_new_tokens, args.max_batch_tokens, options)
        same = sum(solo[key] == batched[key] for key in solo)
        firsts = sorted(next((s for s, (a, b) in enumerate(zip(solo[key], batched[key])) if a != b),
                             min(len(solo[key]), len(batched[key])))
                        for key in solo if solo[key] != batched[key])
        print(f"| {dtype} | {len(solo)} | {same}/{len(solo)} | {firsts or '-'} |", flush=True)
        ok &= dtype != "float32" or same == len(solo)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
