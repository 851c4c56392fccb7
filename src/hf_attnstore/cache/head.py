"""Recomputing the evicted head of a stored session before a turn reuses the rest (`TurnPlan.head`).

A partially evicted session (or one whose leading chunks are cheaper to recompute than to load,
`recompute_by_cost`) has no KV for its first tokens. Under causal attention those tokens' KV depends on them alone,
so one forward over them at positions 0.. without any history computes it exactly, while the loader reads the
rest of the session.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from ..store import AttnStore, SessionKV
from ..store.buffer import Segment
from ..store.stats import OnceLogger
from .layout import LayerLayout
from .prefill_clock import PrefillClock
from .record import inverse_rope, unrotate
from .rope import RopeAdapter
from .upstream import DynamicCache, cache_kwargs

logger = logging.getLogger(__name__)
_once = OnceLogger(logger)


def recompute_head(model: nn.Module, store: AttnStore, snapshot: SessionKV, need: int, rope: RopeAdapter,
                   layout: LayerLayout, clock: PrefillClock | None, regime: str | None) -> SessionKV | None:
    """The snapshot with the KV of its first `need` tokens recomputed (its head, up to the last reused token in it),
    or None when it cannot be (a forward that failed, or one that would fall into another RoPE regime): the turn
    then reuses nothing.

    The head is un-rotated like any stored key and handed to the store (`AttnStore.fill_head`), so that later
    turns find the session whole; when another turn filled it first, this turn reads its own copy.

    Example:
        >>> snapshot = recompute_head(model, store, snapshot, plan.head, rope, layout, clock, "")  # doctest: +SKIP
        >>> snapshot.head  # doctest: +SKIP
        0
    """
    if need == 0:
        return dataclasses.replace(snapshot, head=0)  # the head is not kept: nothing reads it
    if rope.regime(need) != regime:
        return None  # a shorter forward would compute the head with other frequencies (longrope's short ones)
    ids = snapshot.token_ids[:need]
    store.forward_started()  # a forward like any other: the store's writer yields to it
    if clock is not None:  # (`recompute_by_cost` only)
        clock.begin(model.device, 0, need)  # a prefill sample: it waits for no stored KV
    try:
        with torch.no_grad():
            computed = DynamicCache()  # without the config: sliding layers would keep only their window
            model.base_model(input_ids=ids.view(1, -1).to(model.device), **cache_kwargs(computed), use_cache=True)
            # In the store's roles (an MLA model's values are the rotated key part, see LayerLayout.latent).
            keys, values = (("values", "keys") if layout.latent else ("keys", "values"))
            values = [getattr(layer, values) for layer in computed.layers]
            keys = torch.stack([getattr(layer, keys) for layer in computed.layers])
            if rope.has_rope:
                keys = unrotate(rope, keys, inverse_rope(rope, torch.arange(need, device=keys.device)))
            dtype = snapshot.source.dtype
            keys = [k.to("cpu", dtype) for k in keys.unbind(0)]
            values = [v.to("cpu", dtype) for v in values]
    except Exception as exc:  # e.g. out of memory: the turn goes on without reuse (a miss, never an error)
        if clock is not None:
            clock.cancel()
        session = snapshot.key[1] if snapshot.key is not None else "?"
        _once.warning("head", f"recomputing the evicted head of session {session!r} failed ({exc}): the session is "
                      "recomputed")
        return None
    finally:
        store.forward_finished()
    if clock is not None:
        clock.end()
    if need == snapshot.head and store.fill_head(snapshot, keys, values):
        return dataclasses.replace(snapshot, head=0)  # the host copy holds the head now: read it there
    return snapshot.with_head(Segment.adopt(ids.clone(), keys, values))
