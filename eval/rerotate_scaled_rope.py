"""Why length-dependent RoPE is reused per frequency regime only: re-rotating pre-RoPE keys with new frequencies
fixes layer 0 only.

    python eval/rerotate_scaled_rope.py

A tiny random Llama (3 layers, fp32) with `dynamic` or `longrope` scaling whose original length is 32. A
28-token history is computed in the short regime, as a store would have saved it; the prompt then grows to
40 tokens, past the original length, and a recomputation uses the long-regime frequencies everywhere. Each
layer's stored keys are un-rotated with the frequencies they were computed with and re-rotated with the
current ones (what pre-RoPE storage makes possible), then compared with the recomputation's keys. Prints the
largest error per layer, and layer 0's error without re-rotation (what a cache of rotated keys would hold).
"""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_attnstore.cache.rope import rotate_half
from hf_attnstore.cache.upstream import cache_kwargs

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=0)
CONFIGS = {
    "dynamic": dict(_COMMON, max_position_embeddings=32,
                    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "longrope": dict(_COMMON, max_position_embeddings=512,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                      "original_max_position_embeddings": 32, "short_factor": [1.0] * 8,
                                      "long_factor": [1.0 + i for i in range(8)]}),
}


def main() -> int:
    torch.set_grad_enabled(False)
    print("| RoPE | re-rotated key error, layer 0 / 1 / 2 | layer 0 not re-rotated |")
    print("| --- | --- | --- |")
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**config)).eval()
        rotary = model.model.rotary_emb
        ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(6))
        stored = DynamicCache()
        model(ids[:, :28], **cache_kwargs(stored))
        old = [t.unsqueeze(1) for t in rotary(torch.empty(0), torch.arange(28).view(1, -1))]
        recomputed = DynamicCache()
        model(ids, **cache_kwargs(recomputed))
        new = [t[:, :28].unsqueeze(1) for t in rotary(torch.empty(0), torch.arange(40).view(1, -1))]
        errors = []
        for layer, ref in zip(stored.layers, recomputed.layers):
            (cos, sin), (cos2, sin2) = old, new
            pre = (layer.keys * cos - rotate_half(layer.keys) * sin) / (cos * cos + sin * sin)
            keys = pre * cos2 + rotate_half(pre) * sin2
            errors.append(float((keys - ref.keys[:, :, :28]).abs().max()))
        stale = float((stored.layers[0].keys - recomputed.layers[0].keys[:, :, :28]).abs().max())
        print(f"| {name} | {' / '.join(f'{e:.1e}' for e in errors)} | {stale:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
