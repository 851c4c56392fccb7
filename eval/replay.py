"""RE vs AS on real ShareGPT conversations with Poisson arrivals and think time (the paper's end-to-end runs).

    python eval/replay.py --conversations 40 --plot docs/img/replay.png

Same as `attnstore replay`; see `hf_attnstore.lab.replay` for the protocol (virtual time, recorded replies read
by teacher forcing) and docs/benchmarks.md for the results.
"""

import sys

from hf_attnstore.cli import main

if __name__ == "__main__":
    sys.exit(main(["replay", *sys.argv[1:]]))
