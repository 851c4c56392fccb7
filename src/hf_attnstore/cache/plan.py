"""A turn's reuse plan: one pure function from what the store found to what the turn does.

:meth:`AttnStore.find <hf_attnstore.store.AttnStore.find>` returns, in one call, the session's own stored KV and
another session's longer shared prefix, with what the store verified of them (states, tokens without KV).
:func:`plan_turn` turns that, the prompt, the truncation settings and a few facts of the model into a
:class:`TurnPlan`: which match the turn reuses (its own, a shared one, or none), which of its tokens
(:class:`~hf_attnstore.cache.truncation.ReusePlan`), and the evicted head to recompute first. No I/O, no model,
no store: it is tested on plain tensors. The turn (turn.py) then executes the plan.

Example:
    >>> import torch
    >>> from hf_attnstore.store import Found, Match
    >>> own = Match("alice", torch.tensor([1, 2, 3]), None, "disk")
    >>> plan = plan_turn(torch.tensor([1, 2, 3, 4]), TruncationConfig(), Found(own), ModelFacts(has_rope=True))
    >>> plan.reused, plan.kv_source, plan.shared_from
    (3, 'disk', None)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..store import Found, Match
from ..store.states import SessionState
from .config import TruncationConfig
from .importance import score_name, token_importance
from .truncation import ReusePlan, plan_reuse, tokens_to_drop


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs to know of the model and the turn.

    Attributes:
        has_rope: Whether cached keys can be re-positioned (else truncation recomputes).
        has_state: A hybrid model: it reuses its stored states after exactly their tokens, or nothing.
        sparse: A turn kept sparse (``kv_budget``): it may reuse tokens loaded without KV (sparse cold copies).

    Example:
        >>> ModelFacts(has_rope=True).has_state
        False
    """

    has_rope: bool
    has_state: bool = False
    sparse: bool = False


@dataclass(frozen=True)
class TurnPlan:
    """What a turn reuses, decided before its first forward.

    Attributes:
        reuse: Which of the match's tokens the prompt reuses, and the ids to feed (truncated on overflow).
        source: The match the reused KV comes from, or None (a miss: nothing is reused).
        shared: Whether `source` is another session's (a shared prefix).
        head: Leading tokens of `source` to recompute before the first forward (its evicted head, up to the last
            reused token in it); 0: none.
        head_reused: Of the reused tokens, how many lie in that head (their KV is computed, not loaded).

    Example:
        >>> plan = miss_plan(torch.tensor([1, 2, 3]), TruncationConfig(), ModelFacts(has_rope=True))
        >>> plan.reused, plan.kv_source
        (0, 'miss')
    """

    reuse: ReusePlan
    source: Match | None = None
    shared: bool = False
    head: int = 0
    head_reused: int = 0

    @property
    def reused(self) -> int:
        """How many tokens of the prompt come from the store."""
        return self.reuse.reused

    @property
    def kv_source(self) -> str:
        """Where the reused KV comes from: ``"host"``, ``"disk"``, ``"remote"``, or ``"miss"``."""
        return self.source.tier if self.source is not None and self.reused else "miss"

    @property
    def shared_from(self) -> str | None:
        """The other session whose stored prefix the turn reuses (None: its own, or none)."""
        return self.source.session_id if self.shared and self.reused else None

    @property
    def state(self) -> SessionState | None:
        """The stored states (and scores) of the reused match, verified by the store; None on a miss."""
        return self.source.state if self.source is not None and self.reused else None

    def without_reuse(self) -> "TurnPlan":
        """The same turn recomputed from scratch (its stored KV proved unreadable): the same ids, nothing reused.

        Example:
            >>> plan = miss_plan(torch.tensor([1, 2, 3]), TruncationConfig(), ModelFacts(has_rope=True))
            >>> plan.without_reuse().reuse.input_ids.tolist()
            [[1, 2, 3]]
        """
        empty = torch.empty(0, dtype=torch.long)
        return TurnPlan(dataclasses.replace(self.reuse, keep=empty, key_positions=empty, common_prefix=0))


