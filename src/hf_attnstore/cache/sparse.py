"""Sparse window attention over a session (ALISA): the device keeps the sinks, a recent window and the most
important of the other tokens; new tokens attend to those alone.

An :class:`~hf_attnstore.cache.layers.AttnStoreSparseLayer` (layers.py, beside the other layers) replaces each
full-attention KV layer of a cache made with ``kv_budget``.
Before each forward it trims the history it holds to the budget of the session's length (`SparseConfig.budget`),
per KV head (each head keeps its own most important tokens: the same count, so tensors stay rectangular), then
appends the forward's new KV; the forward attends to the kept history and causally to itself. Kept keys keep the
rotation of their original positions, so relative distances are those of the dense session. A token the layer
dropped does not come back within the turn (H2O's rule); the store keeps every token, so a later turn with a
larger budget loses nothing. The KV of tokens computed attending to a selection is not what dense attention
computes: the store labels it inexact (`CacheTurn.sparse_from`), and a later dense turn reuses the tokens before it and
recomputes the rest.

Masks: like transformers' sliding-window layers, the layer reports the session's length as its sequence
length (new tokens get their true positions) and ``(kept + q, length - kept)`` as its mask sizes: the mask sees
the kept history as the `kept` positions just before the queries, all visible, and the queries causal. Every
sparse layer keeps the same count, so the one mask transformers builds for the full-attention layers fits all.

Example:
    >>> config = SparseConfig(kv_budget=6, sink_tokens=2, recent_ratio=0.5)
    >>> held = torch.arange(10).expand(1, -1)
    >>> scores = torch.tensor([[9., 9., 0., 5., 0., 0., 4., 0., 0., 0.]])
    >>> select(held, scores, config.budget(10), config)  # 2 sinks, 2 recent, the 2 most important others
    tensor([[0, 1, 3, 6, 8, 9]])
"""

from __future__ import annotations

import torch

from .config import SparseConfig


def select(held: torch.Tensor, scores: torch.Tensor | None, keep: int, config: SparseConfig) -> torch.Tensor:
    """Which of the held tokens to keep: indices into `held` (``[kv_heads, K]`` session positions, ascending),
    ``[kv_heads, keep]`` ascending. The first `sink_tokens` and the most recent ones are always kept; the rest of
    the budget goes to the highest `scores` (``[kv_heads, K]``, one per held token), or to more recent tokens
    when there are no scores.

    Example:
        >>> held = torch.arange(10).expand(2, -1)  # 2 KV heads hold positions 0..9
        >>> scores = torch.tensor([[0, 0, 9, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 9, 0, 0, 0, 0.]])
        >>> select(held, scores, keep=4, config=SparseConfig(kv_budget=4, sink_tokens=1, recent_ratio=0.5)).tolist()
        [[0, 2, 8, 9], [0, 5, 8, 9]]
    """
    heads, n = held.shape
    if keep >= n:
        return torch.arange(n, device=held.device).expand(heads, -1)
    sinks, recent = config.split(keep, n)
    important = keep - sinks - recent
    if scores is None or important <= 0:
        recent = keep - sinks
        important = 0
    fixed = torch.cat([torch.arange(sinks, device=held.device), torch.arange(n - recent, n, device=held.device)])
    picked = fixed.expand(heads, -1)
    if important:
        middle = scores[:, sinks : n - recent]
        best = middle.topk(important, dim=1, sorted=False).indices + sinks
        picked = torch.cat([picked, best], dim=1)
    return picked.sort(dim=1).values
