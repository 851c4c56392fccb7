"""Perplexity after a context overflow, per truncation mode (the paper's Table 1 protocol, SmolLM2).

    python eval/ppl.py --texts 3 --window 1024 --score 128

Each text is a real ShareGPT conversation rendered with the chat template and cut to `window + score`
tokens. The first `window` tokens are run through an AttnStoreCache as an earlier turn; then the whole
text overflows the window and is resumed with each truncation mode, and the last `score - 1` tokens are
scored. `full` scores them with the whole context (no truncation), the upper bound.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from hf_attnstore import load_default_model
from hf_attnstore.data import load_sharegpt
from hf_attnstore.evaluation import nll_after_overflow


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=3)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--score", type=int, default=128)
    p.add_argument("--keep-first", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model(dtype=args.dtype)
    length = args.window + args.score
    texts = []
    for conv in load_sharegpt(min_user_turns=1):
        ids = tokenizer.apply_chat_template(list(conv.messages), return_tensors="pt")["input_ids"]
        if ids.shape[1] >= length:
            texts.append(ids[:, :length])
            if len(texts) == args.texts:
                break
    variants = [("full", args.keep_first), ("recompute", args.keep_first), ("decoupled", args.keep_first),
                ("decoupled", 0), ("naive", args.keep_first)]
    print(f"SmolLM2-135M {args.dtype}: {len(texts)} ShareGPT texts of {length} tokens, window {args.window}, "
          f"ratio 0.5, {args.score - 1} scored tokens each")
    print(f"{'mode':<12}{'keep_first':>11}{'PPL':>10}{'vs recompute':>14}{'time':>8}")
    ref = None
    for mode, keep in variants:
        t = time.perf_counter()
        scores = [nll_after_overflow(model, ids, context_window=args.window, score_tokens=args.score, mode=mode,
                                     keep_first=keep) for ids in texts]
        ppl = math.exp(sum(s for s, _ in scores) / sum(n for _, n in scores))
        ref = ppl if mode == "recompute" else ref
        rel = f"{100 * (ppl / ref - 1):+.1f}%" if ref else ""
        print(f"{mode:<12}{keep:>11}{ppl:>10.2f}{rel:>14}{time.perf_counter() - t:>7.1f}s")


if __name__ == "__main__":
    main()
