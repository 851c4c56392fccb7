"""Perplexity of text that follows a truncated (overflowed) context."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import AttnStoreCache
from ..store import AttnStore

MODES = ("full", "recompute", "decoupled", "naive")


@torch.no_grad()
def nll_after_overflow(model, ids: torch.Tensor, *, context_window: int, score_tokens: int, mode: str,
                       keep_first: int = 4, truncation_ratio: float = 0.5) -> tuple[float, int]:
    """Summed negative log-likelihood of the last `score_tokens - 1` tokens of `ids` after an overflow.

    The history (all but the last `score_tokens` ids) is first run through an :class:`AttnStoreCache`,
    as an earlier turn would be. Then the whole sequence, which exceeds `context_window`, is resumed with
    the given truncation `mode`, and the new tokens are scored. ``mode="full"`` scores them with the whole
    untruncated context, the upper bound.

    Returns:
        ``(sum of NLL, number of scored tokens)``.
    """
    ids = ids.view(1, -1).to(model.device)
    if mode == "full":
        logits = model(ids).logits[:, -score_tokens:]
        targets = ids[:, -score_tokens + 1 :]
    else:
        history = ids[:, :-score_tokens]
        if history.shape[1] > context_window:
            raise ValueError("the history alone must fit the window: use a longer window or shorter text")
        store = AttnStore(host_bytes=max(1, 4 * ids.numel()) * 1024 * 1024)
        first = AttnStoreCache(model, store, "ppl", history)
        model(first.input_ids, past_key_values=first)
        cache = AttnStoreCache(model, store, "ppl", ids, context_window=context_window, truncation=mode,
                               keep_first=keep_first, truncation_ratio=truncation_ratio)
        if cache.dropped_tokens == 0:
            raise ValueError("the sequence does not overflow `context_window`: nothing is truncated")
        rest = cache.input_ids[:, cache.reused_tokens :]
        logits = model(rest, past_key_values=cache).logits[:, -score_tokens:]
        targets = cache.input_ids[:, -score_tokens + 1 :]
    nll = F.cross_entropy(logits[0, :-1].float(), targets[0], reduction="sum")
    return float(nll), int(targets.numel())
