"""Resuming a hybrid model's session: TTFT with stored KV + states, against recomputation (issue 15).

    python eval/bench_hybrid.py --arch lfm2 --history 2048 --new 128 --reps 5
    python eval/bench_hybrid.py --arch qwen3_next --history 2048 --new 128 --reps 5

No hybrid checkpoint can be downloaded here, so the model is built from a config at SmolLM2-135M's scale
(hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152) with random weights: timings depend on
shapes, not on weights. `--arch lfm2`: 16 layers, 10 short-convolution and 6 attention layers placed as in
LFM2-350M; `--arch qwen3_next`: 24 layers, three gated-DeltaNet layers to one attention layer, as Qwen3-Next
(dense MLP instead of its experts). Interleaved per repetition, medians reported:

  RE       recomputation of history + new (DynamicCache, the model's own hybrid cache)
  AS-host  the session in host memory: the cache built (KV loaded, states restored) and `--new` tokens prefilled
  AS-disk  the same from a store reopened on the folder, the session's pages dropped from the page cache

The resumed logits are compared with RE's (fp32). Bytes per session: KV and states.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.store.format import session_dirname

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import drop_page_cache  # noqa: E402

_SCALE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
              num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
_LFM2_TYPES = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv", "full_attention",
               "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv"]


def build(arch: str):
    if arch == "lfm2":
        config = transformers.Lfm2Config(**_SCALE, num_hidden_layers=16, layer_types=_LFM2_TYPES)
        return transformers.Lfm2ForCausalLM(config)
    if arch == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            **_SCALE, num_hidden_layers=24, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, num_experts=0, mlp_only_layers=list(range(24)))
        return transformers.Qwen3NextForCausalLM(config)
    raise SystemExit(f"--arch must be lfm2 or qwen3_next, got {arch!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="lfm2")
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = build(args.arch).eval()
    H, N = args.history, args.new
    ids = torch.randint(100, model.config.vocab_size, (1, H + N), generator=torch.Generator().manual_seed(0))
    root = Path(tempfile.mkdtemp(prefix="attnstore-hybrid-"))
    store = AttnStore(host_bytes="16GiB", disk_dir=str(root))
    prefill = AttnStoreCache(model, store, "s", ids[:, :H])
    model(prefill.input_ids, past_key_values=prefill)
    prefill.close()
    store.flush()
    snap = store.lookup("s", prefill.fingerprint)
    state_bytes, kv_bytes = snap.state.nbytes, snap.source.nbytes - snap.state.nbytes
    folder = root / "sessions" / session_dirname(prefill.fingerprint, "s")
    model(ids[:, :8])  # warm-up

    def resumed(source: AttnStore, tier: str) -> tuple[float, torch.Tensor]:
        t = time.perf_counter()
        cache = AttnStoreCache(model, source, "s", ids, save=False)
        logits = model(cache.input_ids[:, H:], past_key_values=cache).logits[0, -1]
        seconds = time.perf_counter() - t
        assert cache.reused_tokens == H and cache.kv_source == tier, (cache.reused_tokens, cache.kv_source)
        cache.close()
        return seconds, logits

    rows = {"RE": [], "AS-host": [], "AS-disk": []}
    error = 0.0
    for _ in range(args.reps):
        t = time.perf_counter()
        ref = model(ids, past_key_values=DynamicCache(config=model.config)).logits[0, -1]
        rows["RE"].append(time.perf_counter() - t)
        seconds, logits = resumed(store, "host")
        rows["AS-host"].append(seconds)
        error = max(error, float((logits - ref).abs().max()))
        store.close()
        drop_page_cache(folder)
        store = AttnStore(host_bytes="16GiB", disk_dir=str(root))
        seconds, logits = resumed(store, "disk")
        rows["AS-disk"].append(seconds)
        error = max(error, float((logits - ref).abs().max()))
    store.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    kinds = model.config.layer_types
    print(f"{args.arch} at SmolLM2-135M scale (random weights, {len(kinds)} layers, "
          f"{kinds.count('full_attention')} with attention), fp32 on CPU, {torch.get_num_threads()} threads; "
          f"history {H} + new {N}, {args.reps} reps (medians)\n")
    print("| system | TTFT | vs RE |\n| --- | --- | --- |")
    for name, value in med.items():
        print(f"| {name} | {1000 * value:.0f} ms | {value / med['RE']:.2f}x |")
    print(f"\nper session: KV {kv_bytes / 1e6:.1f} MB ({kv_bytes / H / 1e3:.1f} kB/token), states "
          f"{state_bytes / 1e6:.2f} MB; resumed logits vs RE: max |diff| {error:.1e}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