def shares(prompt: torch.Tensor, truncation: TruncationConfig, facts: ModelFacts) -> bool:
    """Whether a turn may start from another session's prefix: not when truncation cuts the prompt (its reuse is the
    session's own truncated history), nor for a hybrid model (its states belong to one history).

    Example:
        >>> shares(torch.arange(10), TruncationConfig(context_window=8), ModelFacts(has_rope=True))
        False
    """
    return not facts.has_state and not tokens_to_drop(prompt.numel(), truncation)


def miss_plan(prompt: torch.Tensor, truncation: TruncationConfig, facts: ModelFacts) -> TurnPlan:
    """The plan of a turn that reuses nothing (the prompt truncated as it would be anyway).

    Example:
        >>> cut = TruncationConfig(context_window=8, keep_first=2)
        >>> miss_plan(torch.arange(10), cut, ModelFacts(True)).reuse.dropped
        3
    """
    return TurnPlan(plan_reuse(prompt, None, truncation, has_rope=facts.has_rope))


def stored_scores(state: SessionState | None, names: dict[int, str], heads: int) -> dict[int, torch.Tensor] | None:
    """The importance scores kept with a session (KV slot -> ``[kv_heads, tokens]`` fp32, non-negative), read from
    its verified `state` under `names` (slot -> the state tensor of this turn's policy and window,
    `importance.score_name`); None when any is missing or of another shape (the turn scores anew).

    Example:
        >>> stored_scores(None, {0: "I0000.h2o"}, 2) is None
        True
    """
    if state is None:
        return None
    out = {}
    for slot, name in names.items():
        t = state.tensors.get(name)
        if t is None or tuple(t.shape) != (heads, state.tokens):
            return None
        out[slot] = torch.nan_to_num(t.float(), nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0)
    return out


def score_names(slots, policy: str, window: int) -> dict[int, str]:
    """The state tensors holding each scored KV slot's importance under `policy` and `window` (see `stored_scores`).

    Example:
        >>> score_names([0, 1], "h2o", 16)
        {0: 'I0000.h2o', 1: 'I0001.h2o'}
    """
    return {slot: score_name(slot, policy, window) for slot in slots}


def plan_turn(prompt: torch.Tensor, truncation: TruncationConfig, found: Found, facts: ModelFacts,
              scores: dict[int, torch.Tensor] | None = None) -> TurnPlan:
    """The turn's plan: which stored KV the prompt reuses, from what `AttnStore.find` returned.

    The rules, in order:

    * The session's own match is reused up to its longest common prefix with the prompt, after truncation
      (`truncation.plan_reuse`; importance truncation ranks by the own stored `scores`).
    * A sparse turn's reused tokens must hold one tensor per layer: where some were loaded without KV (sparse
      cold copies), the plan is cut to where every KV slot and head keeps as many (:func:`fit_present`).
    * A hybrid model reuses its verified states after exactly their tokens, or nothing (states cannot be cut).
    * Another session's match replaces the own one when it reuses more and nothing is truncated.
    * An own match whose head was evicted recomputes that head up to the last reused token in it; when every
      reused token lies in it, recomputing them is all the reuse would save: a miss.

    Args:
        prompt: The turn's whole prompt, 1-D ids.
        truncation: The truncation settings.
        found: What the store found (`AttnStore.find`).
        facts: What the plan needs to know of the model.
        scores: The own match's stored importance scores (`stored_scores`), for ``truncation="importance"``.

    Returns:
        A :class:`TurnPlan`.

    Example:
        >>> from hf_attnstore.store import Found, Match
        >>> own = Match("bob", torch.tensor([1, 2]), None, "host")
        >>> other = Match("alice", torch.tensor([1, 2, 3, 4]), None, "disk")
        >>> plan = plan_turn(torch.tensor([1, 2, 3, 4, 5]), TruncationConfig(), Found(own, other), ModelFacts(True))
        >>> plan.reused, plan.shared_from
        (4, 'alice')
    """
    own = found.own
    if own is not None and facts.has_state and own.state is None:
        own = None  # a hybrid model without its states reuses nothing
    weights = None
    if truncation.mode == "importance" and scores:
        weights = token_importance(scores, next(iter(scores.values())).shape[1])
    end = own.state.tokens if own is not None and facts.has_state else None
    plan = _matched(prompt, own, end, truncation, facts, weights)
    if own is not None and facts.has_state and (plan.dropped or plan.reused != own.state.tokens):
        # A prompt that diverges before the states' end, or a truncation, is recomputed.
        return miss_plan(prompt, truncation, facts)
    if found.shared is not None and not plan.dropped and not facts.has_state:
        shared = _matched(prompt, found.shared, None, truncation, facts, None)
        if not shared.dropped and shared.reused > plan.reused:
            return TurnPlan(shared, found.shared, shared=True)
    if own is None or not plan.reused:
        return TurnPlan(plan)
    if own.head and not facts.has_state:
        kept = plan.keep[plan.keep < own.head]
        if kept.numel() == plan.reused:
            return miss_plan(prompt, truncation, facts)
        need = int(kept.max()) + 1 if kept.numel() else 0
        return TurnPlan(plan, own, head=need, head_reused=int(kept.numel()))
    return TurnPlan(plan, own)


