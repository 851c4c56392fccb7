"""Which stored tokens a new turn reuses, and how an overflowing context is truncated.

Pure functions on token ids: the cache turns the resulting :class:`ReusePlan` into tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import TruncationConfig


@dataclass(frozen=True)
class ReusePlan:
    """The outcome of matching a new prompt against a session's stored tokens.

    Attributes:
        input_ids: The ids to feed the model, ``[1, L]`` (truncated when the context overflowed).
        keep: Indices into the stored sequence of the reused tokens, in order; reused token ``i`` sits at
            position ``i`` of ``input_ids``. Its length is the number of reused tokens.
        key_positions: Position each reused key is rotated to: ``arange(len(keep))`` normally, the stale
            original positions (``keep``) in ``naive`` mode.
        dropped: Number of tokens dropped by truncation (0 if the context did not overflow).
        common_prefix: Length of the longest common prefix of the prompt and the stored ids.

    Example:
        >>> stored, prompt = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 3, 9])  # an edited message
        >>> plan = plan_reuse(prompt, stored, TruncationConfig(), has_rope=True)
        >>> plan.input_ids.tolist(), plan.keep.tolist(), plan.reused, plan.dropped, plan.common_prefix
        ([[1, 2, 3, 9]], [0, 1, 2], 3, 0, 3)
    """

    input_ids: torch.Tensor
    keep: torch.Tensor
    key_positions: torch.Tensor
    dropped: int
    common_prefix: int

    @property
    def reused(self) -> int:
        return int(self.keep.numel())


def common_prefix_length(a: torch.Tensor, b: torch.Tensor | None) -> int:
    """Length of the longest common prefix of two 1-D id tensors.

    Example:
        >>> common_prefix_length(torch.tensor([1, 2, 3, 9]), torch.tensor([1, 2, 3, 4, 5])), common_prefix_length(
        ...     torch.tensor([1, 2]), None)
        (3, 0)
    """
    if b is None:
        return 0
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    diff = (a[:n] != b[:n].to(a.device)).nonzero()
    return int(diff[0, 0]) if diff.numel() else n


def tokens_to_drop(length: int, cfg: TruncationConfig) -> int:
    """How many tokens (after the first `keep_first`) are dropped from a sequence of `length` tokens.

    Nothing is dropped while the sequence fits. On overflow the oldest `truncation_ratio` of the window is
    dropped (engines drop half the history at once so that the next turns fit without truncating again),
    or more when the new tokens alone need more room. One token is always left to compute.

    Example:
        >>> config = TruncationConfig(context_window=100, truncation_ratio=0.5, keep_first=4)
        >>> tokens_to_drop(100, config), tokens_to_drop(101, config), tokens_to_drop(200, config)
        (0, 48, 100)
    """
    window = cfg.context_window
    if window is None or length <= window:
        return 0
    drop = max(length - window, math.ceil(cfg.truncation_ratio * (window - cfg.keep_first)))
    return min(drop, length - cfg.keep_first - 1)


def plan_reuse(
    input_ids: torch.Tensor, stored_ids: torch.Tensor | None, cfg: TruncationConfig, *, has_rope: bool,
    importance: torch.Tensor | None = None,
) -> ReusePlan:
    """Plans which stored tokens to reuse for a new prompt.

    Args:
        input_ids: The full prompt of this turn, 1-D.
        stored_ids: The ids the session's stored KV covers (1-D), or ``None`` on a miss.
        cfg: Truncation settings.
        has_rope: Whether the model's keys can be re-positioned; without RoPE, truncation recomputes.
        importance: ``"importance"`` mode: one score per stored token (cache/importance.py). Without scores
            covering the reusable tokens, or when the tokens that may be dropped are too few, the oldest are
            dropped (as ``"decoupled"``).

    Returns:
        A :class:`ReusePlan`. At least one token is always left to compute, so the model produces logits.

    Example:
        >>> config = TruncationConfig(context_window=8, truncation_ratio=0.5, keep_first=2)
        >>> stored, prompt = torch.arange(8), torch.arange(10)  # 2 new tokens overflow the window
        >>> plan = plan_reuse(prompt, stored, config, has_rope=True)
        >>> plan.dropped, plan.input_ids.tolist(), plan.keep.tolist(), plan.key_positions.tolist()
        (3, [[0, 1, 5, 6, 7, 8, 9]], [0, 1, 5, 6, 7], [0, 1, 2, 3, 4])
    """
    ids = input_ids.view(-1)
    lcp = common_prefix_length(ids, stored_ids)
    drop = tokens_to_drop(ids.numel(), cfg)
    k = cfg.keep_first
    mode = cfg.mode if has_rope else "recompute"
    if drop and mode == "importance":
        chosen = _least_important(importance, lcp, drop, cfg)
        if chosen is not None:
            kept = torch.ones(ids.numel(), dtype=torch.bool)
            kept[chosen] = False
            new_ids = ids[kept]
            keep = kept[:lcp].nonzero().view(-1)[: new_ids.numel() - 1]
            return ReusePlan(input_ids=new_ids.view(1, -1), keep=keep, key_positions=torch.arange(keep.numel()),
                             dropped=drop, common_prefix=lcp)
        mode = "decoupled"
    if drop:
        new_ids = torch.cat((ids[:k], ids[k + drop :]))
        if mode == "recompute" or lcp <= k + drop:
            # The sinks are at unchanged positions with unchanged context: reusing them is exact.
            keep = torch.arange(min(lcp, k))
        else:
            keep = torch.cat((torch.arange(k), torch.arange(k + drop, lcp)))
    else:
        new_ids = ids
        keep = torch.arange(lcp)
    keep = keep[: new_ids.numel() - 1]
    positions = keep.clone() if (mode == "naive" and drop) else torch.arange(keep.numel())
    return ReusePlan(
        input_ids=new_ids.view(1, -1), keep=keep, key_positions=positions, dropped=drop, common_prefix=lcp
    )


def _least_important(importance: torch.Tensor | None, lcp: int, drop: int, cfg: TruncationConfig):
    """The `drop` least important reusable tokens (indices), sinks and the last `keep_recent` reusable ones
    excepted; None when the scores do not cover the reusable tokens or too few may be dropped."""
    if importance is None or importance.numel() < lcp:
        return None
    first, last = cfg.keep_first, lcp - cfg.keep_recent
    if last - first < drop:
        return None
    scores = importance[first:last].float()
    # Ties (e.g. tokens no recent query attended to) go to the oldest first: the decoupled order.
    order = torch.argsort(scores, stable=True)
    return order[:drop] + first
