"""One turn of a session through an :class:`~hf_attnstore.cache.AttnStoreCache`: the per-turn work.

A `Turn` plans the reuse once, before any forward (which stored tokens the prompt reuses, truncation, a
partially evicted head to recompute, a hybrid model's states), then does what each forward needs: it loads and
re-rotates one layer's reused KV when that layer first runs (`load_layer`, called by the layers), records the
new KV (`record`), and after the forward un-rotates the keys and hands them to the store (`end_forward`). The
forward wrapper (hooks.py) brackets forwards through `begin_forward` / `end_forward`, and re-runs a forward
whose stored KV proved unreadable (`recompute_forward`). The cache itself stays a thin `transformers.Cache`
over the layers (cache.py).

Layout of every KV tensor here: ``[batch=1, kv_heads, seq, head_dim]``; stored keys are pre-RoPE.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref

import torch
from torch import nn

from ..store import AttnStore, LoadError, SessionKV
from ..store.buffer import Segment
from .cuda_prefetch import CudaLayerPrefetcher
from ..store.encoded import copy_into, dense
from ..store.format import prefix_digest
from ..store.logs import OnceLogger
from ..store.state import SessionState, selection_name
from . import importance
from .config import SparseConfig, TruncationConfig
from .fingerprint import kv_geometry, model_fingerprint, regime_fingerprint, salted_fingerprint
from .hooks import ReuseFailed
from .layers import AttnStoreSparseLayer, LayerLayout, TurnEnd, build_layers
from .prefill_clock import PrefillClock
from .rope import RopeAdapter
from .sparse import select
from .truncation import plan_reuse
from .upstream import DynamicCache, cache_kwargs

logger = logging.getLogger(__name__)
_once = OnceLogger(logger)


def regime_keys(fingerprint: str, rope: RopeAdapter) -> list[str]:
    """The keys of a model's KV per RoPE frequency regime, the one of longer contexts first (see
    RopeAdapter.regime): `longrope` stores short and long contexts apart; every other model has one key.

    Example:
        >>> regime_keys(fp, RopeAdapter(model))  # doctest: +SKIP
        ['3f2a...']
    """
    return [regime_fingerprint(fingerprint, regime) for regime in (["long", ""] if rope.scaling == "longrope"
                                                                     else [""])]


def head_prefill_key(model_key: str, layout: LayerLayout, rope: RopeAdapter) -> str | None:
    """The key under which a turn reports its model's prefills to the store and may be handed leading chunks to
    recompute instead of loading them (`recompute_by_cost`): the model's fingerprint without `cache_salt`, or None
    when a head cannot be recomputed alone: a model with states (they summarize every token) or whose RoPE
    frequencies depend on the length (a head computed alone could fall into another regime, and the turn would
    then recompute everything).

    Example:
        >>> head_prefill_key(fp, LayerLayout.of(model), RopeAdapter(model)) == fp  # doctest: +SKIP
        True
    """
    return None if layout.has_state or rope.length_dependent else model_key


def check_scored(model: nn.Module, layout: LayerLayout, model_type: str, sparse: SparseConfig | None,
                 scored: bool) -> None:
    """Refuses, saying why, the models whose sessions cannot be kept sparse (`sparse`) or scored (`scored`:
    importance truncation, or a sparse policy that ranks by importance); switches a scored model's attention to
    the scoring one (importance.enable)."""
    what = "`kv_budget`" if sparse is not None else "`truncation=\"importance\"`"
    if layout.latent:
        raise ValueError(f"{what} is not supported for multi-head latent attention ({model_type}): "
                         "its cache holds a compressed latent, not the keys the queries score")
    if layout.has_state:
        raise ValueError(f"{what} is not supported for hybrid models ({model_type}): their "
                         "recurrent states summarize every token, so dropping KV would disagree with them")
    if not any(layout.full):
        raise ValueError(f"{what} needs full-attention layers, and {model_type} has none")
    chunked = layout.chunked
    if sparse is not None and chunked:
        # transformers builds the full-attention layers' one mask from the first non-sliding layer, a chunked
        # one here, whose keys are not the sparse layers' kept tokens: the mask would not fit them.
        raise ValueError(f"`kv_budget` is not supported for {model_type}: its chunked-attention "
                         f"layers ({len(chunked)} of them) share the full-attention mask; use "
                         "`truncation=\"importance\"` or a dense cache")
    if scored:
        importance.enable(model)  # raises unless the model runs SDPA


class Turn:
    """The per-turn state and work of an :class:`~hf_attnstore.cache.AttnStoreCache` (see the module docstring).

    Args:
        cache: The cache this turn belongs to (held weakly: the cache owns the turn).
        model, store, session_id, prompt, truncation, save: As given to the cache, validated.

    Example:
        >>> cache = AttnStoreCache(model, store, "alice", ids)  # doctest: +SKIP
        >>> cache.turn.reused_tokens == cache.reused_tokens  # doctest: +SKIP
        True
    """

    def __init__(self, cache, model: nn.Module, store: AttnStore, session_id: str, prompt: torch.Tensor,
                 truncation: TruncationConfig, save: bool, cache_salt: str | None = None,
                 sparse: SparseConfig | None = None):
        self._cache = weakref.ref(cache)
        self.session_id, self.truncation = session_id, truncation
        self._rope = RopeAdapter(model)  # refuses a model whose KV cannot be reused exactly, saying why
        vocab = model.get_input_embeddings().num_embeddings if model.get_input_embeddings() is not None else None
        if vocab is not None and (int(prompt.min()) < 0 or int(prompt.max()) >= vocab):
            # On CUDA an out-of-range id is a device-side assert that breaks the whole process: refuse it here.
            raise ValueError(f"`input_ids` holds ids outside the model's vocabulary [0, {vocab}): "
                             f"min {int(prompt.min())}, max {int(prompt.max())}")
        if not self._rope.has_rope and self.truncation.context_window is not None \
                and self.truncation.mode != "recompute":
            _once.warning(
                f"norope-{self._rope.model_type}",
                f"{self._rope.model_type} has no rotary embeddings, so cached keys cannot be re-positioned: "
                "truncation falls back to 'recompute'",
            )
        # Length-dependent RoPE (longrope, dynamic): KV is keyed by the frequency regime of the turn's first
        # forward, whose length the truncation settings alone decide (rope.RopeAdapter.regime).
        first = plan_reuse(prompt, None, self.truncation, has_rope=self._rope.has_rope).input_ids.shape[1]
        self.regime = self._rope.regime(first)
        # Memoized, but its change key walks every tensor: once per turn.
        model_key = model_fingerprint(model, store.config.namespace)
        base = salted_fingerprint(model_key, cache_salt)
        self.fingerprint = regime_fingerprint(base, self.regime or "")
        # What this turn's first stored forward deletes: the session's KV of this model in other regimes (the
        # session has one history; their KV would lag behind it). All of it when this turn cannot save.
        self._fingerprints = regime_keys(base, self._rope)
        self._superseded = [fp for fp in self._fingerprints if fp != self.fingerprint] if save else []
        if self.regime is None:
            _once.warning("dynamic-rope", f"`dynamic` RoPE past {self._rope.limit} tokens changes its frequencies "
                          "with every length: such turns are recomputed and not stored")
            self._superseded, save = (list(self._fingerprints) if save else []), False
        self._geometry = kv_geometry(model)
        self._layout = LayerLayout.of(model)
        self._windows = self._layout.slot_windows  # KV slot -> sliding window
        self.sparse = sparse
        # Importance scores: for a session kept sparse by importance, or truncated by it (importance.py). Scored
        # layers: the full-attention ones (a sliding-window layer keeps its window, not a selection).
        self._scored = (sparse is not None and sparse.scored) or truncation.mode == "importance"
        # What the scores sum (and are stored under): the sparse policy's, else importance truncation's (ALISA's).
        self._score_config = sparse if sparse is not None and sparse.scored else SparseConfig(1.0)
        self._slot_of = {idx: slot for slot, idx in enumerate(self._layout.kv_layers) if self._layout.full[idx]}
        if sparse is not None or self._scored:
            check_scored(model, self._layout, self._rope.model_type, sparse, self._scored)
        self._stored_scores: dict[int, torch.Tensor] | None = None
        self.recomputed_head = 0  # leading tokens recomputed this turn (partially evicted, or cheaper than loading)
        self.reused_recomputed = 0  # of `reused_tokens`, those whose KV that recompute made (not loaded)
        # The model's prefills are reported to the store, which decides by them whether a resumed session's leading
        # chunks are loaded or recomputed (`recompute_by_cost`).
        self._clock = PrefillClock(functools.partial(store.costs.observe_prefill, model_key))
        self._prefill_key = head_prefill_key(model_key, self._layout, self._rope)
        self.shared_from: str | None = None  # the other session whose stored prefix this turn starts from
        self.plan, snapshot, state = self._plan(model, store, prompt)
        self.reused_tokens = self.plan.reused
        self.dropped_tokens = self.plan.dropped
        self.input_ids = self.plan.input_ids.to(model.device)
        self.kv_source = (snapshot.tier if snapshot is not None and self.reused_tokens else "miss")
        self.recomputed = False  # set if stored KV proved unreadable mid-forward and the prompt was recomputed
        self._store = store
        self._snapshot = snapshot if self.reused_tokens else None
        if self._snapshot is not None and self._snapshot.loader is not None:
            # From now on the disk loader runs at most `read_buffer_layers` ahead of our layers; release
            # it when this cache goes away, even unused, so the loader never waits for a dead consumer.
            self._snapshot.loader.attach()
            weakref.finalize(self, self._snapshot.loader.release)
        self._keep_is_prefix = torch.equal(self.plan.keep, torch.arange(self.reused_tokens))
        self._writer = store.open_turn(session_id, self.fingerprint, snapshot, self.plan.keep) if save else None
        # While the turn runs its session stays pinned in host memory; dropping the cache (and so its writer)
        # ends the turn, see TurnWriter.close.
        self._prefetcher: CudaLayerPrefetcher | None = None
        self._selected: SessionKV | None = None
        self._load_rope: dict[tuple, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        self._fed_ids: list[torch.Tensor] = []
        self._pending: list | None = None
        self._fwd_ids: torch.Tensor | None = None
        self._fwd_rope: dict | None = None  # rotary group -> un-rotation factors of the current forward
        self._save = bool(save)
        self._broken = False
        self.saved_tokens = 0
        self.save_seconds = 0.0  # time this turn spent un-rotating keys and handing KV to the store
        self._fwd_input_len = 0
        self._fwd_end = 0  # the sequence length after the current forward (its RoPE regime, see end_forward)
        # The session position of the first token this turn computed under sparse attention (a forward that attended
        # to a selection of the history, `kv_budget`): it and every later token are stored labelled inexact.
        self.sparse_from: int | None = None
        self._device = model.device
        self.scorer = self._new_scorer(self._initial_scores())
        self.layers = build_layers(self, self._layout, self.reused_tokens,
                                   state if self.reused_tokens else None, self._device, sparse)
        # The reused tokens with KV per KV slot, ``[kv_heads, P]`` (a session loaded from sparse cold copies; empty: all
        # of them), set by `_start_from_present`: what the session's next turn selects from, with this turn's tokens.
        self._present: dict[int, torch.Tensor] = {}
        if sparse is not None and self._snapshot is not None:
            self._start_from_present(self._snapshot)
        # A hybrid model's turn ends by keeping its states with the session, also when the cache is just dropped;
        # a scored turn keeps its tokens' importance scores the same way.
        self.turn_end = TurnEnd(self._writer, self.layers, self._layout.has_state, self._extra())

    def _extra(self):
        """What the turn keeps with the session beside a hybrid model's states (layers.TurnEnd): its tokens'
        importance scores, and for a sparse session the selection its next turn keeps (`_kept_tensors`)."""
        if self.scorer is None:
            return None
        sparse = self.sparse if self.sparse is not None and self.sparse.scored else None
        return functools.partial(_kept_tensors, self.scorer, sparse, self._present, self.reused_tokens)

    def _new_scorer(self, initial: dict[int, torch.Tensor] | None) -> "importance.Scorer | None":
        if not self._scored:
            return None
        config = self._score_config
        return importance.Scorer(self._slot_of, config.policy, config.score_window, self._columns, initial)

    def _columns(self, slot: int) -> torch.Tensor | None:
        """Session positions of the keys KV slot `slot` attends to now (None: all, in order)."""
        return getattr(self.layers[self._layout.kv_layers[slot]], "columns", None)

    def scoring(self):
        """The context of a forward: the model's attention feeds this turn's scorer (importance.py)."""
        return importance.scoring(self.scorer)

    def can_select(self, start: int) -> bool:
        """Whether sparse layers select tokens before a forward that starts at session position `start` (between
        forwards: the next one's): by recency always, by importance once scores exist; and never within the
        prompt after its first forward, so that a prompt fed in chunks (a batch's chunked prefill) attends as the
        one forward of a solo turn does: the history selected once, all of the prompt."""
        if self.sparse is None or (self.sparse.scored and not self.scorer.has_scores):
            return False
        return start <= self.reused_tokens or start >= self.input_ids.shape[1]

    def batch_row(self):
        """What a batch needs to decode this turn after its prompt (see `AttnStoreCache.batch_row`)."""
        columns = {slot: self._columns(slot) for slot in self._slot_of.values()}
        return self.scorer, (None if any(c is None for c in columns.values()) else columns), dict(self._slot_of)

    def scores_for(self, slot: int, columns: torch.Tensor) -> torch.Tensor:
        """The importance of the tokens at session positions `columns` in KV slot `slot` (see Scorer)."""
        return self.scorer.scores_for(slot, columns)

    def _read_scores(self, snapshot: SessionKV | None) -> dict[int, torch.Tensor] | None:
        """The importance scores stored with this session's entry (slot -> ``[kv_heads, tokens]``), if they are
        there and were computed for the snapshot's first tokens; None on any doubt (the turn then scores anew)."""
        if snapshot is None:
            return None
        state = snapshot.state
        if snapshot.loader is not None:
            try:
                snapshot.loader.wait_layer(0)  # the loader reads and verifies the state before the first layer
            except LoadError:
                return None
            state = snapshot.source.state
        if state is None or state.tokens > snapshot.length or state.key != (self.fingerprint, self.session_id) \
                or state.prefix != prefix_digest(self.fingerprint, snapshot.token_ids[: state.tokens]):
            return None
        heads = self._geometry[1]
        out = {}
        for slot in self._slot_of.values():
            # Only scores of this turn's policy and window (another's sum other queries: not these scores).
            t = state.tensors.get(importance.score_name(slot, self._score_config.policy,
                                                        self._score_config.score_window))
            if t is None or tuple(t.shape) != (heads, state.tokens):
                return None
            out[slot] = torch.nan_to_num(t.float(), nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0)
        return out

    def _initial_scores(self) -> dict[int, torch.Tensor] | None:
        """The stored scores of the tokens this turn reuses, in the order it keeps them (on the device)."""
        stored = self._stored_scores
        if not stored or self.shared_from is not None or not self.reused_tokens:
            return None
        keep = self.plan.keep
        if int(keep.max()) >= next(iter(stored.values())).shape[1]:
            return None  # stored scores older than the KV: this turn scores anew
        return {slot: s[:, keep].to(self._device) for slot, s in stored.items()}

    def _plan(self, model: nn.Module, store: AttnStore, prompt: torch.Tensor):
        """The turn's reuse plan, before any forward: which stored tokens `prompt` reuses (the longest common
        prefix, after truncation), with the snapshot they come from and a hybrid model's states (both None on a
        miss). A partially evicted head is recomputed here (:meth:`_with_head`)."""
        found = (store.lookup(self.session_id, self.fingerprint, prefill_key=self._prefill_key)
                 if self.regime is not None else None)
        snapshot = self._validated(found)
        state = None
        if self._layout.has_state:
            snapshot, state = self._with_state(snapshot)
        if self._scored:
            self._stored_scores = self._read_scores(snapshot)
        weights = None
        if self.truncation.mode == "importance" and self._stored_scores:
            weights = importance.token_importance(self._stored_scores, next(iter(self._stored_scores.values()))
                                                  .shape[1])
        plan = plan_reuse(prompt, self._reusable_ids(snapshot, state.tokens if state else None), self.truncation,
                          has_rope=self._rope.has_rope, importance=weights)
        plan = self._fit_present(prompt, plan, snapshot, weights)
        if state is not None and (plan.dropped or plan.reused != state.tokens):
            # A hybrid model reuses its states after exactly their tokens, or nothing: a prompt that diverges
            # earlier, or a truncation, is recomputed (the states cannot be cut or re-positioned).
            plan = plan_reuse(prompt, None, self.truncation, has_rope=self._rope.has_rope)
        if snapshot is not None and snapshot.head and plan.reused and not self._layout.has_state:
            snapshot = self._with_head(model, store, snapshot, plan)
            if snapshot is None:  # nothing worth reusing beyond the missing head
                plan = plan_reuse(prompt, None, self.truncation, has_rope=self._rope.has_rope)
        if not plan.dropped and self.regime is not None and not self._layout.has_state:
            plan, snapshot = self._shared(store, prompt, plan, snapshot)
            if self.shared_from is not None:  # another session's KV: what was recomputed of this one is not used
                self.recomputed_head = self.reused_recomputed = 0
        return plan, snapshot, state

    def _reusable_ids(self, snapshot: SessionKV | None, end: int | None) -> torch.Tensor | None:
        """The ids of the snapshot's first `end` tokens (None: all) whose KV this turn may reuse: a dense turn stops
        before the first token computed under sparse attention (labelled inexact, `SessionKV.exact_prefix`), since
        its KV is not what this turn's attention computes; a sparse turn (``kv_budget``) reuses them."""
        if snapshot is None:
            return None
        end = snapshot.length if end is None else min(end, snapshot.length)
        if self.sparse is None:
            return snapshot.token_ids[: snapshot.exact_prefix(end)]
        if snapshot.loader is not None:
            try:  # which tokens have no KV is known once the loader has verified the chunks, before layer 0
                snapshot.loader.wait_layer(0)
            except LoadError:
                return None  # a failed load: a miss
        return snapshot.token_ids[:end]

    def _fit_present(self, prompt: torch.Tensor, plan, snapshot: SessionKV | None, weights):
        """The plan, cut so that a sparse turn's reused tokens hold one tensor per layer: when some were loaded from
        sparse cold copies without KV, every KV slot and head must keep the same number of them. A prefix is cut
        to the longest such prefix (`_rectangular_prefix`: a chunk boundary at worst); a truncated history that
        keeps tokens without KV, to what lies before the first of them. The rest is recomputed."""
        absent = snapshot.absent() if self.sparse is not None and snapshot is not None else None
        if absent is None:
            return plan
        for _ in range(3):  # each cut leaves fewer tokens; the second always fits
            kept = absent[:, :, plan.keep]
            if not plan.reused or not bool(kept.any()):
                return plan
            if torch.equal(plan.keep, torch.arange(plan.reused)):
                end = _rectangular_prefix(kept, plan.reused)
                if end == plan.reused:
                    return plan
            else:
                end = int(absent.any(dim=0).any(dim=0).nonzero()[0])
            plan = plan_reuse(prompt, snapshot.token_ids[:end], self.truncation, has_rope=self._rope.has_rope,
                              importance=weights)
        return plan_reuse(prompt, None, self.truncation, has_rope=self._rope.has_rope)

    def _start_from_present(self, snapshot: SessionKV) -> None:
        """Hands each sparse layer the reused tokens that have KV (a session loaded from sparse cold copies): the
        same count per KV head and slot (`_fit_present`), the others never attended to."""
        absent = snapshot.absent()
        if absent is None:
            return
        absent = absent[:, :, self.plan.keep]
        if not bool(absent.any()):
            return
        heads = absent.shape[1]
        for layer in self.layers:
            if isinstance(layer, AttnStoreSparseLayer):
                slot = layer.held_slot
                self._present[slot] = torch.nonzero(~absent[slot])[:, 1].view(heads, -1)
                layer.present(self._present[slot])

    def _shared(self, store: AttnStore, prompt: torch.Tensor, plan, snapshot):
        """The plan and snapshot of another session that begins with a longer prefix of the prompt than this
        session's own stored history (a shared system prompt, a regenerated or edited turn, a branch), or the
        given ones. Exact: the prefix is compared id by id (`AttnStore.lookup_prefix`, then `plan_reuse` on the
        snapshot's ids). Not for prompts that overflow the context window (their reuse is this session's own
        truncated history) nor for hybrid models (their states belong to one history)."""
        found = store.lookup_prefix(self.fingerprint, prompt.view(-1), exclude=self.session_id,
                                    longer_than=plan.reused, exact=self.sparse is None)
        if found is None:
            return plan, snapshot
        other = self._validated(store.lookup(found[0], self.fingerprint))
        if other is None or other.head:
            return plan, snapshot
        shared = plan_reuse(prompt, self._reusable_ids(other, found[1]), self.truncation, has_rope=self._rope.has_rope)
        shared = self._fit_present(prompt, shared, other, None)
        if shared.dropped or shared.reused <= plan.reused:
            return plan, snapshot
        self.shared_from = found[0]
        return shared, other

    @property
    def length_dependent(self) -> bool:
        """Whether the model's RoPE frequencies depend on each forward's length (see rope.RopeAdapter.regime)."""
        return self._rope.length_dependent

    def regime_of(self, length: int) -> str | None:
        """The frequency regime of a forward whose sequence is `length` long (rope.RopeAdapter.regime)."""
        return self._rope.regime(length)

    def forward_started(self) -> None:
        """A forward of this turn's model begins: the store's writer yields to compute (store.py)."""
        self._store.forward_started()

    def forward_finished(self) -> None:
        """The forward ended (see :meth:`forward_started`)."""
        self._store.forward_finished()

    def _validated(self, snapshot: SessionKV | None) -> SessionKV | None:
        """A stored entry whose shapes disagree with the model is a miss, never an error."""
        if snapshot is None:
            return None
        if snapshot.source.geometry != self._geometry:
            _once.warning("geometry", f"stored KV of session {self.session_id!r} does not fit the model: ignored")
            return None
        return snapshot

    def _with_state(self, snapshot: SessionKV | None) -> tuple[SessionKV | None, SessionState | None]:
        """A hybrid model's snapshot and the states stored with it, both None unless the states are there and
        were computed for the snapshot's first ``state.tokens`` ids (a miss otherwise)."""
        if snapshot is None:
            return None, None
        state = snapshot.state
        if snapshot.loader is not None:
            try:
                # The loader reads and verifies the state before the first layer (reader.py).
                snapshot.loader.wait_layer(0)
            except LoadError:
                return None, None
            state = snapshot.source.state
        if state is None or state.tokens > snapshot.length or state.key != (self.fingerprint, self.session_id) \
                or state.prefix != prefix_digest(self.fingerprint, snapshot.token_ids[: state.tokens]):
            return None, None
        return snapshot, state

    def _with_head(self, model: nn.Module, store: AttnStore, snapshot: SessionKV, plan) -> SessionKV | None:
        """The snapshot with its missing head recomputed (a partially evicted session), or None when every
        reused token lies in that head (recomputing them is all the reuse would save).

        Only the head's tokens up to the last one the plan keeps are computed, in one forward at positions
        0.. without any history: exact, since under causal attention the first tokens' KV depends on them
        alone. The loader reads the rest of the session meanwhile (it started at lookup). The head is
        un-rotated like any stored key, and handed to the store so that later turns find the session whole.
        """
        keep, head = plan.keep, snapshot.head
        kept = keep[keep < head]
        if kept.numel() == plan.reused:
            return None
        need = int(kept.max()) + 1 if kept.numel() else 0
        if need == 0:
            return dataclasses.replace(snapshot, head=0)  # the head is not kept: nothing reads it
        if self._rope.regime(need) != self.regime:
            return None  # a shorter forward would compute the head with other frequencies (longrope's short ones)
        ids = snapshot.token_ids[:need]
        store.forward_started()  # a forward like any other: the store's writer yields to it
        self._clock.begin(model.device, 0, need)  # a prefill sample: it waits for no stored KV
        try:
            with torch.no_grad():
                computed = DynamicCache()  # without the config: sliding layers would keep only their window
                model.base_model(input_ids=ids.view(1, -1).to(model.device), **cache_kwargs(computed), use_cache=True)
                # In the store's roles (an MLA model's values are the rotated key part, see LayerLayout.latent).
                keys, values = (("values", "keys") if self._layout.latent else ("keys", "values"))
                values = [getattr(layer, values) for layer in computed.layers]
                keys = torch.stack([getattr(layer, keys) for layer in computed.layers])
                if self._rope.has_rope:
                    keys = self._unrotate(keys, self._inverse_rope(torch.arange(need, device=keys.device)))
                dtype = snapshot.source.dtype
                keys = [k.to("cpu", dtype) for k in keys.unbind(0)]
                values = [v.to("cpu", dtype) for v in values]
        except Exception as exc:  # e.g. out of memory: the turn goes on without reuse (a miss, never an error)
            self._clock.cancel()
            _once.warning("head", f"recomputing the evicted head of session {self.session_id!r} failed ({exc}): "
                          "the session is recomputed")
            return None
        finally:
            store.forward_finished()
        self._clock.end()
        self.recomputed_head, self.reused_recomputed = need, int(kept.numel())
        if need == head and store.fill_head(snapshot, keys, values):
            return dataclasses.replace(snapshot, head=0)  # the host copy holds the head now: read it there
        return snapshot.with_head(Segment.adopt(ids.clone(), keys, values))

    @property
    def token_ids(self) -> torch.Tensor:
        """The ids the cache's KV covers so far: the reused prefix, then everything fed to the model."""
        prefix = self.plan.input_ids[0, : self.reused_tokens]
        return torch.cat([prefix] + [t.cpu() for t in self._fed_ids])

    def load_layer(self, idx: int, length: int, new_keys: torch.Tensor, new_values: torch.Tensor):
        """Layer `idx`'s reused KV followed by this forward's new KV, as the layer's cache tensors.

        The output is allocated once at its final size: reused keys are re-rotated for their positions this
        turn straight into it, and reused values copied into it (one pass each, where rotating and then
        concatenating took three). `new_*` are ``[1, kv_heads, n, head_dim]``.

        Raises:
            ReuseFailed: The stored KV could not be loaded (caught by the forward wrapper, see hooks.py).
        """
        if length == 0:
            return new_keys, new_values
        dtype, device = new_keys.dtype, new_keys.device
        try:
            if idx == 0 and self._snapshot.loader is not None and not self._store.config.layerwise_on(device):
                self._snapshot.loader.wait_all()  # wait for the whole session before computing (NO-PL)
            if device.type == "cuda":
                if self._prefetcher is None:
                    self._prefetcher = CudaLayerPrefetcher(self._host_parts, self._snapshot.loader,
                                                           self._geometry[0], device,
                                                           self._store.config.read_buffer_layers)
                parts = self._prefetcher.get(idx, length)
            else:
                parts = self._host_parts(idx, length)
        except LoadError as exc:
            raise ReuseFailed(str(exc)) from exc
        # A sliding-window layer gets the reused tokens its window still sees: the last `window - 1`.
        start = self._load_start(idx, length)
        kept = length - start
        _, heads, n, dim = new_keys.shape
        keys = torch.empty(1, heads, kept + n, dim, dtype=dtype, device=device)
        # Keys and values may differ in dtype (transformers' layers keep one dtype each since 5.24).
        values = torch.empty(1, heads, kept + new_values.shape[2], new_values.shape[3], dtype=new_values.dtype,
                             device=device)
        if self._rope.layer_has_rope(idx):
            # cos/sin are computed once per turn and rotary group (layer type), shared by the group's layers.
            group = self._rope.group(idx)
            rope_key = (start, length, n, device, dtype, group)
            if rope_key not in self._load_rope:
                positions = self.plan.key_positions[start:length].to(device)
                # Frequencies of this forward (length-dependent RoPE picks them by its length, not the keys').
                cos, sin = self._rope.cos_sin(positions, dtype, group, length=length + n)
                self._load_rope[rope_key] = cos, sin, RopeAdapter.halves_equal(cos, sin)
            cos, sin, halves_equal = self._load_rope[rope_key]
        pos = 0
        for k, v in parts:
            m = k.shape[2]
            # A part kept encoded (store/encoded.py) is dequantized here, on the device, just before its keys
            # are re-rotated: no full-precision copy of it exists in host memory or crosses to the device.
            k = dense(k, device, dtype)
            if self._rope.layer_has_rope(idx):
                self._rope.rotate_into(keys[:, :, pos : pos + m], k, cos[:, :, pos : pos + m],
                                       sin[:, :, pos : pos + m], halves_equal)
            else:
                keys[:, :, pos : pos + m].copy_(k)
            copy_into(values[:, :, pos : pos + m], v)
            pos += m
        keys[:, :, kept:].copy_(new_keys)
        values[:, :, kept:].copy_(new_values)
        if idx == self._geometry[0] - 1:
            if self._snapshot.loader is not None:
                self._snapshot.loader.release()
            self._snapshot = self._prefetcher = None  # every layer is loaded: release the snapshot
        return keys, values

    def _load_start(self, idx: int, length: int) -> int:
        """How many of the first `length` reused tokens KV slot `idx` does not load (a sliding window's past)."""
        window = self._windows.get(idx)
        return max(length - window + 1, 0) if window else 0

    def _host_parts(self, idx: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of layer `idx`'s reused pre-RoPE KV in host memory, the tokens it loads of the first `length`
        (waits if it is still loading)."""
        if not self._keep_is_prefix and self._selected is None:
            # A truncated history: the kept tokens, as views of the stored segments (no copy).
            self._selected = dataclasses.replace(self._snapshot, parts=tuple(self._snapshot.select(self.plan.keep)),
                                                 token_ids=self._snapshot.token_ids[self.plan.keep])
        parts = (self._snapshot if self._keep_is_prefix else self._selected).layer_parts(idx, length)
        skip, out = self._load_start(idx, length), []
        for k, v in parts:
            if skip < k.shape[2]:
                m = k.shape[2] - skip
                out.append((k.narrow(2, skip, m), v.narrow(2, skip, m)) if skip else (k, v))
            skip = max(skip - k.shape[2], 0)
        return out

    def recompute_forward(self, original, args: tuple, kwargs: dict):
        """Runs the current forward again over the whole prompt, without reused KV (see hooks.py)."""
        _once.warning("recompute", f"stored KV of session {self.session_id!r} could not be loaded: recomputing it")
        fed = self._fwd_input_len
        total = self.reused_tokens + fed  # a load can only fail in the first forward of a turn
        self.reused_tokens, self.kv_source, self.recomputed = 0, "miss", True
        self.reused_recomputed = 0
        self._snapshot = self._prefetcher = self._selected = None
        self._keep_is_prefix = True
        self._pending = None
        if self._writer is not None:
            self._writer.close()
            self._writer = self.turn_end.writer = self._store.open_turn(self.session_id, self.fingerprint, None,
                                                                         torch.empty(0, dtype=torch.long))
            if self.turn_end.has_state:  # the store asks this turn for its states (TurnEnd.publish)
                self._writer.state_source = weakref.ref(self.turn_end)
        self.scorer = self._new_scorer(None)
        self._present = {}
        self.sparse_from = None  # what a sparse layer reported before the load failed: the recompute starts over
        self.turn_end.extra = self._extra()
        self.layers = self.turn_end.layers = build_layers(self, self._layout, 0, None, self._device, self.sparse)
        self._cache().layers = self.layers
        kwargs = {k: v for k, v in kwargs.items() if k not in ("position_ids", "attention_mask", "cache_position")}
        kwargs["input_ids"] = self.input_ids[:, :total]
        args = ()
        self.begin_forward(kwargs["input_ids"], None, None)
        with self.scoring():
            output = original(*args, **kwargs)
        self.end_forward()
        # The caller asked for the last `fed` positions only.
        output.last_hidden_state = output.last_hidden_state[:, -fed:]
        return output

    # -- saving what the model computes ------------------------------------------------------------------
    def begin_forward(self, input_ids, inputs_embeds, position_ids) -> None:
        """Called by the base model's pre-hook before each forward through this cache."""
        if self._broken or self._pending is not None:
            self._broken = True
            raise RuntimeError(
                "a previous forward through this AttnStoreCache did not complete, so its layers disagree; "
                "create a new AttnStoreCache for this session (the store kept the last complete state)"
            )
        x = input_ids if input_ids is not None else inputs_embeds
        batch, length = x.shape[0], x.shape[1]
        self._fwd_input_len = length
        if batch != 1:
            raise ValueError(f"AttnStoreCache supports batch size 1, got a forward with batch {batch}: one session "
                             "per cache, so no beam search (`num_beams=1`) and `num_return_sequences=1`")
        past = self._cache().get_seq_length()
        self._clock.collect()
        if self._snapshot is None and self.scorer is None and self.sparse is None:
            self._clock.begin(x.device, past, length)  # computes without waiting for stored KV: a prefill sample
        else:
            self._clock.cancel()
        positions = torch.arange(past, past + length, device=x.device)
        self._fwd_end = past + length
        if position_ids is not None and not torch.equal(position_ids.reshape(-1).to(x.device), positions):
            raise ValueError(
                "AttnStoreCache needs contiguous positions that continue the cache (no padding, no custom "
                "`position_ids`)"
            )
        if input_ids is None:
            self._save = False
            _once.warning("embeds", "forward with `inputs_embeds` only: token ids are unknown, so the session is not saved")
        else:
            prompt_left = self.input_ids.shape[1] - past
            n = min(length, max(prompt_left, 0))
            if n and not torch.equal(input_ids[0, :n].to(self.input_ids.device), self.input_ids[0, past : past + n]):
                raise ValueError(
                    "the ids fed to the model differ from `cache.input_ids`: pass `cache.input_ids` (the full, "
                    "possibly truncated prompt) to `generate`, or its remainder after `cache.get_seq_length()` "
                    "tokens to a plain forward"
                )
            self._fwd_ids = input_ids.reshape(-1)
        if self._rope.has_rope and self._save:
            self._fwd_rope = self._inverse_rope(positions)
        self._pending = [None] * self._geometry[0]
        if self.turn_end.has_state:
            with self.turn_end.lock:
                self.turn_end.complete = False  # until the forward completes, the layers' states disagree

    def _inverse_rope(self, positions: torch.Tensor) -> dict:
        """Per rotary group, the factors that un-rotate keys computed at `positions` (see RopeAdapter.inverse)."""
        return {group: self._rope.inverse(*self._rope.cos_sin(positions, torch.float32, group))
                for group in self._rope.groups}

    def _unrotate(self, keys: torch.Tensor, inverse: dict) -> torch.Tensor:
        """Stacked rotated keys ``[layers, 1, kv_heads, n, head_dim]`` back to pre-RoPE (see _inverse_rope)."""
        rope = self._rope
        if rope.uniform:
            inv_cos, inv_sin = next(iter(inverse.values()))
            return rope.unrotate(keys, inv_cos.to(keys.device), inv_sin.to(keys.device))
        rotated, keys = keys, keys.clone()  # each layer type with its own frequencies; NoPE layers: not rotated
        for group, layers in rope.groups.items():
            inv_cos, inv_sin = inverse[group]
            keys[layers] = rope.unrotate(rotated[layers], inv_cos.to(keys.device), inv_sin.to(keys.device))
        return keys

    def record(self, idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keeps a layer's new KV (keys still rotated) until the forward completes."""
        if self._pending is None:
            raise RuntimeError(
                "AttnStoreCache.update was called outside a forward of the model it was created with; "
                "create the cache with the model that uses it"
            )
        self._pending[idx] = (keys, values) if self._save else (None, None)  # read-only: nothing to keep

    def end_forward(self) -> None:
        """Called after the base model's forward: un-rotates the new keys and commits the KV to the store.

        All layers at once: one stacked tensor ``[layers, 1, kv_heads, n, head_dim]`` is un-rotated in a
        handful of kernels and copied into the host tier in one copy, where per-layer work cost ~7 kernels
        and two copies per layer and token (decoding is dominated by such small operations).
        """
        pending, self._pending = self._pending, None
        self._clock.end()
        if pending is None or all(p is None for p in pending):
            return  # e.g. use_cache=False: nothing was added (states, if any, did not change either)
        assert all(p is not None for p in pending), "every layer must update the cache in a forward"
        ids = self._fwd_ids
        self._fed_ids.append(ids)
        if self._rope.regime(self._fwd_end) != self.regime:
            self.leave_regime()  # decoding went past the length where the frequencies change
        if self._save and ids is not None:
            started = time.perf_counter()
            keys = torch.stack([p[0] for p in pending])
            if self._rope.has_rope:
                keys = self._unrotate(keys, self._fwd_rope)
            n = keys.shape[-2]
            # A long prefill's values are kept as they are (adopted without a copy); short steps are stacked.
            values = torch.stack([p[1] for p in pending]) if n < 64 else [p[1] for p in pending]
            first = self._fwd_end - n
            inexact_at = None if self.sparse_from is None else min(max(0, self.sparse_from - first), n)
            stored = self._writer.append(ids, keys, values, inexact_at)
            self.save_seconds += time.perf_counter() - started
            if stored:
                self.saved_tokens += int(ids.numel())
        self._drop_superseded()  # after a complete forward: a turn that never runs changes nothing
        if self.turn_end.has_state:
            with self.turn_end.lock:
                # The forward's end, not the layers' length: KV appended from a batch (`append_computed`) is not in
                # the layers, whose tensors the batch cache took over.
                self.turn_end.tokens, self.turn_end.complete = self._fwd_end, True

    def leave_regime(self) -> None:
        """The turn's sequence grows past the length where length-dependent RoPE changes its frequencies: what
        comes next is KV of another regime than the session's. The session's stored KV, which would lag behind
        its history, is dropped now and nothing more is saved: the next turn recomputes the session in the new
        regime (as transformers' phi3 does when it crosses mid-generation)."""
        if not self._save:
            return
        logger.info("session %r went past %d tokens, where the model's %s RoPE changes frequencies: its stored KV "
                    "is dropped, and the next turn recomputes it", self.session_id, self._rope.limit,
                    self._rope.scaling)
        self._save = False
        self._superseded = list(self._fingerprints)
        self._drop_superseded()  # called between forwards, or after the last one this turn saves

    def _drop_superseded(self) -> None:
        for fingerprint in self._superseded:
            self._store.delete(self.session_id, fingerprint)
        self._superseded = []

    def attended_sparse(self, position: int) -> None:
        """A sparse layer's forward from session position `position` attends to a selection of the history."""
        self.sparse_from = position if self.sparse_from is None else min(self.sparse_from, position)

    def append_computed(self, token_ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                        values: list[torch.Tensor], sparse_from: int | None = None) -> None:
        """Stores KV the model computed for this session outside this cache (a batched decoding step over
        several sessions), exactly as a forward through the cache would store it.

        Args:
            token_ids: The ``n`` ids the KV belongs to, continuing the cache's ids.
            positions: Their positions, ``[n]`` (the keys are rotated for these).
            keys, values: Per layer, ``[1, kv_heads, n, head_dim]``, as the model's layers cached them (keys still
                rotated; for multi-head latent attention, the latent and the rotated key part).
            sparse_from: The position of the first of them computed attending to a selection of the history
                (a sparse row, serving/sparse_rows.py), or None: they and what follows are labelled inexact.
        """
        if sparse_from is not None:
            self.attended_sparse(sparse_from)
        if len(keys) != self._geometry[0] or len(values) != self._geometry[0]:
            raise ValueError(f"expected KV of {self._geometry[0]} layers, got {len(keys)}")
        if self._layout.latent:  # the store's keys are the rotated tensor (layers.LayerLayout.latent)
            keys, values = values, keys
        self._fwd_ids = token_ids.reshape(-1)
        self._fwd_end = int(positions.max()) + 1
        if self._rope.has_rope and self._save:
            self._fwd_rope = self._inverse_rope(positions.reshape(-1))
        self._pending = list(zip(keys, values))
        self.end_forward()

    def close(self) -> None:
        """Ends the turn: the store may demote the session again; later forwards are not saved."""
        self.turn_end()  # closes the writer, with a hybrid model's states
        self._save = False
        self._clock.collect()

    def cropped(self, total: int) -> None:
        """The cache was cropped to `total` tokens (assisted generation rejected drafts): the session follows, so
        that the store holds exactly the tokens the model kept (cache/speculative.py)."""
        kept = max(total - self.reused_tokens, 0)
        fed = torch.cat(self._fed_ids) if self._fed_ids else torch.empty(0, dtype=torch.long)
        self._fed_ids = [fed[:kept]]
        self.saved_tokens = min(self.saved_tokens, kept)  # the rejected drafts were handed over, then taken back
        if self._writer is not None:
            self._writer.truncate(total)
        if self.turn_end.has_state:
            with self.turn_end.lock:
                # The states are stored labelled with the tokens they summarize: after the crop (which rolled the
                # layers' convolution states back), the kept ones.
                self.turn_end.tokens = min(self.turn_end.tokens, total)


def _rectangular_prefix(absent: torch.Tensor | None, end: int) -> int:
    """The longest prefix of `end` tokens in which every KV slot and head has KV for the same number of tokens
    (`absent`: ``[slots, heads, end]``, tokens loaded from sparse cold copies without KV): what a sparse layer can
    hold as one tensor. Chunks keep one count each (store/sparse_copies.py), so this ends at a chunk boundary at
    worst."""
    if absent is None or not bool(absent.any()):
        return end
    counts = (~absent).to(torch.int32).cumsum(dim=2, dtype=torch.int32).view(-1, end)
    even = (counts == counts[:1]).all(dim=0).nonzero()
    return int(even[-1]) + 1 if even.numel() else 0


def _kept_tensors(scorer: "importance.Scorer", sparse: SparseConfig | None, present: dict, reused: int,
                  tokens: int) -> dict[str, torch.Tensor]:
    """The scores to keep with the session after `tokens` tokens (`_score_tensors`) and, for a session kept sparse
    by importance (`sparse`), the selection its next turn's first forward makes: ``S{slot:04d}``, ``[kv_heads,
    budget]`` session positions (int64), chosen by these scores among every token with KV (all but those `present`
    leaves out of the `reused` ones), as a resumed layer chooses. A store with sparse cold copies keeps those tokens
    alone (`StoreConfig.sparse_copies`)."""
    out = _score_tensors(scorer, tokens)
    if sparse is None or not out:
        return out
    keep = sparse.budget(tokens)
    for slot in scorer.slot_of.values():
        heads = scorer.scores[slot].shape[0]
        columns = torch.arange(tokens).expand(heads, -1)
        if slot in present:
            columns = torch.cat([present[slot].cpu(), torch.arange(reused, tokens).expand(heads, -1)], dim=1)
        picked = select(columns, scorer.scores_for(slot, columns).cpu(), keep, sparse)
        out[selection_name(slot)] = columns.gather(1, picked).to(torch.int64)
    return out


def _score_tensors(scorer: "importance.Scorer", tokens: int) -> dict[str, torch.Tensor]:
    """The scores to keep with the session after `tokens` tokens, fp32, named by what they sum, or none when some
    layer's scores do not cover them (KV appended without scoring): the next turn then scores anew. (A batch
    scores its decoding steps, `importance.BatchScorer`.)"""
    if not scorer.has_scores:
        return {}
    out = {}
    for slot in scorer.slot_of.values():
        scores = scorer.scores[slot]
        if scores.shape[1] < tokens:
            return {}
        out[importance.score_name(slot, scorer.policy, scorer.window)] = scores[:, :tokens].float()
    return out
