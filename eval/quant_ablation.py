"""Quantizing a session's cold KV: pre-RoPE keys per channel vs post-RoPE keys per token, at equal bits.

    python eval/quant_ablation.py --texts 8 --bits 8,4,2 --group 32

The design question behind the store's lossy codecs (issue 14): our keys are stored before RoPE, where
KVQuant and KIVI find stable outlier channels; an engine that caches rotated keys can only quantize what RoPE
has smeared. For each text (real ShareGPT and Python-docs text from the PPL corpora), a `--context`-token
history is prefilled; its KV is quantized and dequantized as a cold copy would be (asymmetric min-max
integers, one fp16 scale and zero point per group of `--group` values), and the next `--score` tokens are
scored against that history (teacher forcing). Keys are grouped four ways: {pre-RoPE, post-RoPE} x {per
channel: a group is `--group` tokens of one channel; per token: a group is `--group` channels of one
token}; values always per token (KIVI). Prints the perplexity of the scored tokens per variant, its change
against the lossless history, and the bytes per token of the stored KV (scales and zero points included),
SmolLM2 fp32. This measures the codec's effect on the model; the store does not have the codec yet.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from transformers import DynamicCache

from hf_attnstore import load_default_model
from hf_attnstore.lab.evaluation.corpora import load_texts
from hf_attnstore.cache.rope import RopeAdapter
from hf_attnstore.cache.upstream import cache_kwargs


def fake_quant(x: torch.Tensor, bits: int, group: int, dim: int) -> torch.Tensor:
    """Quantizes and dequantizes `x` with one scale and zero point per `group` consecutive values along `dim`
    (asymmetric min-max to ``2**bits`` levels; scales and zero points kept in fp16, as they would be stored)."""
    moved = x.movedim(dim, -1)
    n = moved.shape[-1]
    pad = (-n) % group
    if pad:
        moved = torch.cat([moved, moved[..., -1:].expand(*moved.shape[:-1], pad)], dim=-1)
    g = moved.reshape(*moved.shape[:-1], -1, group).float()
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    levels = 2 ** bits - 1
    scale = ((hi - lo) / levels).clamp_min(1e-8).half().float()
    lo = lo.half().float()
    q = ((g - lo) / scale).round().clamp(0, levels)
    out = (q * scale + lo).reshape(*moved.shape)[..., :n]
    return out.movedim(-1, dim).to(x.dtype)


def bytes_per_token(layers: int, kv_heads: int, dim: int, bits: int | None, group: int) -> float:
    """Stored bytes per token of K and V: `bits` per value plus an fp16 scale and zero per group of values."""
    values = 2 * layers * kv_heads * dim
    if bits is None:
        return values * 4.0  # fp32, as the store keeps SmolLM2's KV today
    return values * bits / 8 + values / group * 4


def quantized_cache(cache: DynamicCache, rope: RopeAdapter, cos, sin, scheme: str, bits: int,
                    group: int) -> DynamicCache:
    """A copy of `cache` whose keys and values went through a cold copy quantized with `scheme`."""
    inv_cos, inv_sin = RopeAdapter.inverse(cos, sin)
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values  # [1, kv_heads, T, dim], keys rotated
        where, axis = scheme.split("-")
        if where == "pre":
            pre = rope.unrotate(keys, inv_cos, inv_sin)
            pre = fake_quant(pre, bits, group, dim=2 if axis == "channel" else 3)
            keys = rope.rotate(pre, cos.to(keys.dtype), sin.to(keys.dtype))
        else:
            keys = fake_quant(keys, bits, group, dim=2 if axis == "channel" else 3)
        values = fake_quant(values, bits, group, dim=3)
        out.update(keys, values, i)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=8, help="texts per corpus")
    p.add_argument("--corpora", default="sharegpt,pydoc")
    p.add_argument("--context", type=int, default=768)
    p.add_argument("--score", type=int, default=256)
    p.add_argument("--bits", default="8,4,2")
    p.add_argument("--group", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    rope = RopeAdapter(model)
    schemes = ["pre-channel", "post-token", "pre-token", "post-channel"]
    bits_list = [int(b) for b in args.bits.split(",")]
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    positions = torch.arange(args.context, device=model.device)
    cos, sin = rope.cos_sin(positions, torch.float32)
    for corpus in args.corpora.split(","):
        texts = load_texts(corpus, tokenizer, args.texts, args.context + args.score)
        nll = {}
        for ids in texts:
            ids = ids.view(1, -1).to(model.device)
            history, scored = ids[:, : args.context], ids[:, args.context :]
            cache = DynamicCache()
            last = model(history, **cache_kwargs(cache)).logits[:, -1:]

            def score(kv: DynamicCache) -> float:
                logits = model(scored[:, :-1], **cache_kwargs(kv)).logits
                logits = torch.cat([last, logits], dim=1).float()
                return float(torch.nn.functional.cross_entropy(logits[0], scored[0], reduction="sum"))

            variants = [("lossless", None, None)] + [(s, b, s) for b in bits_list for s in schemes]
            for name, bits, scheme in variants:
                # Scoring appends to the cache it is given: never to the lossless history itself.
                kv = _copy(cache) if bits is None else quantized_cache(cache, rope, cos, sin, scheme, bits, args.group)
                nll[(name, bits)] = nll.get((name, bits), 0.0) + score(kv)
        tokens = len(texts) * args.score
        base = math.exp(nll[("lossless", None)] / tokens)
        print(f"\n{corpus}: {len(texts)} texts, history {args.context} tokens quantized, {args.score} scored each, "
              f"group {args.group}")
        print("| keys | bits | PPL | vs lossless | bytes/token |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| lossless (fp32) | 32 | {base:.3f} | – | {bytes_per_token(layers, kv_heads, dim, None, args.group):.0f} |")
        for bits in bits_list:
            for s in schemes:
                ppl = math.exp(nll[(s, bits)] / tokens)
                print(f"| {s.replace('-', ' RoPE, per ')} | {bits} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% | "
                      f"{bytes_per_token(layers, kv_heads, dim, bits, args.group):.0f} |", flush=True)
    return 0


def _copy(cache: DynamicCache) -> DynamicCache:
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.clone(), layer.values.clone(), i)
    return out


if __name__ == "__main__":
    sys.exit(main())
