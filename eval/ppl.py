"""Perplexity of the truncation modes on long real texts (the paper's Table 1 protocol).

    python eval/ppl.py --limit 3 --length 3072 --window 1024 --chunk 128

Same as `attnstore eval ppl`; see `hf_attnstore.lab.evaluation.ppl` for the protocol and docs/evaluation.md
for the results.
"""

import sys

from hf_attnstore.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "ppl", *sys.argv[1:]]))
