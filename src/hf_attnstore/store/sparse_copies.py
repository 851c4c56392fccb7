"""Sparse cold copies (`StoreConfig.sparse_copies`, ALISA): which tokens of a chunk a disk or remote copy keeps.

A session kept sparse by its caches (``kv_budget``, a policy that ranks by importance) stores, with its scores, the
selection its next turn's first forward makes: ``S{slot:04d}``, per KV slot and head the session positions kept
(state.py). A whole chunk written to a lower tier keeps, per slot and head, the chunk's tokens in that selection.
Tensors stay rectangular: every slot and head keeps the same count ``m`` per chunk, the largest any of them needs,
the others padded with their next most important tokens (a superset of the selection: no selected token is
lost). A chunk whose selection covers every token is written whole.

Why the selection and not a budget of the store's own: the cache owns the policy (budget, sinks, recent share),
and with its own selection kept, a sparse turn resumed from the thin copy that extends the stored session keeps
what it would keep from the whole one: the tokens it drops at its first forward are the ones missing
(tests/cache/test_sparse_copies.py). A turn that leaves the history earlier (regenerated, edited) may differ: its
recent window moves onto tokens the copy dropped.

Tokens loaded without KV (an earlier sparse copy) stay absent: they are never chosen, and a chunk holding some
is written sparse even without a selection.

Example:
    >>> selection = {0: torch.tensor([[0, 1, 5, 7], [0, 1, 3, 7]])}  # one slot, two heads, of 8 tokens
    >>> scores = {0: torch.tensor([[9., 9, 0, 4, 0, 5, 0, 9], [9., 9, 0, 5, 6, 0, 0, 9]])}
    >>> kept_positions(selection, scores, None, 0, 8, heads=2)  # 4 each: the selection itself
    tensor([[[0, 1, 5, 7],
             [0, 1, 3, 7]]])
    >>> kept_positions(selection, scores, None, 4, 8, heads=2)  # tokens 4-7: 2 and 1 kept, padded to 2 (relative)
    tensor([[[1, 3],
             [0, 3]]])
"""

from __future__ import annotations

import torch



def kept_positions(selection: dict[int, torch.Tensor] | None, scores: dict[int, torch.Tensor] | None,
                   absent: torch.Tensor | None, a: int, b: int, heads: int) -> torch.Tensor | None:
    """The chunk positions a sparse copy of session tokens ``[a, b)`` keeps, ``[slots, heads, m]`` ascending
    (relative to `a`), or None to write the chunk whole.

    Args:
        selection: Slot -> ``[heads, K]`` session positions the session's next turn keeps; None: no selection.
        scores: Slot -> ``[heads, >= b]`` importance of every token (padding order); None: the latest first.
        absent: ``[slots, heads, b - a]``: tokens without KV in host memory (never kept), or None.
        heads: KV heads per slot.

    Example:
        >>> selection = {0: torch.tensor([[0, 5, 6, 7]])}  # slot 0, one head: the positions its next turn keeps
        >>> kept_positions(selection, None, None, a=4, b=8, heads=1).tolist()  # of chunk [4, 8): positions 1, 2, 3
        [[[1, 2, 3]]]
    """
    n = b - a
    if selection is None and absent is None:
        return None
    slots = len(selection) if selection is not None else absent.shape[0]
    if selection is not None and (set(selection) != set(range(slots)) or any(
            t.dim() != 2 or t.shape[0] != heads for t in selection.values())
            or (absent is not None and absent.shape[0] != slots)):
        # A selection that does not fit the KV: not this session's to trust. Keep everything there is.
        if absent is None:
            return None
        selection, slots = None, absent.shape[0]
    chosen = torch.zeros(slots, heads, n, dtype=torch.bool)
    rank = torch.arange(n, dtype=torch.float64).expand(slots, heads, n).clone()  # no scores: the latest first
    for slot in range(slots):
        if selection is not None:
            pos = selection[slot] - a
            marks = torch.zeros(heads, n + 1, dtype=torch.bool)  # column n takes the positions outside the chunk
            marks.scatter_(1, torch.where((pos >= 0) & (pos < n), pos, n), True)
            chosen[slot] = marks[:, :n]
        if scores is not None and scores.get(slot) is not None and scores[slot].shape == (heads, scores[slot].shape[1]) \
                and scores[slot].shape[1] >= b:
            rank[slot] = scores[slot][:, a:b].to(torch.float64)
    present = ~absent if absent is not None else torch.ones(slots, heads, n, dtype=torch.bool)
    chosen &= present
    fewest = int(present.sum(-1).min())
    if fewest == 0:  # (tokens of a sparse copy re-cut into other chunks: chunk_tokens changed since)
        raise ValueError("a slot and head has no KV in these tokens: they cannot be written as a chunk")
    m = int(chosen.sum(-1).max()) if selection is not None else fewest
    m = max(1, min(m, fewest))
    if m >= n:
        return None
    # Chosen first, then by importance; absent never (the count above leaves every head enough present tokens).
    key = torch.where(chosen, torch.inf, rank)
    key = torch.where(present, key, -torch.inf)
    return key.topk(m, dim=-1).indices.sort(dim=-1).values


def first_missing(kept: torch.Tensor) -> int:
    """The first chunk position some slot or head does not keep (the chunk is inexact from there): the count of
    leading positions every slot and head keeps (`kept` ascending, fewer than the chunk's tokens).

    Example:
        >>> first_missing(torch.tensor([[[0, 1, 3]], [[0, 2, 3]]]))  # two slots: both keep position 0, not both 1
        1
    """
    return int((kept == torch.arange(kept.shape[-1])).all(dim=0).all(dim=0).long().cumprod(0).sum())


def gather(tensors: list[torch.Tensor], kept: torch.Tensor) -> list[torch.Tensor]:
    """Per slot, the kept tokens of ``[1, heads, n, dim]`` tensors: ``[1, heads, m, dim]``.

    Example:
        >>> keys = [torch.arange(4.0).view(1, 1, 4, 1)]  # one slot, one head, 4 tokens
        >>> gather(keys, torch.tensor([[[1, 3]]]))[0].flatten().tolist()
        [1.0, 3.0]
    """
    return [t.gather(2, kept[slot][None, :, :, None].expand(1, -1, -1, t.shape[-1]).to(t.device))
            for slot, t in enumerate(tensors)]
