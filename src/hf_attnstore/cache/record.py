"""Saving what a turn computes: each forward's new KV is kept per layer (`Recorder.record`), and after the forward
its keys are un-rotated to pre-RoPE and handed to the store's writer (`Recorder.end_forward`).

Layout of every KV tensor here: ``[batch=1, kv_heads, seq, head_dim]``; stacked over layers, ``[layers, 1, kv_heads,
seq, head_dim]``.
"""

from __future__ import annotations

import logging
import time

import torch

from ..store import AttnStore, TurnWriter
from ..store.stats import OnceLogger
from .layers import TurnEnd
from .rope import RopeAdapter

logger = logging.getLogger(__name__)
_once = OnceLogger(logger)


def inverse_rope(rope: RopeAdapter, positions: torch.Tensor) -> dict:
    """Per rotary group, the factors that un-rotate keys computed at `positions` (see RopeAdapter.inverse).

    Example:
        >>> inverse = inverse_rope(RopeAdapter(model), torch.arange(4))  # doctest: +SKIP
    """
    return {group: rope.inverse(*rope.cos_sin(positions, torch.float32, group)) for group in rope.groups}


def unrotate(rope: RopeAdapter, keys: torch.Tensor, inverse: dict) -> torch.Tensor:
    """Stacked rotated keys ``[layers, 1, kv_heads, n, head_dim]`` back to pre-RoPE (see `inverse_rope`).

    Example:
        >>> rope = RopeAdapter(model)  # doctest: +SKIP
        >>> stored = unrotate(rope, torch.stack(keys), inverse_rope(rope, torch.arange(n)))  # doctest: +SKIP
    """
    if rope.uniform:
        inv_cos, inv_sin = next(iter(inverse.values()))
        return rope.unrotate(keys, inv_cos.to(keys.device), inv_sin.to(keys.device))
    rotated, keys = keys, keys.clone()  # each layer type with its own frequencies; NoPE layers: not rotated
    for group, layers in rope.groups.items():
        inv_cos, inv_sin = inverse[group]
        keys[layers] = rope.unrotate(rotated[layers], inv_cos.to(keys.device), inv_sin.to(keys.device))
    return keys


