"""What one :meth:`AttnStore.find <hf_attnstore.store.AttnStore.find>` call returns: everything a turn needs to plan
its reuse, checked by the store (vLLM's ``get_computed_blocks``, SGLang's ``match_prefix``).

A :class:`Match` is one stored session a turn may start from: its snapshot (which holds the session's buffers, so
nothing the turn reads goes while it holds them), the ids whose KV it may reuse, and what the store verified of it
(a hybrid model's states, sparse copies' absent tokens). :class:`Found` holds the session's own match and, when
another session begins with a longer prefix of the prompt, that one. A caller never re-checks these: any doubt
was a miss already (`None`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .buffer import SessionKV
from .format import prefix_digest
from .load_handle import LoadError
from .state import SessionState


@dataclass(frozen=True)
class Match:
    """One stored session a turn may reuse KV from.

    Attributes:
        session_id: The session the KV was stored by.
        token_ids: The ids whose KV may be reused, ``[n]`` (int64, CPU): for an exact lookup, the session's tokens
            before the first one computed under sparse attention; for a shared prefix, the prefix.
        snapshot: The stored KV (the turn loads from it); None only where a planner is tested on plain tensors.
        tier: Where the KV comes from: ``"host"``, ``"disk"`` or ``"remote"``.
        head: Leading tokens without KV (a partially evicted session, or chunks cheaper to recompute): the
            turn recomputes them.
        absent: Where tokens lack KV, ``[kv_slots, kv_heads, len(token_ids)]`` (sparse cold copies), or None.
        state: The states (and scores) stored with the session, verified to be this session's and to summarize
            exactly its first ``state.tokens`` ids; None when there are none or they are in doubt.
            `absent` and `state` are known once the first layer is read: for a match still loading, only when
            `find` waited for it (`wait_first`), else None.

    Example:
        >>> m = Match("alice", torch.tensor([5, 6, 7]), None, "host")
        >>> m.length
        3
    """

    session_id: str
    token_ids: torch.Tensor
    snapshot: SessionKV | None
    tier: str
    head: int = 0
    absent: torch.Tensor | None = None
    state: SessionState | None = None

    @property
    def length(self) -> int:
        """How many tokens the match offers."""
        return int(self.token_ids.numel())


@dataclass(frozen=True)
class Found:
    """The result of :meth:`AttnStore.find <hf_attnstore.store.AttnStore.find>`.

    Attributes:
        own: The session's own stored KV, or None (a miss).
        shared: Another session whose stored ids begin with a longer prefix of the prompt than `own` shares with
            it (a shared system prompt, a regenerated or edited turn, a branch), or None.

    Example:
        >>> Found(None, None).own is None
        True
    """

    own: Match | None
    shared: Match | None = None


def verified_state(snapshot: SessionKV) -> SessionState | None:
    """The states stored with `snapshot` if they are the snapshot's session's and summarize exactly its first
    ``state.tokens`` ids (their digest matches), else None. A snapshot still loading must have its first layer
    (the loader reads and verifies the state before it).

    Example:
        >>> from hf_attnstore.store import AttnStore
        >>> from hf_attnstore.store.state import SessionState
        >>> store = AttnStore(host_bytes="1MiB")
        >>> kv = [torch.zeros(1, 2, 3, 4)]
        >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
        ...     turn.close(SessionState.capture(3, {"L0000.r0": torch.ones(2, 4)}))  # a hybrid model's states
        >>> verified_state(store.lookup("chat-1", "model-a")).tokens
        3
    """
    state = snapshot.state if snapshot.loader is None else snapshot.source.state
    if state is None or snapshot.key is None or state.tokens > snapshot.length or state.key != snapshot.key \
            or state.prefix != prefix_digest(snapshot.key[0], snapshot.token_ids[: state.tokens]):
        return None
    return state


def match_of(snapshot: SessionKV, end: int | None, exact: bool, wait_first: bool) -> Match | None:
    """The :class:`Match` of a snapshot's first `end` tokens (None: all); `exact`: only those before the first
    inexact one. `wait_first`: a snapshot still loading is waited for until its first layer, whose check covers
    the states and the absent tokens (call without the store's lock: the load thread reports under it); a load
    that failed is a miss (None).

    Example:
        >>> from hf_attnstore.store import AttnStore
        >>> store = AttnStore(host_bytes="1MiB")
        >>> kv = [torch.zeros(1, 2, 3, 4)]
        >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv, inexact_at=2)  # token 7 under sparse attention
        >>> match = match_of(store.lookup("chat-1", "model-a"), None, exact=True, wait_first=True)
        >>> match.session_id, match.token_ids.tolist(), match.tier
        ('chat-1', [5, 6], 'host')
    """
    if wait_first and snapshot.loader is not None:
        try:
            snapshot.loader.wait_layer(0)
        except LoadError:
            return None
    end = snapshot.length if end is None else min(end, snapshot.length)
    if exact:
        end = snapshot.exact_prefix(end)
    absent = snapshot.absent() if wait_first or snapshot.loader is None else None
    state = verified_state(snapshot) if wait_first or snapshot.loader is None else None
    return Match(session_id=snapshot.key[1] if snapshot.key is not None else "", token_ids=snapshot.token_ids[:end],
                 snapshot=snapshot, tier=snapshot.tier, head=snapshot.head,
                 absent=absent[:, :, :end] if absent is not None else None, state=state)
