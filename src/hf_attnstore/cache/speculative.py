"""Speculative decoding through an :class:`~hf_attnstore.cache.AttnStoreCache`.

transformers' assisted generation (`assistant_model=`, `prompt_lookup_num_tokens=`, `assistant_early_exit=`) drafts
tokens, verifies them all in one forward of the model, and `crop`s the cache back to the tokens it keeps. Two
things make that work on a resumed session, whose cache holds the reused tokens before the first forward:

* **Feeding only what the cache lacks.** Plain decoding's first forward feeds the prompt after the cache's tokens
  (`generate` slices it by the cache's length). Assisted generation's first forward instead passes the whole
  sequence, prompt and drafts, with positions from 0: it assumes an empty cache, so the reused tokens would be
  computed again at positions the cache already holds (which the cache refuses). `feed_length` gives the slice
  plain decoding makes; the forward then computes the rest of the prompt and the drafts, and the logits assisted
  generation reads (those of the drafts and the token after them) are the same.
* **Rolling the session back.** `crop` cuts the layers, the ids the turn fed, the stored session (the turn's writer)
  and a hybrid model's state count alike (`CacheTurn.cropped`): the store holds the prompt and the accepted tokens,
  none of the rejected drafts.

A drafting mode the turn cannot follow is refused before any forward, naming it (`check_drafting`).
"""

from __future__ import annotations

import torch

# How a refusal names the modes that crop the cache (GenerationMode.ASSISTED_GENERATION).
ASSISTED = "assisted generation (`assistant_model`, `prompt_lookup_num_tokens`)"


def feed_length(cache, input_ids: torch.Tensor, kwargs: dict) -> int | None:
    """How many trailing ids of `input_ids` a forward prepared by `prepare_inputs_for_generation` should feed, when
    `generate` hands it the whole sequence without saying how much is new (``next_sequence_length=None``, assisted
    generation's first forward): the ids after the cache's tokens. None leaves the call as it is: it says already,
    the cache is empty, or the ids are not the cache's tokens followed by new ones (then the forward refuses them).

    Example:
        >>> feed_length(cache, cache.input_ids, {"next_sequence_length": None})  # doctest: +SKIP
        3
    """
    if kwargs.get("next_sequence_length") is not None or kwargs.get("inputs_embeds") is not None \
            or input_ids.dim() != 2:
        return None
    past, total = cache.get_seq_length(), input_ids.shape[1]
    if not 0 < past < total:
        return None
    positions = kwargs.get("position_ids")
    if positions is not None and positions.shape[-1] != total:
        return None  # positions of fewer tokens: these ids are the new ones only, with a mask over the whole sequence
    if not torch.equal(input_ids[0, :past].cpu(), cache.token_ids):
        return None
    return total - past


def check_drafting(turn, generator, generation_config, assistant_model) -> None:
    """Refuses, before any forward, a drafting mode the turn cannot roll back exactly (see the module docstring).

    Args:
        turn: The cache's `CacheTurn`.
        generator: The candidate generator assisted generation built (its `requires_model_outputs` says it drafts
            from the model's hidden states).
        generation_config, assistant_model: What `generate` built it from (to name the mode).

    Raises:
        ValueError: A sparse cache (`kv_budget`: its layers cannot be cropped), importance scores (the rejected
            drafts' attention cannot be taken back out of them), or a drafter that reads the model's hidden states
            of the whole prompt on a resumed session (its reused tokens are loaded, never computed).

    Example:
        >>> from types import SimpleNamespace
        >>> from hf_attnstore.cache.config import SparseConfig
        >>> dense = SimpleNamespace(sparse=None, scorer=None, reused_tokens=100)
        >>> check_drafting(dense, object(), None, None)  # a dense turn drafting with a separate model: allowed
        >>> sparse = SimpleNamespace(sparse=SparseConfig(0.2), scorer=None, reused_tokens=100)
        >>> check_drafting(sparse, object(), None, None)
        Traceback (most recent call last):
        ...
        ValueError: assisted generation (...) is not supported with `kv_budget`: a sparse cache ...
    """
    if turn.sparse is not None:
        raise ValueError(f"{ASSISTED} is not supported with `kv_budget`: a sparse cache keeps a selection of the "
                         "history and cannot be cropped back to the drafts the model keeps; use a dense cache")
    if turn.scorer is not None:
        raise ValueError(f"{ASSISTED} is not supported with `truncation=\"importance\"`: the importance scores kept "
                         "with the session would count the attention of rejected drafts, which cannot be taken back "
                         "out; use `truncation=\"decoupled\"` or decode without drafts")
    if getattr(generator, "requires_model_outputs", False) and turn.reused_tokens:
        raise ValueError(f"{_drafter(generation_config, assistant_model, generator)} drafts from the model's hidden "
                         f"states over the whole prompt, and this turn resumes {turn.reused_tokens} tokens from the "
                         "store without computing them: use `assistant_model` (a separate draft model) or "
                         "`prompt_lookup_num_tokens`, or a new session")


def _drafter(generation_config, assistant_model, generator) -> str:
    """The option that chose a drafter which reads the model's outputs, for an error message."""
    if getattr(generation_config, "use_mtp", False):
        return "`use_mtp=True`"
    speculation = getattr(generation_config, "speculation_type", None)
    if speculation:
        return f"`speculation_type={speculation!r}`"
    if assistant_model is not None:
        return f"`assistant_model` ({type(assistant_model).__name__}, through {type(generator).__name__})"
    return type(generator).__name__
