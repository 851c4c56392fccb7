"""Model fingerprints: KV cached for one model (or dtype) must never be served to another."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

# Config keys that name or date a checkpoint but do not change what the model computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "name_or_path", "_commit_hash"}
_SAMPLE_ELEMENTS = 4096


def kv_geometry(model: nn.Module) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a decoder's attention."""
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def _weight_sample_digest(model: nn.Module) -> str:
    """Hashes a few thousand values of the first, a middle and the last parameters.

    Reading every weight would cost seconds on large models; a sample of three tensors distinguishes
    checkpoints (and fine-tunes, which change every matrix) at negligible cost.
    """
    params = [p for p in model.parameters()]
    digest = hashlib.sha256()
    for p in (params[0], params[len(params) // 2], params[-1]):
        sample = p.detach().reshape(-1)[:_SAMPLE_ELEMENTS].to("cpu", torch.float32).contiguous()
        digest.update(str(tuple(p.shape)).encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def model_fingerprint(model: nn.Module) -> str:
    """A stable hex id of (architecture, config, dtype, KV geometry, weight sample).

    Recomputed on every call (a few milliseconds): a memo would go stale when a model is cast to another
    dtype or its weights change in place.

    Example:
        >>> fp = model_fingerprint(model)  # doctest: +SKIP
        >>> len(fp)
        64
    """
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    payload = {
        "class": type(model).__name__,
        "config": config,
        "dtype": str(next(model.parameters()).dtype),
        "kv": kv_geometry(model),
        "weights": _weight_sample_digest(model),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
