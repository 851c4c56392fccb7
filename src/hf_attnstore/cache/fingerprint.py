"""Model fingerprints: KV cached for one model (or dtype, or adapter) must never be served to another.

The fingerprint hashes the architecture, the config, the KV geometry, every parameter and buffer (name,
shape, dtype and *all* bytes; but the frequency buffers that length-dependent RoPE rewrites on every call,
which the config determines), and the state of PEFT adapters (which are active, merged or disabled).
Hashing every byte is what makes it safe: a merged LoRA changes `k_proj`/`v_proj` by a low-rank update
that a sample of a few tensors never sees (SmolLM2 reused 400 tokens across such a merge, with logits
off by up to 1.08).

Reading every weight costs a fraction of a second per GiB, so the result is memoized on the model and
recomputed only when a *change key* changes. The key is read without touching tensor data (no device
sync): every tensor's identity (`data_ptr`), its autograd version counter (bumped by every in-place op
such as ``p.add_()`` or ``p.copy_()`` under ``torch.no_grad()``), shape, dtype and device, plus the PEFT
adapter state and the config. Writes through ``p.data`` bypass version counters (a PyTorch property);
PEFT's own merge does so but also changes its `merged_adapters`, which the key includes. After editing
weights through ``.data`` by hand, call :func:`forget_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json

import torch
import xxhash
from torch import nn

# Config keys that name or date a checkpoint but do not change what the model computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "name_or_path", "_commit_hash"}
_MEMO_ATTR = "_hf_attnstore_fingerprint"
_HASH_BLOCK = 64 * 1024 * 1024  # bytes copied off a GPU at a time


def kv_geometry(model: nn.Module) -> tuple:
    """The geometry of the KV the store keeps for `model` (store/geometry.py): ``(layers with KV, num_kv_heads,
    head_dim)`` for most models (a hybrid model's linear-attention layers keep no KV: see layers.LayerLayout);
    ``(layers, 1, qk_rope_head_dim, 1, kv_lora_rank)`` for multi-head latent attention, whose store keys are
    the key's rotary part and whose values are the compressed latent.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> kv_geometry(model)  # 2 layers, 2 KV heads, head_dim 16 / 4
        (2, 2, 4)
    """
    from .layout import LayerLayout  # imports transformers' cache classes: only when a model is measured
    from ..store.format import make_geometry

    cfg = model.config.get_text_config(decoder=True)
    layout = LayerLayout.of(model)
    if layout.latent:
        return make_geometry(len(layout.kv_layers), (1, cfg.qk_rope_head_dim), (1, cfg.kv_lora_rank))
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return len(layout.kv_layers), kv_heads, head_dim


def _walk(model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list]:
    """Every parameter and buffer (sorted by name) and the PEFT adapter state, in one pass over the modules.

    PEFT is not a dependency: its injected layers (`BaseTunerLayer`) are recognized by their
    `active_adapters` and `merged_adapters`; their weights are ordinary parameters, hashed with the rest.
    """
    tensors, adapters = [], []
    for prefix, module in model.named_modules(remove_duplicate=False):
        volatile = _rewrites_frequencies(module)
        own = [*module.named_parameters(recurse=False, remove_duplicate=False),
               *((name, t) for name, t in module.named_buffers(recurse=False, remove_duplicate=False)
                 if not (volatile and name.endswith("inv_freq")))]
        tensors += [(f"{prefix}.{name}" if prefix else name, t) for name, t in own]
        if "merged_adapters" in module.__dict__ and hasattr(module, "active_adapters"):
            active = module.active_adapters
            adapters.append([prefix, sorted(active) if isinstance(active, (list, tuple)) else [str(active)],
                             list(module.merged_adapters), bool(getattr(module, "disable_adapters", False)),
                             repr(getattr(module, "scaling", None))])
    tensors.sort(key=lambda item: item[0])
    return tensors, adapters


def _rewrites_frequencies(module: nn.Module) -> bool:
    """Whether `module` is a rotary module with length-dependent RoPE (`dynamic`, `longrope`), which rewrites its
    `inv_freq` buffers on every call (transformers' `dynamic_rope_update`). Those buffers are left out of the
    fingerprint: they follow from the config, which is hashed, and hashing them would give the same model a
    new fingerprint after every call that switched frequencies."""
    from .upstream import rope_type as rope_type_of  # imports transformers: only when a model is measured

    rope_type = rope_type_of(module)
    kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(kind in ("dynamic", "longrope") for kind in kinds if isinstance(kind, str))


def _config(model: nn.Module) -> dict:
    return {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}


def _change_key(model: nn.Module, tensors, adapters) -> tuple:
    tensor_key = tuple((name, t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device) for name, t in tensors)
    return tensor_key, repr(adapters), repr(model.config.__dict__)


def _hash_tensor(digest, t: torch.Tensor) -> None:
    """Feeds every byte of `t` to `digest` (GPU tensors are copied to the host block by block)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.numel() == 0:
        return
    raw = flat.contiguous().view(torch.uint8)
    block = _HASH_BLOCK
    for start in range(0, raw.numel(), block):
        piece = raw[start : start + block]
        if piece.device.type != "cpu":
            piece = piece.cpu()
        digest.update(memoryview(piece.numpy()))


def _full_fingerprint(model: nn.Module, tensors, adapters) -> str:
    weights = xxhash.xxh3_128()
    layout = []
    for name, t in tensors:
        if t.device.type == "meta":
            raise ValueError(
                f"`model` has tensor {name!r} on the meta device (no values): its cache entries cannot be told "
                "apart from another checkpoint's; load real weights (e.g. `to_empty` then `load_state_dict`) first"
            )
        layout.append([name, list(t.shape), str(t.dtype)])
        _hash_tensor(weights, t)
    payload = {
        "class": type(model).__name__,
        "config": _config(model),
        "kv": kv_geometry(model),
        "tensors": layout,
        "weights": weights.hexdigest(),
        "adapters": adapters,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def model_fingerprint(model: nn.Module, namespace: str | None = None) -> str:
    """A stable hex id of (architecture, config, KV geometry, every weight's bytes, PEFT adapter state).

    The first call hashes every parameter and buffer (SmolLM2-135M fp32: tens of milliseconds, see
    docs/reliability.md); later calls return the memo unless a weight was changed in place, replaced,
    moved or cast, or an adapter was switched, merged or disabled (see the module docstring).

    Args:
        model: The model whose KV is stored.
        namespace: A salt for what the weights cannot show (a system prompt policy, a tenant): entries
            stored under one namespace are never served to another (like TensorRT-LLM's ``cache_salt``).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> fp = model_fingerprint(model)
        >>> len(fp), fp == model_fingerprint(model), fp == model_fingerprint(model, "tenant-a")
        (64, True, False)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"`namespace` must be a str or None, got {type(namespace).__name__}")
    tensors, adapters = _walk(model)
    key = _change_key(model, tensors, adapters)
    memo = model.__dict__.get(_MEMO_ATTR)
    if memo is None or memo[0] != key:
        memo = (key, _full_fingerprint(model, tensors, adapters))
        object.__setattr__(model, _MEMO_ATTR, memo)  # plain attribute: nn.Module's __setattr__ would register it
    if namespace is None:
        return memo[1]
    return hashlib.sha256(f"{memo[1]}\0{namespace}".encode("utf-8")).hexdigest()


MAX_SALT_BYTES = 1024


def salted_fingerprint(fingerprint: str, cache_salt: str | None) -> str:
    """The key of KV stored under `cache_salt` (vLLM's name): KV is shared, and reused, only between requests
    with the same salt (or both without one). A tenant that sets a salt never reuses another's KV, and since
    nothing of another salt is ever looked at, never learns of it through timing either.

    Example:
        >>> fp = "0" * 64
        >>> salted_fingerprint(fp, None) == fp, salted_fingerprint(fp, "tenant-a") != salted_fingerprint(fp, "tenant-b")
        (True, True)

    Raises:
        TypeError: `cache_salt` is not a string.
        ValueError: It is empty or longer than 1 KiB in UTF-8.
    """
    if cache_salt is None:
        return fingerprint
    if not isinstance(cache_salt, str):
        raise TypeError(f"`cache_salt` must be a str or None, got {type(cache_salt).__name__}")
    try:
        size = len(cache_salt.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError("`cache_salt` must be valid Unicode text (it has a lone surrogate)") from None
    if not 0 < size <= MAX_SALT_BYTES:
        raise ValueError(f"`cache_salt` must be 1 to {MAX_SALT_BYTES} bytes in UTF-8, got {size}: use a hash of a "
                         "longer secret")
    return hashlib.sha256(f"{fingerprint}\0salt\0{cache_salt}".encode("utf-8")).hexdigest()


def regime_fingerprint(fingerprint: str, regime: str) -> str:
    """The key of KV computed in RoPE frequency regime `regime` (see ``rope.RopeAdapter.regime``).

    `fingerprint` itself for the base regime ``""``, which is every static-RoPE model's KV, so their keys never
    change; a salted one otherwise (`longrope` past its original length), so KV of one regime is never served
    to a forward of another: a miss, never KV computed with other frequencies.

    Example:
        >>> regime_fingerprint("abc", "") == "abc", len(regime_fingerprint("abc", "long"))
        (True, 64)
    """
    if not regime:
        return fingerprint
    return hashlib.sha256(f"{fingerprint}\0rope-regime:{regime}".encode("utf-8")).hexdigest()


def forget_fingerprint(model: nn.Module) -> None:
    """Drops the memoized fingerprint: the next call hashes every weight again.

    Needed only after changing weights through ``param.data`` by hand, which PyTorch does not track.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> before = model_fingerprint(model)
        >>> _ = model.lm_head.weight.data.zero_()  # by hand: not tracked
        >>> model_fingerprint(model) == before  # the memo still answers
        True
        >>> forget_fingerprint(model)
        >>> model_fingerprint(model) == before
        False
    """
    model.__dict__.pop(_MEMO_ATTR, None)
