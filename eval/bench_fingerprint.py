"""Cost of model fingerprints: the first one (every weight hashed) and the memo check done per turn.

    python eval/bench_fingerprint.py            # SmolLM2-135M fp32 and a 7B-shaped Llama in bf16
    python eval/bench_fingerprint.py --no-7b    # SmolLM2 only (the 7B shape needs ~14 GB of RAM)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_attnstore import load_default_model
from hf_attnstore.cache.fingerprint import forget_fingerprint, model_fingerprint


def measure(model, label: str, reps: int) -> None:
    firsts = []
    for _ in range(reps):
        forget_fingerprint(model)
        t = time.perf_counter()
        model_fingerprint(model)
        firsts.append(time.perf_counter() - t)
    memo = []
    for _ in range(50):
        t = time.perf_counter()
        model_fingerprint(model)
        memo.append(time.perf_counter() - t)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    first = statistics.median(firsts)
    print(f"{label:<34} {nbytes / 2**30:6.2f} GiB  first {first * 1000:9.1f} ms ({nbytes / first / 1e9:5.2f} GB/s)  "
          f"memo check {statistics.median(memo) * 1e3:6.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-7b", action="store_true", help="skip the 7B-shaped model")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    model, _ = load_default_model(dtype="float32", device="cpu")
    measure(model, "SmolLM2-135M fp32 (cpu)", args.reps)
    del model
    if not args.no_7b:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=32, vocab_size=32000)
        with torch.device("meta"):
            big = LlamaForCausalLM(cfg).to(torch.bfloat16)
        big = big.to_empty(device="cpu")  # real memory, no random init (minutes on 2 cores)
        with torch.no_grad():
            for i, p in enumerate(big.parameters()):
                p.fill_(0.001 * (i + 1))  # touch every page, so hashing reads real memory
        measure(big, "Llama-7B shape bf16 (cpu)", max(1, args.reps - 2))


if __name__ == "__main__":
    main()
