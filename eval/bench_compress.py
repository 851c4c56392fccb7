"""Would lossless compression of chunk files pay (issue 14: "lossless zstd on disk only if it pays")?

    python eval/bench_compress.py --history 2048 --codecs none,int8,int4

Writes one SmolLM2 session of `--history` tokens (a real prefill, pre-RoPE keys) to a disk tier per codec
and measures, over its chunk files:

  entropy   the order-0 byte entropy (bits per byte / 8): what any coder that models bytes independently
            (Huffman, zstd's and DEFLATE's literal stage) can reach at best without finding repeats;
  zlib-N    DEFLATE at levels 1 and 6 (Python's stdlib): ratio and MB/s to compress and to decompress.

zstd is not a dependency; its ratio on data without repeats is bounded by the same entropy, and its
speed is what the zlib columns would have to beat for the saving to matter against the disk's read
speed (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import torch

from hf_attnstore import AttnStore, load_default_model
from hf_attnstore.store.tiers.disk import CHUNK_SUFFIX

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import history_snapshot, scratch_folder  # noqa: E402


def entropy_ratio(data: bytes) -> float:
    counts, n = Counter(data), len(data)
    return -sum(c / n * math.log2(c / n) for c in counts.values()) / 8


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--codecs", default="none,int8,int4")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = load_default_model()
    ids = torch.randint(100, model.config.vocab_size, (1, args.history), generator=torch.Generator().manual_seed(0))
    _, fp, snapshot = history_snapshot(model, ids, args.history)
    with scratch_folder(None, "attnstore-compress-") as root:  # removed also when the run fails
        print(f"SmolLM2-135M fp32, one session of {args.history} tokens (random ids), chunks of 256\n")
        print("| codec | chunk bytes | entropy bound | zlib-1 ratio | zlib-1 compress | zlib-1 decompress | zlib-6 "
              "ratio | zlib-6 compress |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name in args.codecs.split(","):
            with AttnStore(host_bytes="16GiB", disk_dir=str(root / name), kv_codec=None if name == "none" else name,
                           fsync=False) as store:
                with store.open_turn("s", fp, None, torch.arange(0)) as w:
                    w.append(*snapshot)
            data = b"".join(f.read_bytes() for f in sorted((root / name).rglob(f"*{CHUNK_SUFFIX}")))
            assert data, f"no chunk file was written for {name}"
            cells = []
            for level in (1, 6):
                t = time.perf_counter()
                packed = zlib.compress(data, level)
                compress_s = time.perf_counter() - t
                t = time.perf_counter()
                assert zlib.decompress(packed) == data
                decompress_s = time.perf_counter() - t
                cells.append((len(packed) / len(data), len(data) / compress_s / 1e6, len(data) / decompress_s / 1e6))
            (r1, c1, d1), (r6, c6, _) = cells
            label = "lossless" if name == "none" else name
            print(f"| {label} | {len(data):,} | {entropy_ratio(data):.3f} | {r1:.3f} | "
                  f"{c1:.0f} MB/s | {d1:.0f} MB/s | {r6:.3f} | {c6:.0f} MB/s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
