"""Fidelity of the store's lossy codecs (issue 14), measured through the store itself.

    python eval/codec_fidelity.py --codecs int8,int4 --ppl-texts 3 --mmlu-limit 200 --turns 200

Three measurements, each against the lossless store on the same inputs, SmolLM2 fp32:

- **PPL after overflow**: `sliding_perplexity` (decoupled truncation, W = 1024, turns of 128 tokens, texts of
  3072 tokens, both corpora); with a codec, the history is flushed to a disk tier with that codec and evicted
  after every turn, so each turn resumes from the lossy copy.
- **MMLU agreement through lm-eval**: `mmlu_offline` scored by our lm-eval model with the 1023-token filler
  overflowing a 1024 window (decoupled truncation); with a codec the filler is read back from its lossy
  disk copy. Agreement = the same answer as the lossless store; KL of the answer distribution.
- **Greedy agreement on resumed ShareGPT turns**: every turn resumes from the lossy cold copy (flushed and
  evicted after each turn) and is compared token for token with recomputation.

Prints Markdown tables (docs/evaluation.md). A greedy comparison whose turns reused nothing from the cold copies
(it would compare recomputation with itself) fails the run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from hf_attnstore import load_default_model
from hf_attnstore.lab.evaluation.corpora import load_texts
from hf_attnstore.lab.evaluation.fidelity import codec_fidelity
from hf_attnstore.lab.evaluation.mmlu import agreement, mean_kl, scores_from_samples
from hf_attnstore.lab.evaluation.ppl import PerplexityResult, sliding_perplexity


def ppl_table(model, tokenizer, codecs, texts: int, length: int, window: int, chunk: int) -> None:
    for corpus in ("sharegpt", "pydoc"):
        docs = load_texts(corpus, tokenizer, texts, length)
        print(f"\nPPL after overflow, {corpus}: {len(docs)} texts of {length} tokens, W = {window}, turns of {chunk} "
              "tokens, decoupled, each turn resumed from the cold copy")
        print("| codec | PPL | vs lossless | time |\n| --- | --- | --- | --- |")
        base = None
        for codec in [None, *codecs]:
            started, total = time.perf_counter(), PerplexityResult()
            for ids in docs:
                total = total + sliding_perplexity(model, ids, context_window=window, chunk_tokens=chunk,
                                                   mode="decoupled", kv_codec=codec)
            base = base or total.ppl
            rel = "–" if codec is None else f"{100 * (total.ppl / base - 1):+.3f}%"
            print(f"| {codec or 'lossless'} | {total.ppl:.4f} | {rel} | {time.perf_counter() - started:.0f} s |",
                  flush=True)


def mmlu_table(model, tokenizer, codecs, limit: int, window: int) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from hf_attnstore.lab.evaluation.harness import TASKS_DIR, AttnStoreLM

    manager = TaskManager(include_path=str(TASKS_DIR))
    scores = {}
    for codec in [None, *codecs]:
        started = time.perf_counter()
        lm = AttnStoreLM(pretrained=model, tokenizer=tokenizer, truncation="decoupled", context_window=window,
                         kv_codec=codec)
        out = simple_evaluate(model=lm, tasks=["mmlu_offline"], limit=limit, log_samples=True,
                              task_manager=manager, bootstrap_iters=0)
        scores[codec] = scores_from_samples(codec or "lossless", out["samples"]["mmlu_offline"],
                                            time.perf_counter() - started)
    ref = scores[None]
    n = len(ref.targets)
    print(f"\nMMLU (mmlu_offline through lm-eval): {n} questions, 0-shot, filler {window - 1} tokens, W = {window}, "
          "decoupled")
    print("| codec | accuracy | agreement with lossless | mean KL vs lossless | time |\n| --- | --- | --- | --- | --- |")
    for codec, s in scores.items():
        err = math.sqrt(s.accuracy * (1 - s.accuracy) / n)
        print(f"| {codec or 'lossless'} | {100 * s.accuracy:.1f}% ± {100 * err:.1f} | {100 * agreement(s, ref):.1f}% | "
              f"{mean_kl(ref, s):.2e} | {s.seconds:.0f} s |", flush=True)


def greedy_table(model, tokenizer, codecs, turns: int) -> None:
    results = codec_fidelity(model, tokenizer, codecs, turns=turns, max_new_tokens=8, max_user_tokens=128)
    print(f"\nGreedy agreement with recomputation: {turns} resumed ShareGPT turns, 8 new tokens each, every turn "
          "resumed from the cold copy")
    print("| codec | identical greedy turns | max abs logit diff (up to the first difference) | reused / prompt "
          "tokens |\n| --- | --- | --- | --- |")
    for codec, r in results.items():
        print(f"| {codec} | {r.identical}/{r.turns} ({100 * r.identical_fraction:.1f}%) | {r.max_abs_logit_diff:.3f} | "
              f"{r.reused_tokens:,} / {r.prompt_tokens:,} |", flush=True)
    print(f"({next(iter(results.values())).seconds:.0f} s)")
    for codec, r in results.items():
        assert r.turns == turns and r.reused_tokens > 0, f"{codec}: {r.turns} turns compared, {r.reused_tokens} reused"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", default="int8,int4")
    p.add_argument("--only", default="ppl,mmlu,greedy", help="which measurements, comma-separated")
    p.add_argument("--ppl-texts", type=int, default=3)
    p.add_argument("--ppl-length", type=int, default=3072)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--ppl-chunk", type=int, default=128, help="tokens per turn in the PPL measurement")
    p.add_argument("--mmlu-limit", type=int, default=200)
    p.add_argument("--turns", type=int, default=200)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    codecs = args.codecs.split(",")
    only = args.only.split(",")
    if "ppl" in only:
        ppl_table(model, tokenizer, codecs, args.ppl_texts, args.ppl_length, args.window, args.ppl_chunk)
    if "mmlu" in only:
        mmlu_table(model, tokenizer, codecs, args.mmlu_limit, args.window)
    if "greedy" in only:
        greedy_table(model, tokenizer, codecs, args.turns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
