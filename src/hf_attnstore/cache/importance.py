"""Importance scores: how much attention each token of a session receives, computed beside SDPA.

ALISA (ISCA'24) ranks a token by the attention weights it received from the most recent queries (the last
`score_window` of them); H2O by the weights it received from every query so far. Both need attention weights,
which SDPA never materializes. So the model runs an attention function of our own, registered through
transformers' `AttentionInterface` (upstream.py): it calls SDPA for the output, unchanged, and, while a turn
that scores is in its forward, also computes the softmax of the last `w` queries against every key the layer
attends to, O(w·n) per layer where the attention is O(q·n). Outside such a forward it is exactly SDPA.

Scores are kept per KV slot and per KV head, over the session's tokens (indexed by position in the session,
whichever of them the device still holds): ``scores[slot]`` is ``[kv_heads, n]`` float32 on the device. A query
head's weights count for the KV head it reads (grouped-query attention sums its group). They are persisted with
the session, fp32 (4 bytes per token, layer and KV head: under 1% of SmolLM2's KV, and H2O's sums over every
query outgrow fp16's 65,504 within ~15k tokens), as tensors of its state (states.py) named by what they sum
(:func:`score_name`), so a resumed session knows its important tokens before its first forward, and a turn of
another policy or window never takes them for its own.

Example:
    >>> scorer = Scorer({0: 0}, policy="alisa", window=2)
    >>> q, k = torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 3, 4)  # 2 query heads share 1 KV head
    >>> scorer.observe(type("Attention", (), {"layer_idx": 0})(), q, k, None)
    >>> scorer.scores[0]  # the last 2 queries spread their weights evenly over the keys each may see
    tensor([[1.6667, 1.6667, 0.6667]])
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar

import torch
from torch import nn

from . import query_aware, upstream

ATTENTION_NAME, EAGER_NAME = "attnstore_sdpa", "attnstore_eager"
# Queries scored per matrix product: bounds the temporary [heads, block, n] weights of H2O's full prefill.
_QUERY_BLOCK = 256
_active: ContextVar["Scorer | BatchScorer | None"] = ContextVar("hf_attnstore_scorer", default=None)
_registered = False


def scored_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, **kwargs):
    """SDPA, plus importance scores for the active turn's scorer (if any): registered as ``attnstore_sdpa``.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> before = model(ids).logits
        >>> enable(model)  # the model now calls scored_attention
        >>> torch.allclose(model(ids).logits, before, atol=1e-5)  # the same attention while no turn scores
        True
    """
    # SDPA, unless a query-aware turn selects per query (query_aware.py): the one attention function serves both.
    output = query_aware.attention(module, query, key, value, attention_mask, **kwargs)
    scorer = _active.get()
    if scorer is not None:
        scorer.observe(module, query, key, kwargs.get("scaling"))
    return output


def scored_eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, **kwargs):
    """The family's eager attention, whose weights (softcapping and all) are the scores: ``attnstore_eager``.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
        >>> upstream.set_attention_implementation(model, "eager")
        >>> enable(model)
        >>> upstream.attention_implementation(model) == EAGER_NAME  # "attnstore_eager": this function
        True
    """
    output, weights = upstream.eager_attention(module)(module, query, key, value, attention_mask, **kwargs)
    scorer = _active.get()
    if scorer is not None:
        scorer.observe(module, query, key, kwargs.get("scaling"), weights)
    return output, weights


def enable(model: nn.Module) -> None:
    """Makes `model` run :func:`scored_attention` if it runs SDPA, :func:`scored_eager_attention` if it runs
    eager attention (families without SDPA, e.g. gemma2): the same attention while no scoring turn runs.

    Raises:
        ValueError: The model runs another attention (flash, flex): scores are computed beside SDPA or eager.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
        >>> upstream.attention_implementation(model)
        'sdpa'
        >>> enable(model)
        >>> upstream.attention_implementation(model) == ATTENTION_NAME
        True
    """
    global _registered
    if not _registered:
        upstream.register_attention(ATTENTION_NAME, scored_attention, upstream.SDPA)
        upstream.register_attention(EAGER_NAME, scored_eager_attention, upstream.EAGER)
        _registered = True
    implementation = upstream.attention_implementation(model)
    if implementation in (ATTENTION_NAME, EAGER_NAME):
        return
    if implementation not in (upstream.SDPA, upstream.EAGER):
        raise ValueError(f"importance scores are computed beside SDPA or eager attention, but the model runs "
                         f"{implementation!r}: load it with `attn_implementation=\"sdpa\"` to use `kv_budget` or "
                         "`truncation=\"importance\"`")
    upstream.set_attention_implementation(model, ATTENTION_NAME if implementation == upstream.SDPA else EAGER_NAME)


class Scorer:
    """The importance of every token of one session, per KV slot and KV head (see the module docstring).

    Args:
        slot_of: Model layer index -> KV slot, for the layers that are scored (full attention).
        policy: ``"alisa"`` (weights from the last `window` queries) or ``"h2o"`` (from every query).
        window: ALISA's query window.
        columns: Slot -> ``[kv_heads, K]`` session positions of the K keys that layer attends to in the current
            forward, or None when they are simply ``0..K-1`` (a dense layer).
        initial: Slot -> ``[kv_heads, n]`` scores the session had when this turn began (persisted).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
        >>> enable(model)
        >>> scorer = Scorer({0: 0, 1: 1}, policy="h2o")  # layers 0 and 1 are KV slots 0 and 1
        >>> with scoring(scorer):
        ...     _ = model(torch.tensor([[1, 2, 3, 4]]))
        >>> scorer.has_scores, tuple(scorer.scores[0].shape)  # per slot: [kv_heads, tokens]
        (True, (1, 4))
        >>> round(float(scorer.scores[0].sum()), 4)  # h2o: every query's weights, which sum to 1 per query head
        8.0
    """

    def __init__(self, slot_of: dict[int, int], policy: str = "alisa", window: int = 32,
                 columns: Callable[[int], torch.Tensor | None] | None = None,
                 initial: dict[int, torch.Tensor] | None = None):
        self.slot_of, self.policy, self.window = dict(slot_of), policy, int(window)
        self._columns = columns or (lambda slot: None)
        self.scores: dict[int, torch.Tensor] = {slot: s.float() for slot, s in (initial or {}).items()}
        # ALISA: the rows in the window, oldest first: (weights [kv_heads, K], their columns or None, rows counted).
        # A resumed session's initial scores are one entry counted as a whole window (they summed the last
        # turn's last `window` queries), which leaves once `window` new queries have come.
        self._rows: dict[int, deque] = {slot: deque([(s, None, self.window)]) for slot, s in self.scores.items()}
        self._counted: dict[int, int] = {slot: self.window for slot in self.scores}

    @property
    def has_scores(self) -> bool:
        """Whether every scored slot has scores (a resumed session's, or this turn's so far)."""
        return bool(self.slot_of) and all(slot in self.scores for slot in self.slot_of.values())

    def scores_for(self, slot: int, columns: torch.Tensor) -> torch.Tensor:
        """The scores of the tokens at session positions `columns` (``[kv_heads, K]``); zero past the known."""
        scores = self._grow(slot, int(columns.max()) + 1 if columns.numel() else 0)
        return scores.gather(1, columns.to(scores.device))

    def _grow(self, slot: int, length: int) -> torch.Tensor:
        """Slot `slot`'s scores, extended with zeros to cover `length` tokens."""
        scores = self.scores[slot]
        if scores.shape[1] < length:
            scores = torch.cat([scores, scores.new_zeros(scores.shape[0], length - scores.shape[1])], dim=1)
            self.scores[slot] = scores
        return scores

    @torch.no_grad()
    def observe(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, scaling: float | None,
                weights: torch.Tensor | None = None, columns_of: Callable[[int], torch.Tensor | None] | None = None,
                total: int | None = None):
        """Adds the weights this forward's queries give the layer's keys (``query`` ``[1, q_heads, q, d]``,
        ``key`` ``[1, kv_heads, K, d]``, the last q keys being the queries' own; `weights`, ``[1, q_heads, q, K]``,
        when the attention computed them: eager). `columns_of`: the keys' session positions per slot, in place
        of the turn's (a batch row's, :class:`BatchScorer`); `total`: one past the largest of them, when the
        caller knows it (reading it from the columns waits for the device)."""
        slot = self.slot_of.get(getattr(module, "layer_idx", None))
        if slot is None or query.shape[0] != 1:
            return
        q, n_keys = query.shape[2], key.shape[2]
        first = 0 if self.policy == "h2o" else max(q - self.window, 0)
        columns = (columns_of or self._columns)(slot)
        heads = key.shape[1]
        if columns is None:
            columns_total = n_keys
        elif total is not None:
            columns_total = total
        else:
            columns_total = int(columns.max()) + 1 if columns.numel() else 0
        scores = self.scores.get(slot)
        if scores is None or scores.shape[0] != heads:
            scores = self.scores[slot] = torch.zeros(heads, columns_total, device=key.device)
            self._rows[slot], self._counted[slot] = deque(), 0
        scores = self._grow(slot, columns_total)
        for start in range(first, q, _QUERY_BLOCK):
            last = min(start + _QUERY_BLOCK, q)
            if weights is not None:
                rows = weights[0, :, start:last].float()
                rows = rows.view(heads, -1, last - start, n_keys).sum(1)
            else:
                rows = self._weights(query, key, scaling, start, last)  # [kv_heads, m, K]
            if self.policy == "h2o":
                self._add(scores, rows.sum(1), columns)
                continue
            for i in range(rows.shape[1]):
                row = rows[:, i]
                self._add(scores, row, columns)
                self._rows[slot].append((row, columns, 1))
                self._counted[slot] += 1
            self._age(slot, scores)

    def _age(self, slot: int, scores: torch.Tensor) -> None:
        """ALISA: drops the rows that left the window of the last `window` queries."""
        rows = self._rows[slot]
        while rows and self._counted[slot] > self.window:
            row, columns, counted = rows[0]
            excess = self._counted[slot] - self.window
            if counted <= excess:
                rows.popleft()
                self._counted[slot] -= counted
                self._add(scores, -row, columns)
            else:
                # A resumed session's scores stand for `counted` queries whose rows were not kept: the oldest
                # `excess` of them leave pro rata, so that short turns do not keep them for good (which would
                # turn the window into H2O's sum over every query).
                part = row * (excess / counted)
                rows[0] = (row - part, columns, counted - excess)
                self._counted[slot] -= excess
                self._add(scores, -part, columns)

    @staticmethod
    def _add(scores: torch.Tensor, row: torch.Tensor, columns: torch.Tensor | None) -> None:
        if columns is None:
            scores[:, : row.shape[1]] += row
        else:
            scores.scatter_add_(1, columns.to(scores.device), row)

    @staticmethod
    def _weights(query: torch.Tensor, key: torch.Tensor, scaling: float | None, first: int, last: int):
        """Softmax weights of queries ``first..last-1`` (of the forward's q) over the K keys, causal, summed over
        the query heads of each KV head: ``[kv_heads, last - first, K]``."""
        _, q_heads, q, dim = query.shape
        kv_heads, n_keys = key.shape[1], key.shape[2]
        group = q_heads // kv_heads
        m = last - first
        queries = query[0, :, first:last].float().reshape(kv_heads, group * m, dim)
        logits = torch.bmm(queries, key[0].float().transpose(1, 2))
        logits = logits * (scaling if scaling is not None else dim ** -0.5)
        logits = logits.view(kv_heads, group, m, n_keys)
        # Query t of the forward sees every earlier key and the forward's own keys up to itself.
        limit = n_keys - q + torch.arange(first, last, device=key.device) + 1
        future = torch.arange(n_keys, device=key.device)[None, :] >= limit[:, None]
        logits.masked_fill_(future[None, None], float("-inf"))
        return logits.softmax(-1).sum(1)