def _matched(prompt: torch.Tensor, match: Match | None, end: int | None, truncation: TruncationConfig,
             facts: ModelFacts, weights: torch.Tensor | None) -> ReusePlan:
    """The reuse of a match's first `end` tokens (None: all of them), fitted to its tokens with KV."""
    ids = None if match is None else match.token_ids[:end]
    plan = plan_reuse(prompt, ids, truncation, has_rope=facts.has_rope, importance=weights)
    absent = match.absent if facts.sparse and match is not None else None
    return fit_present(prompt, plan, match, absent, truncation, facts, weights)


def fit_present(prompt: torch.Tensor, plan: ReusePlan, match: Match | None, absent: torch.Tensor | None,
                truncation: TruncationConfig, facts: ModelFacts, weights: torch.Tensor | None) -> ReusePlan:
    """The plan, cut so that a sparse turn's reused tokens hold one tensor per layer: when some were loaded from
    sparse cold copies without KV (`absent`, ``[slots, heads, n]``), every KV slot and head must keep the same
    number of them. A prefix is cut to the longest such prefix (`rectangular_prefix`: a chunk boundary at worst);
    a truncated history that keeps tokens without KV, to what lies before the first of them. The rest is
    recomputed.

    Example:
        >>> m = Match("a", torch.arange(4), None, "disk")
        >>> absent = torch.tensor([[[False, False, True, False], [False, False, False, False]]])
        >>> plan = plan_reuse(torch.arange(6), m.token_ids, TruncationConfig(), has_rope=True)
        >>> fit_present(torch.arange(6), plan, m, absent, TruncationConfig(), ModelFacts(True, sparse=True),
        ...             None).reused
        2
    """
    if absent is None or match is None:
        return plan
    for _ in range(3):  # each cut leaves fewer tokens; the second always fits
        kept = absent[:, :, plan.keep]
        if not plan.reused or not bool(kept.any()):
            return plan
        if torch.equal(plan.keep, torch.arange(plan.reused)):
            end = rectangular_prefix(kept, plan.reused)
            if end == plan.reused:
                return plan
        else:
            end = int(absent.any(dim=0).any(dim=0).nonzero()[0])
        plan = plan_reuse(prompt, match.token_ids[:end], truncation, has_rope=facts.has_rope, importance=weights)
    return plan_reuse(prompt, None, truncation, has_rope=facts.has_rope)


def rectangular_prefix(absent: torch.Tensor | None, end: int) -> int:
    """The longest prefix of `end` tokens in which every KV slot and head has KV for the same number of tokens
    (`absent`: ``[slots, heads, end]``, tokens loaded from sparse cold copies without KV): what a sparse layer can
    hold as one tensor. Chunks keep one count each (store/sparse_copies.py), so this ends at a chunk boundary at
    worst.

    Example:
        >>> rectangular_prefix(torch.tensor([[[False, True, False], [True, False, False]]]), 3)
        3
    """
    if absent is None or not bool(absent.any()):
        return end
    counts = (~absent).to(torch.int32).cumsum(dim=2, dtype=torch.int32).view(-1, end)
    even = (counts == counts[:1]).all(dim=0).nonzero()
    return int(even[-1]) + 1 if even.numel() else 0
