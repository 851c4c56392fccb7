"""Resuming a session of a newer model family: TTFT with stored KV (and states) against recomputation (issue 15).

    python eval/bench_families.py --arch lfm2 --history 2048 --new 128 --reps 5
    python eval/bench_families.py --arch qwen3_next --history 2048 --new 128 --reps 5
    python eval/bench_families.py --arch deepseek_v3 --history 2048 --new 128 --reps 5
    python eval/bench_families.py --arch phi3_longrope --history 2048 --new 128 --reps 5

No such checkpoint can be downloaded here, so the model is built from a config at SmolLM2-135M's scale
(hidden 576, 9 query heads, MLP 1536, vocabulary 49152) with random weights: timings depend on shapes, not on
weights. Hybrids (KV of their attention layers, plus recurrent and convolution states): `--arch lfm2`, 16
layers, 10 short-convolution and 6 attention layers placed as in LFM2-350M; `--arch qwen3_next`, 24 layers,
three gated-DeltaNet layers to one attention layer, as Qwen3-Next (dense MLP instead of its experts), both
with 3 KV heads of 64. Multi-head latent attention: `--arch deepseek_v3`, 30 layers (SmolLM2's count) of
DeepSeek-V3's attention, scaled down (latent 128 wide, rotary key part 32, per-head no-RoPE key 64 and value
64, no query compression; dense MLP instead of its experts; yarn RoPE as its checkpoints). Length-dependent
RoPE: `--arch phi3_longrope`, 30 layers of phi3 with longrope whose original length is 1024, so the history
is in the long regime. Each variant runs once per repetition, in an order drawn afresh each time (from `--seed`;
printed), medians reported:

  RE       recomputation of history + new (DynamicCache, the model's own cache)
  AS-host  the session in host memory: the cache built (KV loaded, states restored) and `--new` tokens prefilled
  AS-disk  the same from a store reopened on the folder, the session's pages dropped from the page cache

The resumed logits are compared with RE's (fp32). Bytes per session: KV and states. A resume that did not reuse
exactly the stored history from the tier it measures, or whose logits differ from RE's by more than 1e-3, fails
the run (the resumed turns do not save, so every
repetition resumes the same session). The temporary folder is removed also when a run fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.store.format import session_dirname

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import check_resume, drop_page_cache, interleaved, orders_line, scratch_folder  # noqa: E402
from hf_attnstore.cache.upstream import cache_kwargs

_SCALE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
              max_position_embeddings=8192, tie_word_embeddings=True)
_GQA = dict(_SCALE, num_key_value_heads=3, head_dim=64)
_LFM2_TYPES = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv", "full_attention",
               "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv"]
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                  "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


TOLERANCE = 1e-3  # fp32: a resumed turn's logits against recomputation's (measured: ~5e-6)


def build(arch: str):
    if arch == "lfm2":
        config = transformers.Lfm2Config(**_GQA, num_hidden_layers=16, layer_types=_LFM2_TYPES)
        return transformers.Lfm2ForCausalLM(config)
    if arch == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            **_GQA, num_hidden_layers=24, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, num_experts=0, mlp_only_layers=list(range(24)))
        return transformers.Qwen3NextForCausalLM(config)
    if arch == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **dict(_SCALE, max_position_embeddings=163840), num_key_value_heads=9, num_hidden_layers=30, kv_lora_rank=128, q_lora_rank=None,
            qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=30,
            rope_parameters=_DEEPSEEK_YARN)
        return transformers.DeepseekV3ForCausalLM(config)
    if arch == "phi3_longrope":
        # Phi-3.5/Phi-4-mini's longrope, its original length scaled down to 1024 so that 2048 + 128 is in the long
        # regime (whose KV is keyed apart and reused: docs/design.md, "Length-dependent RoPE").
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 1024,
                "factor": 8.0, "short_factor": [1.0 + 0.01 * i for i in range(32)],
                "long_factor": [1.0 + 0.5 * i for i in range(32)]}
        config = transformers.Phi3Config(**_GQA, num_hidden_layers=30, original_max_position_embeddings=1024,
                                         rope_parameters=rope)
        return transformers.Phi3ForCausalLM(config)
    raise SystemExit(f"--arch must be lfm2, qwen3_next, deepseek_v3 or phi3_longrope, got {arch!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="lfm2")
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = build(args.arch).eval()
    with scratch_folder(None, "attnstore-families-") as root:
        run(model, args, root)
    return 0


def run(model, args, root: Path) -> None:
    H, N = args.history, args.new
    ids = torch.randint(100, model.config.vocab_size, (1, H + N), generator=torch.Generator().manual_seed(0))
    store = AttnStore(host_bytes="16GiB", disk_dir=str(root))
    try:
        prefill = AttnStoreCache(model, store, "s", ids[:, :H])
        model(prefill.input_ids, **cache_kwargs(prefill))
        prefill.close()
        store.flush()
        snap = store.lookup("s", prefill.fingerprint)
        state_bytes = snap.state.nbytes if snap.state is not None else 0
        kv_bytes = snap.source.nbytes - state_bytes
        folder = root / "sessions" / session_dirname(prefill.fingerprint, "s")
        model(ids[:, :8])  # warm-up
        ref = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits[0, -1]
        errors = []

        def resumed(tier: str) -> float:
            nonlocal store
            if tier == "disk":  # a store reopened on the folder: the session on disk only
                store.close()
                drop_page_cache(folder)
                store = AttnStore(host_bytes="16GiB", disk_dir=str(root))
            # AS-host finds the session in host memory: stored there by the prefill, or loaded by an AS-disk turn.
            t = time.perf_counter()
            cache = AttnStoreCache(model, store, "s", ids, save=False)
            logits = model(cache.input_ids[:, H:], **cache_kwargs(cache)).logits[0, -1]
            seconds = time.perf_counter() - t
            check_resume(cache, H, (tier,))
            cache.close()
            errors.append(float((logits - ref).abs().max()))
            return seconds

        def recompute(rep: int) -> float:
            t = time.perf_counter()
            model(ids, **cache_kwargs(DynamicCache(config=model.config)))
            return time.perf_counter() - t

        rows, orders = interleaved({"RE": recompute, "AS-host": lambda rep: resumed("host"),
                                    "AS-disk": lambda rep: resumed("disk")}, args.reps, args.seed)
    finally:
        store.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    print(f"{args.arch} at SmolLM2-135M scale (random weights, {len(kinds)} layers, "
          f"{kinds.count('full_attention')} with attention), fp32 on CPU, {torch.get_num_threads()} threads; "
          f"history {H} + new {N}, {args.reps} reps (medians)\n{orders_line(orders, args.seed)}\n")
    print("| system | TTFT | vs RE |\n| --- | --- | --- |")
    for name, value in med.items():
        print(f"| {name} | {1000 * value:,.0f} ms | {value / med['RE']:.2f}x |")
    states = f", states {state_bytes / 1e6:.2f} MB" if state_bytes else ""
    print(f"\nper session: KV {kv_bytes / 1e6:.1f} MB ({kv_bytes / H / 1e3:.1f} kB/token){states}; resumed logits "
          f"vs RE: max |diff| {max(errors):.1e}")
    assert max(errors) <= TOLERANCE, f"resumed logits differ from recomputation's by {max(errors):.1e}"


if __name__ == "__main__":
    sys.exit(main())
