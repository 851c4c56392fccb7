"""A sparse session's row in the batch cache (``kv_budget``): it re-selects before every decoding step, as the
solo turn's sparse layers do before every forward (cache/sparse.py).

A member joins with its kept selection (`AttnStoreSparseLayer.select_now`). Before each step the runner asks
its :class:`SparseRow` to keep the budget of the session's length: in each layer, per KV head, the sinks, the
recent tokens and the most important others by the scores the member's own scorer holds (the batch scores its
steps, `importance.BatchScorer`), exactly the selection the solo layer would make at that step. The row's kept
keys are written right-aligned and the freed columns on its left become masked padding (`BatchKV.keep_in_row`).
So a sparse turn decodes the tokens it decodes alone, and its row stays at its budget instead of growing by
every decoded token.

A dropped token may be one this turn decoded, whose KV the session must still store: the row keeps a copy of
each step's new KV (one token per layer) and hands those to the session when the member leaves, rather than
reading them back from the row.
"""

from __future__ import annotations

import torch

from ..cache.config import SparseConfig
from ..cache.sparse import select


class SparseRow:
    """The kept columns of one sparse member and what it decoded (see the module docstring).

    Args:
        config: The session's SparseConfig.
        scorer: The turn's importance scorer (None for the ``"streaming"`` policy, which selects by recency).
        columns: KV slot -> ``[kv_heads, K]`` session positions of the keys the row holds, ascending.
        slot_of: Model layer index -> KV slot, for the layers kept sparse (every layer of the batch cache).

    Example:
        >>> row = SparseRow(...)  # a kv_budget member of a batch  # doctest: +SKIP
    """

    def __init__(self, config: SparseConfig, scorer, columns: dict[int, torch.Tensor], slot_of: dict[int, int]):
        self.config, self.scorer, self.slot_of = config, scorer, dict(slot_of)
        self.columns = {slot: c.clone() for slot, c in columns.items()}
        self.decoded: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per fed token, per layer (k, v)
        # The first step whose token attended to fewer than all the tokens before it: its KV and all after are
        # stored labelled inexact (`AttnStoreCache.append_computed`).
        self.sparse_from: int | None = None

    def before_step(self, cache, row: int, length: int) -> None:
        """Keeps the budget of `length` tokens (the session before this step's token) in `row` of the batch
        cache, then counts the step's token (at position `length`) among the row's columns."""
        held = next(iter(self.columns.values())).shape[1]
        keep = self.config.budget(length)
        if keep < held:
            picks = []
            for idx in range(len(cache.layers)):
                slot = self.slot_of[idx]
                columns = self.columns[slot]
                scores = self.scorer.scores_for(slot, columns) if self.config.scored else None
                picked = select(columns, scores, keep, self.config)
                self.columns[slot] = columns.gather(1, picked)
                picks.append(picked)
            cache.keep_in_row(row, picks)
        if self.sparse_from is None and min(c.shape[1] for c in self.columns.values()) < length:
            self.sparse_from = length
        for slot, columns in self.columns.items():
            step = torch.full((columns.shape[0], 1), length, dtype=columns.dtype, device=columns.device)
            self.columns[slot] = torch.cat([columns, step], dim=1)

    def columns_of(self, slot: int) -> torch.Tensor:
        """The session positions of the row's keys in slot `slot` during the step (for `importance.BatchScorer`)."""
        return self.columns[slot]

    def after_step(self, cache, row: int) -> None:
        """Keeps a copy of the step's new KV (the row's last column in every layer)."""
        self.decoded.append([(layer.keys[row : row + 1, :, -1:].clone(), layer.values[row : row + 1, :, -1:].clone())
                             for layer in cache.layers])

    def decoded_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the KV of every token fed in the batch ``[1, kv_heads, fed, head_dim]``, in order."""
        layers = range(len(self.decoded[0]))
        return ([torch.cat([step[i][0] for step in self.decoded], dim=2) for i in layers],
                [torch.cat([step[i][1] for step in self.decoded], dim=2) for i in layers])
