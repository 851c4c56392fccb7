"""Forward hooks that tell an :class:`AttnStoreCache` where each forward pass begins and ends.

In transformers 5.x `Cache.update()` receives no positions, so the cache learns them from the base model's
inputs: a pre-hook reads `input_ids`/`position_ids`/`past_key_values`, a post-hook commits the forward's
KV to the store. The hooks are installed once per model and act only when the forward's cache is an
`AttnStoreCache`, so they cost nothing to other callers.
"""

from __future__ import annotations

from torch import nn

_HOOK_ATTR = "_hf_attnstore_hooks"


def _cache_of(kwargs: dict):
    from .cache import AttnStoreCache  # local import: cache.py imports this module

    cache = kwargs.get("past_key_values")
    return cache if isinstance(cache, AttnStoreCache) else None


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    cache = _cache_of(kwargs)
    if cache is not None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache._begin_forward(input_ids, kwargs.get("inputs_embeds"), kwargs.get("position_ids"))
    return None


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output):
    cache = _cache_of(kwargs)
    if cache is not None:
        cache._end_forward()
    return None


def install_hooks(model: nn.Module) -> None:
    """Registers the hooks on ``model.base_model`` unless they are there already."""
    base = model.base_model
    if getattr(base, _HOOK_ATTR, None) is None:
        handles = (
            base.register_forward_pre_hook(_pre_hook, with_kwargs=True),
            base.register_forward_hook(_post_hook, with_kwargs=True),
        )
        setattr(base, _HOOK_ATTR, handles)
