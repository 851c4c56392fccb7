"""Perplexity against KV sparsity: dense, StreamingLLM, ALISA's sparse window attention and H2O (issue 33).

    python eval/sparse_ppl.py --limit 2 --length 2048 --chunk 32 --sparsities 0.5,0.8,0.9

Same as `attnstore eval sparse`; see `hf_attnstore.lab.evaluation.sparsity` for the protocol and
docs/evaluation.md for the results.
"""

import sys

from hf_attnstore.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "sparse", *sys.argv[1:]]))