class BatchScorer:
    """Scores a batched forward (a decoding step of several sessions, serving/batching.py): each row's queries and
    keys go to that row's own :class:`Scorer`, so a session decoded in a batch gets the scores a solo turn's steps
    would add. Rows are left-padded: row ``b``'s keys start at column ``first[b]``.

    Args:
        rows: Per row of the batch, ``(scorer, first, columns_of, total)``: the session's scorer (None: not
            scored), its first live key column, the session positions of its live keys per KV slot (a callable; it
            returns None where they are simply ``0..K-1``) and one past the largest of them.
        device: Where the forward runs (the rows' first columns are put there once, not per layer).
    """

    def __init__(self, rows: list[tuple[Scorer | None, int, Callable[[int], torch.Tensor | None], int]],
                 device: torch.device):
        self.rows = rows
        self.slots = next(scorer.slot_of for scorer, *_ in rows if scorer is not None)  # one pipeline: one layout
        self._firsts = torch.tensor([first for _, first, _, _ in rows], device=device)

    @torch.no_grad()
    def observe(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, scaling: float | None,
                weights: torch.Tensor | None = None) -> None:
        if getattr(module, "layer_idx", None) not in self.slots:
            return  # a layer that is not scored (sliding window)
        if weights is None and query.shape[2] == 1:
            weights = self._weights(query, key, scaling)  # every row's at once: one product, not one per row
        for b, (scorer, first, columns_of, total) in enumerate(self.rows):
            if scorer is not None:
                scorer.observe(module, query[b : b + 1], key[b : b + 1, :, first:], scaling,
                               None if weights is None else weights[b : b + 1, :, :, first:], columns_of, total)

    def _weights(self, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Softmax weights of a decoding step's queries ``[B, q_heads, 1, d]`` over each row's live keys (the
        padding left of ``first`` masked): ``[B, q_heads, 1, K]``, as eager attention would return them."""
        batch, q_heads, _, dim = query.shape
        kv_heads, n_keys = key.shape[1], key.shape[2]
        logits = torch.matmul(query.float().view(batch, kv_heads, q_heads // kv_heads, dim),
                              key.float().transpose(2, 3)) * (scaling if scaling is not None else dim ** -0.5)
        padding = torch.arange(n_keys, device=key.device)[None, :] < self._firsts[:, None]
        logits.masked_fill_(padding[:, None, None, :], float("-inf"))
        return logits.softmax(-1).view(batch, q_heads, 1, n_keys)


def score_name(slot: int, policy: str, window: int) -> str:
    """The state tensor that keeps KV slot `slot`'s scores: ``I{slot:04d}.h2o`` (weights from every query) or
    ``I{slot:04d}.alisa{window}`` (from the last `window` queries). The label is what the scores sum: a turn
    reads only scores of its own policy and window, and scores anew otherwise.

    Example:
        >>> score_name(3, "alisa", 32), score_name(3, "h2o", 32)
        ('I0003.alisa32', 'I0003.h2o')
    """
    return f"I{slot:04d}." + ("h2o" if policy == "h2o" else f"alisa{window}")


def scoring(scorer: "Scorer | BatchScorer | None"):
    """A context in which the model's scored attention feeds `scorer` (nothing when None).

    Example:
        >>> scorer = Scorer({0: 0})
        >>> with scoring(scorer) as active:
        ...     active is scorer  # scored attention feeds it inside the block
        True
        >>> with scoring(None):  # no scoring turn: nothing happens
        ...     pass
    """
    if scorer is None:
        return contextlib.nullcontext()
    return _activated(scorer)


@contextlib.contextmanager
def _activated(scorer: "Scorer | BatchScorer"):
    token = _active.set(scorer)
    try:
        yield scorer
    finally:
        _active.reset(token)


def token_importance(scores: dict[int, torch.Tensor], length: int) -> torch.Tensor:
    """One score per token of the first `length`: each slot's scores, averaged over its KV heads and normalized
    to sum 1 per slot, summed over slots (so that no layer's scale dominates). ``[length]`` float32, CPU.

    Example:
        >>> scores = {0: torch.tensor([[1.0, 3.0]]), 1: torch.tensor([[20.0, 20.0]])}  # two slots, one KV head each
        >>> token_importance(scores, 2).tolist()  # each slot normalized to 1, then summed
        [0.75, 1.25]
    """
    total = torch.zeros(length)
    for s in scores.values():
        per_token = s[:, :length].float().mean(0).cpu()
        per_token = per_token / per_token.sum().clamp_min(1e-12)
        total[: per_token.numel()] += per_token
    return total
