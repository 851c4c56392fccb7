"""The forward wrapper that lets an :class:`AttnStoreCache` see where each forward pass begins and ends.

In transformers 5.x `Cache.update()` receives no positions, so the cache learns them from the base model's
inputs (`input_ids`, `position_ids`, the cache) before the forward, and commits the forward's KV
to the store after it. We wrap `model.base_model.forward` rather than registering hooks because one more
thing must be possible: if stored KV turns out to be unreadable in the middle of a forward (a damaged
file found by its checksum after earlier layers already used their KV), the wrapper re-runs that forward
over the whole prompt without the store, so the caller gets correct output and a miss, never an error.
The wrapper is installed once per model and passes straight through for any other cache.

`generate` itself is wrapped at two points (`install_generation_hook`), for this cache only:
`prepare_inputs_for_generation` feeds assisted generation's first forward only the ids after the cache's tokens, and
`_get_candidate_generator` lets the turn refuse, before any forward, a drafting mode it cannot roll back (both in
speculative.py). phi3 also overrides `prepare_inputs_for_generation` to drop the cache and recompute everything
when a sequence first grows past `original_max_position_embeddings` (where longrope switches to its long factors).
With this cache, KV of the long regime is stored apart and reused exactly (rope.RopeAdapter.regime), so that
override is bypassed while a turn stays in its regime, and left to run (after the cache stops saving) where it
crosses.
"""

from __future__ import annotations

import functools

from torch import nn

from . import speculative, upstream

_HOOK_ATTR = "_hf_attnstore_original_forward"
_PREPARE_ATTR = "_hf_attnstore_original_prepare"
_CANDIDATES_ATTR = "_hf_attnstore_original_candidates"
# Model types whose `prepare_inputs_for_generation` recomputes the whole sequence when longrope switches regime.
_REGIME_SWITCHING = frozenset({"phi3"})


class ReuseFailed(Exception):
    """Raised inside a forward when the reused KV could not be loaded; caught by the wrapper.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from hf_attnstore import AttnStore, AttnStoreCache, cache_kwargs
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> store = AttnStore(host_bytes="1MiB")
        >>> with AttnStoreCache(model, store, "alice", torch.tensor([[1, 5, 9, 4]])) as cache:
        ...     _ = model(cache.input_ids, **cache_kwargs(cache))
        >>> cache = AttnStoreCache(model, store, "alice", torch.tensor([[1, 5, 9, 4, 7]]))
        >>> def unreadable(*args, **kwargs):  # as if the stored KV were damaged
        ...     del cache.turn.loader.load_layer  # once
        ...     raise ReuseFailed("layer 0")
        >>> cache.turn.loader.load_layer = unreadable  # the layers load through the turn's ReuseLoader
        >>> new = cache.input_ids[:, cache.get_seq_length():]  # the one token not reused
        >>> logits = model(new, **cache_kwargs(cache)).logits  # the wrapper recomputes the whole prompt instead
        >>> cache.recomputed, tuple(logits.shape), cache.get_seq_length()
        (True, (1, 1, 32), 5)
    """


def _cache_of(kwargs: dict):
    """The forward's cache if it asks to be bracketed (AttnStoreCache sets `_brackets_forwards`), under the
    argument name of the installed transformers (`cache` from 5.24) or the deprecated one (upstream.py)."""
    cache = upstream.cache_from(kwargs)
    return cache if getattr(type(cache), "_brackets_forwards", False) else None


def install_hooks(model: nn.Module) -> None:
    """Wraps ``model.base_model.forward`` unless it is wrapped already.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> install_hooks(model); wrapped = model.model.forward
        >>> install_hooks(model)  # once only
        >>> model.model.forward is wrapped  # forwards without an AttnStoreCache run as before
        True
    """
    base = upstream.base_model(model)
    if getattr(base, _HOOK_ATTR, None) is not None:
        return
    original = base.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        cache = _cache_of(kwargs)
        if cache is None:
            return original(*args, **kwargs)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache.turn.forward_started()  # the store's writer yields to compute (store.py)
        try:
            cache.turn.begin_forward(input_ids, kwargs.get("inputs_embeds"), kwargs.get("position_ids"))
            try:
                with cache.turn.scoring():  # a turn that scores importance sees the attention (importance.py)
                    output = original(*args, **kwargs)
            except ReuseFailed:
                return cache.turn.recompute_forward(original, args, kwargs)
            cache.turn.end_forward()
            return output
        finally:
            cache.turn.forward_finished()

    base.forward = forward
    setattr(base, _HOOK_ATTR, original)


def install_generation_hook(model: nn.Module) -> None:
    """Wraps the model's `prepare_inputs_for_generation` and `_get_candidate_generator` once (module docstring).

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> install_generation_hook(model)
        >>> inputs = model.prepare_inputs_for_generation(torch.tensor([[1, 2, 3]]))  # no AttnStoreCache: as before
        >>> inputs["input_ids"].tolist()
        [[1, 2, 3]]
    """
    if getattr(model, _PREPARE_ATTR, None) is not None:
        return
    own = model.prepare_inputs_for_generation
    generic = upstream.generic_prepare_inputs(model)
    switching = model.config.model_type in _REGIME_SWITCHING

    @functools.wraps(own)
    def prepare(input_ids, *args, **kwargs):
        cache = _cache_of(kwargs)
        if cache is None:
            return own(input_ids, *args, **kwargs)
        # Plain decoding says how many ids are new; assisted generation's first forward does not (speculative.py).
        fed = None if args or kwargs.get("next_sequence_length") is not None else \
            speculative.feed_length(cache, input_ids, kwargs)
        if fed is not None:
            kwargs["next_sequence_length"] = fed
        if not switching or not cache.turn.length_dependent:
            return own(input_ids, *args, **kwargs)
        if cache.turn.regime_of(input_ids.shape[1]) != cache.regime:
            cache.turn.leave_regime()  # the model's override recomputes the sequence without this cache
            return own(input_ids, *args, **kwargs)
        return generic(input_ids, *args, **kwargs)

    model.prepare_inputs_for_generation = prepare
    setattr(model, _PREPARE_ATTR, own)

    candidates = getattr(model, upstream.CANDIDATE_GENERATOR, None)
    if candidates is None:  # moved upstream (tests/cache/test_upstream.py names it): plain decoding still works
        return

    @functools.wraps(candidates)
    def build_candidates(*args, **kwargs):
        generator = candidates(*args, **kwargs)
        cache = _cache_of(kwargs.get("model_kwargs") or {})
        if cache is not None:
            speculative.check_drafting(cache.turn, generator, kwargs.get("generation_config"),
                                       kwargs.get("assistant_model"))
        return generator

    setattr(model, upstream.CANDIDATE_GENERATOR, build_candidates)
    setattr(model, _CANDIDATES_ATTR, candidates)