class Recorder:
    """Keeps a turn's new KV through each forward and hands it to the store after it.

    Args:
        store: The store (deletes what the turn supersedes).
        session_id: The turn's session.
        save: Whether the turn saves (its writer, `AttnStore.open_turn`, is handed over by `restart`).
        rope: The model's rotary embedding; `regime`: the turn's frequency regime (see rope.RopeAdapter.regime).
        num_layers: KV layers per forward.
        turn_end: Keeps a hybrid model's states (and a scored turn's scores) with the session (layers.TurnEnd).
        superseded: What the first complete forward deletes: the session's KV under the model's other keys.
        every_key: Every key of the model's KV (all of them go when the turn leaves its regime).

    Example:
        >>> recorder.begin(ids, torch.arange(past, past + n), past + n)  # doctest: +SKIP
        >>> recorder.record(0, keys, values)  # per layer, by the layers  # doctest: +SKIP
        >>> recorder.end_forward()  # doctest: +SKIP
    """

    def __init__(self, store: AttnStore, session_id: str, save: bool, rope: RopeAdapter, regime: str | None,
                 num_layers: int, turn_end: TurnEnd, superseded: list[str], every_key: list[str]):
        self._store, self._session_id, self._rope, self._regime = store, session_id, rope, regime
        self._layers, self.turn_end = num_layers, turn_end
        self.writer: TurnWriter | None = None  # set by `restart`, before the first forward
        self.save = save
        self._superseded, self._every_key = superseded, every_key
        self.fed_ids: list[torch.Tensor] = []
        self._pending: list | None = None
        self._fwd_ids: torch.Tensor | None = None
        self._fwd_rope: dict | None = None  # rotary group -> un-rotation factors of the current forward
        self.fwd_end = 0  # the sequence length after the current forward (its RoPE regime, see end_forward)
        self.saved_tokens = 0
        self.save_seconds = 0.0  # time spent un-rotating keys and handing KV to the store
        # The session position of the first token this turn computed under sparse attention (a forward that attended
        # to a selection of the history, `kv_budget`): it and every later token are stored labelled inexact.
        self.sparse_from: int | None = None

    @property
    def in_forward(self) -> bool:
        """Whether a forward began and has not ended."""
        return self._pending is not None

    def restart(self, writer: TurnWriter | None) -> None:
        """The turn's writes go to `writer` (from its start; or it starts over, its stored KV having proved
        unreadable in its first forward: what that forward reported is forgotten)."""
        self._pending, self.sparse_from = None, None
        self.writer = writer

    def begin(self, ids: torch.Tensor | None, positions: torch.Tensor, end: int) -> None:
        """A forward of the tokens `ids` (None: embeddings only, not saved) at `positions` begins; `end`: the
        sequence's length after it."""
        self.fwd_end = end
        if ids is None:
            self.save = False
            _once.warning("embeds", "forward with `inputs_embeds` only: token ids are unknown, so the session is not "
                          "saved")
        else:
            self._fwd_ids = ids.reshape(-1)
        if self._rope.has_rope and self.save:
            self._fwd_rope = inverse_rope(self._rope, positions)
        self._pending = [None] * self._layers
        if self.turn_end.has_state:
            with self.turn_end.lock:
                self.turn_end.complete = False  # until the forward completes, the layers' states disagree

    def record(self, idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keeps a layer's new KV (keys still rotated) until the forward completes."""
        if self._pending is None:
            raise RuntimeError(
                "AttnStoreCache.update was called outside a forward of the model it was created with; "
                "create the cache with the model that uses it"
            )
        self._pending[idx] = (keys, values) if self.save else (None, None)  # read-only: nothing to keep

    def stage(self, token_ids: torch.Tensor, positions: torch.Tensor, keys: list, values: list) -> None:
        """KV computed outside the cache (a batch's decoding step), staged as a forward's: `end_forward` stores it."""
        self._fwd_ids = token_ids.reshape(-1)
        self.fwd_end = int(positions.max()) + 1
        if self._rope.has_rope and self.save:
            self._fwd_rope = inverse_rope(self._rope, positions.reshape(-1))
        self._pending = list(zip(keys, values))

    def end_forward(self) -> None:
        """Un-rotates the forward's new keys and commits its KV to the store.

        All layers at once: one stacked tensor ``[layers, 1, kv_heads, n, head_dim]`` is un-rotated in a
        handful of kernels and copied into the host tier in one copy, where per-layer work cost ~7 kernels
        and two copies per layer and token (decoding is dominated by such small operations).
        """
        pending, self._pending = self._pending, None
        if pending is None or all(p is None for p in pending):
            return  # e.g. use_cache=False: nothing was added (states, if any, did not change either)
        assert all(p is not None for p in pending), "every layer must update the cache in a forward"
        ids = self._fwd_ids
        self.fed_ids.append(ids)
        if self._rope.regime(self.fwd_end) != self._regime:
            self.leave_regime()  # decoding went past the length where the frequencies change
        if self.save and ids is not None:
            started = time.perf_counter()
            keys = torch.stack([p[0] for p in pending])
            if self._rope.has_rope:
                keys = unrotate(self._rope, keys, self._fwd_rope)
            n = keys.shape[-2]
            # A long prefill's values are kept as they are (adopted without a copy); short steps are stacked.
            values = torch.stack([p[1] for p in pending]) if n < 64 else [p[1] for p in pending]
            first = self.fwd_end - n
            inexact_at = None if self.sparse_from is None else min(max(0, self.sparse_from - first), n)
            stored = self.writer.append(ids, keys, values, inexact_at)
            self.save_seconds += time.perf_counter() - started
            if stored:
                self.saved_tokens += int(ids.numel())
        self._drop_superseded()  # after a complete forward: a turn that never runs changes nothing
        if self.turn_end.has_state:
            with self.turn_end.lock:
                # The forward's end, not the layers' length: KV appended from a batch (`stage`) is not in the
                # layers, whose tensors the batch cache took over.
                self.turn_end.tokens, self.turn_end.complete = self.fwd_end, True

    def leave_regime(self) -> None:
        """The turn's sequence grows past the length where length-dependent RoPE changes its frequencies: what
        comes next is KV of another regime than the session's. The session's stored KV, which would lag behind
        its history, is dropped now and nothing more is saved: the next turn recomputes the session in the new
        regime (as transformers' phi3 does when it crosses mid-generation)."""
        if not self.save:
            return
        logger.info("session %r went past %d tokens, where the model's %s RoPE changes frequencies: its stored KV "
                    "is dropped, and the next turn recomputes it", self._session_id, self._rope.limit,
                    self._rope.scaling)
        self.save = False
        self._superseded = list(self._every_key)
        self._drop_superseded()  # called between forwards, or after the last one this turn saves

    def _drop_superseded(self) -> None:
        for fingerprint in self._superseded:
            self._store.delete(self._session_id, fingerprint)
        self._superseded = []

    def attended_sparse(self, position: int) -> None:
        """A sparse layer's forward from session position `position` attends to a selection of the history."""
        self.sparse_from = position if self.sparse_from is None else min(self.sparse_from, position)

    def cropped(self, total: int, reused: int) -> None:
        """The cache was cropped to `total` tokens, of which the first `reused` came from the store (see
        `CacheTurn.cropped`)."""
        kept = max(total - reused, 0)
        fed = torch.cat(self.fed_ids) if self.fed_ids else torch.empty(0, dtype=torch.long)
        self.fed_ids = [fed[:kept]]
        self.saved_tokens = min(self.saved_tokens, kept)  # the rejected drafts were handed over, then taken back
        if self.writer is not None:
            self.writer.truncate(total)
        if self.turn_end.has_state:
            with self.turn_end.lock:
                # The states are stored labelled with the tokens they summarize: after the crop (which rolled the
                # layers' convolution states back), the kept ones.
                self.turn_end.tokens = min(self.turn_end.tokens, total)
