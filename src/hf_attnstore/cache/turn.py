"""One turn of a session through an :class:`~hf_attnstore.cache.AttnStoreCache`: the per-turn work.

A `CacheTurn` plans once, before any forward: one store call (`AttnStore.find`: the session's own KV, a longer
prefix shared by another session, their states verified, pinned) and one pure function (plan.py: which tokens the
prompt reuses, truncation, sparse copies, a hybrid model's states, an evicted head to recompute). It then executes
the plan: an evicted head is recomputed (head.py); each layer's reused KV is loaded and re-rotated when the layer
first runs (load.py, `load_layer`); each forward's new KV is recorded and handed to the store (record.py). The
forward wrapper (hooks.py) brackets forwards through `begin_forward` / `end_forward`, and re-runs a forward whose
stored KV proved unreadable (`recompute_forward`): the turn starts over from a plan that reuses nothing. The cache
itself stays a thin `transformers.Cache` over the layers (cache.py).

Layout of every KV tensor here: ``[batch=1, kv_heads, seq, head_dim]``; stored keys are pre-RoPE.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref

import torch
from torch import nn

from ..store import AttnStore, Found
from ..store.stats import OnceLogger
from ..store.states import selection_name
from . import importance, query_aware, upstream
from .config import SparseConfig, TruncationConfig
from .fingerprint import kv_geometry, model_fingerprint, regime_fingerprint, salted_fingerprint
from .head import recompute_head
from .layers import AttnStoreSparseLayer, TurnEnd, build_layers
from .layout import LayerLayout
from .load import ReuseLoader
from .plan import ModelFacts, TurnPlan, miss_plan, plan_turn, score_names, shares, stored_scores
from .prefill_clock import PrefillClock
from .record import Recorder
from .rope import RopeAdapter
from .sparse import select

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
    the scoring one (importance.enable).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> layout = LayerLayout(kinds=("kv",), states=(0,), full=(False,))  # as if its one layer were sliding
        >>> check_scored(model, layout, "llama", SparseConfig(0.5), scored=True)
        Traceback (most recent call last):
        ...
        ValueError: `kv_budget` needs full-attention layers, and llama has none
    """
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
    if scored or (sparse is not None and sparse.query_aware):
        importance.enable(model)  # raises unless the model runs SDPA or eager attention
    if sparse is not None and sparse.query_aware and upstream.attention_implementation(model) != importance.ATTENTION_NAME:
        raise ValueError(f"`kv_budget` with policy {sparse.policy!r} selects inside SDPA, but {model_type} runs "
                         f"{upstream.attention_implementation(model)!r} attention: load it with "
                         "`attn_implementation=\"sdpa\"`, or use policy \"alisa\"")


class CacheTurn:
    """The per-turn state and work of an :class:`~hf_attnstore.cache.AttnStoreCache` (see the module docstring).

    Args:
        cache: The cache this turn belongs to (held weakly: the cache owns the turn).
        model, store, session_id, prompt, truncation, save, cache_salt, sparse: As given to the cache, validated.

    Example:
        >>> cache = AttnStoreCache(model, store, "alice", ids)  # doctest: +SKIP
        >>> cache.turn.reused_tokens == cache.reused_tokens  # doctest: +SKIP
        True
    """

    def __init__(self, cache, model: nn.Module, store: AttnStore, session_id: str, prompt: torch.Tensor,
                 truncation: TruncationConfig, save: bool, cache_salt: str | None = None,
                 sparse: SparseConfig | None = None):
        self._cache = weakref.ref(cache)
        self.session_id, self.truncation, self.sparse = session_id, truncation, sparse
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
        self._geometry = kv_geometry(model)
        self._layout = LayerLayout.of(model)
        self._windows = self._layout.slot_windows  # KV slot -> sliding window
        self._facts = ModelFacts(has_rope=self._rope.has_rope, has_state=self._layout.has_state,
                                 sparse=sparse is not None)
        # Length-dependent RoPE (longrope, dynamic): KV is keyed by the frequency regime of the turn's first
        # forward, whose length the truncation settings alone decide (rope.RopeAdapter.regime).
        self.regime = self._rope.regime(miss_plan(prompt, truncation, self._facts).reuse.input_ids.shape[1])
        # Memoized, but its change key walks every tensor: once per turn.
        model_key = model_fingerprint(model, store.config.namespace)
        base = salted_fingerprint(model_key, cache_salt)
        self.fingerprint = regime_fingerprint(base, self.regime or "")
        # What this turn's first stored forward deletes: the session's KV of this model in other regimes (the
        # session has one history; their KV would lag behind it). All of it when this turn cannot save.
        every_key = regime_keys(base, self._rope)
        superseded = [fp for fp in every_key if fp != self.fingerprint] if save else []
        if self.regime is None:
            _once.warning("dynamic-rope", f"`dynamic` RoPE past {self._rope.limit} tokens changes its frequencies "
                          "with every length: such turns are recomputed and not stored")
            superseded, save = (list(every_key) if save else []), False
        # Importance scores: for a session kept sparse by importance, or truncated by it (importance.py). Scored
        # layers: the full-attention ones (a sliding-window layer keeps its window, not a selection).
        self._scored = (sparse is not None and sparse.scored) or truncation.mode == "importance"
        # What the scores sum (and are stored under): the sparse policy's, else importance truncation's (ALISA's).
        self._score_config = sparse if sparse is not None and sparse.scored else SparseConfig(1.0)
        self._slot_of = {idx: slot for slot, idx in enumerate(self._layout.kv_layers) if self._layout.full[idx]}
        if sparse is not None or self._scored:
            check_scored(model, self._layout, self._rope.model_type, sparse, self._scored)
        # With `recompute_by_cost`, the model's prefills are reported to the store, which decides by them whether a
        # resumed session's leading chunks are loaded or recomputed; without it nothing reads them, and nothing times.
        self._clock = PrefillClock(functools.partial(store.costs.observe_prefill, model_key)) \
            if store.config.recompute_by_cost else None
        self._prefill_key = head_prefill_key(model_key, self._layout, self._rope)
        self._store, self._device, self._save = store, model.device, bool(save)
        self._stored_scores: dict[int, torch.Tensor] | None = None
        self.turn_plan = self._plan(model, prompt)
        self.input_ids = self.turn_plan.reuse.input_ids.to(model.device)
        self.dropped_tokens = self.turn_plan.reuse.dropped
        self.recomputed = False  # set if stored KV proved unreadable mid-forward and the prompt was recomputed
        self._fwd_input_len = 0
        self._broken = False
        # A hybrid model's turn ends by keeping its states with the session, also when the cache is just dropped;
        # a scored turn keeps its tokens' importance scores the same way (filled by `_start`).
        self.turn_end = TurnEnd(self._layout.has_state or self._scored)
        self._recorder = Recorder(store, session_id, self._save, self._rope, self.regime, self._geometry[0],
                                  self.turn_end, superseded, every_key)
        self._start(self.turn_plan)

    def _plan(self, model: nn.Module, prompt: torch.Tensor) -> TurnPlan:
        """The turn's plan, before any forward: one store call (`AttnStore.find`), one pure function
        (`plan.plan_turn`), then the one step that needs the model: a head to recompute (head.py)."""
        found = Found(None)
        if self.regime is not None:
            found = self._store.find(
                self.session_id, self.fingerprint, prompt, prefill_key=self._prefill_key,
                exact=self.sparse is None, share=shares(prompt, self.truncation, self._facts),
                wait_first=self._layout.has_state or self._scored or self.sparse is not None, geometry=self._geometry)
        if self._scored and found.own is not None:
            config = self._score_config
            self._stored_scores = stored_scores(found.own.state, score_names(self._slot_of.values(), config.policy,
                                                                             config.score_window), self._geometry[1])
        plan = plan_turn(prompt, self.truncation, found, self._facts, self._stored_scores)
        source = plan.source
        if source is not None and source.head and not plan.shared:
            snapshot = recompute_head(model, self._store, source.snapshot, plan.head, self._rope, self._layout,
                                      self._clock, self.regime)
            if snapshot is None:  # nothing worth reusing beyond the missing head
                return miss_plan(prompt, self.truncation, self._facts)
            plan = dataclasses.replace(plan, source=dataclasses.replace(source, snapshot=snapshot, head=0))
        return plan

    def _start(self, plan: TurnPlan) -> None:
        """Sets the turn up to execute `plan`: the reused KV's loader, the store's writer, the scorer and the layers.
        A turn whose stored KV proves unreadable starts again here, over a plan that reuses nothing."""
        self.turn_plan = plan
        snapshot = plan.source.snapshot if plan.reused else None
        self.loader = None if snapshot is None else ReuseLoader(snapshot, plan.reuse, self._rope, self._geometry[0],
                                                                self._windows, self._store.config)
        # While the turn runs its session stays pinned in host memory; dropping the cache (and so its writer) ends
        # the turn, see TurnWriter.close.
        writer = self._store.open_turn(self.session_id, self.fingerprint, snapshot, plan.reuse.keep) \
            if self._save else None
        self.scorer = self._new_scorer(self._initial_scores(plan))
        # A query-aware turn's page summaries start with its layers (a restarted turn summarizes its keys anew).
        self.selection = query_aware.Selection(self.sparse) if self.sparse is not None and self.sparse.query_aware \
            else None
        self.layers = build_layers(self, self._layout, plan.reused, plan.state, self._device, self.sparse)
        if self.selection is not None:  # the attention finds each layer's history kept on the host by layer index
            self.selection.host.update({idx: layer.host for idx, layer in enumerate(self.layers)
                                        if getattr(layer, "host", None) is not None})
            # ... and its config, whose budget is that layer's (`SparseConfig.layer_slope`): one source for both.
            self.selection.configs.update({idx: layer.config for idx, layer in enumerate(self.layers)
                                           if isinstance(layer, AttnStoreSparseLayer)})
        # The reused tokens with KV per KV slot, ``[kv_heads, P]`` (a session loaded from sparse cold copies; empty:
        # all of them), set by `_start_from_present`: what the session's next turn selects from, with this turn's.
        self._present: dict[int, torch.Tensor] = {}
        if self.sparse is not None and snapshot is not None:
            self._start_from_present(plan)
        self._recorder.restart(writer)
        self.turn_end.start(writer, self.layers, self._extra())

    # What the plan decided (see plan.TurnPlan).
    plan = property(lambda self: self.turn_plan.reuse, doc="The reuse plan (truncation.ReusePlan).")
    reused_tokens = property(lambda self: self.turn_plan.reused, doc="How many of `input_ids` come from the store.")
    shared_from = property(lambda self: self.turn_plan.shared_from, doc="The other session this turn reuses KV of.")
    source = property(lambda self: self.turn_plan.source if self.turn_plan.reused else None,
                      doc="The store's match the reused KV comes from (None: a miss).")
    recomputed_head = property(lambda self: self.turn_plan.head, doc="Leading tokens recomputed instead of loaded.")
    reused_recomputed = property(lambda self: self.turn_plan.head_reused,
                                 doc="Of `reused_tokens`, those whose KV this turn computed (a head).")

    @property
    def kv_source(self) -> str:
        """Where the reused KV came from: host, disk, remote, or miss."""
        return self.turn_plan.kv_source

    saved_tokens = property(lambda self: self._recorder.saved_tokens, doc="Tokens this turn handed to the store.")
    save_seconds = property(lambda self: self._recorder.save_seconds,
                            doc="Seconds this turn spent un-rotating keys and handing KV to the store.")
    sparse_from = property(lambda self: self._recorder.sparse_from,
                           doc="The position of the first token computed under sparse attention, or None.")

    @property
    def token_ids(self) -> torch.Tensor:
        """The ids the cache's KV covers so far: the reused prefix, then everything fed to the model."""
        prefix = self.plan.input_ids[0, : self.reused_tokens]
        return torch.cat([prefix] + [t.cpu() for t in self._recorder.fed_ids])

    # -- scoring (importance.py) ---------------------------------------------------------------------------
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

    def _initial_scores(self, plan: TurnPlan) -> dict[int, torch.Tensor] | None:
        """The stored scores of the tokens `plan` reuses of the session's own KV, in the order it keeps them (on the
        device)."""
        stored = self._stored_scores
        if not stored or plan.shared or not plan.reused:
            return None
        keep = plan.reuse.keep
        if int(keep.max()) >= next(iter(stored.values())).shape[1]:
            return None  # stored scores older than the KV: this turn scores anew
        return {slot: s[:, keep].to(self._device) for slot, s in stored.items()}

    def _start_from_present(self, plan: TurnPlan) -> None:
        """Hands each sparse layer the reused tokens that have KV (a session loaded from sparse cold copies): the
        same count per KV head and slot (`plan.fit_present`), the others never attended to."""
        absent = plan.source.absent
        if absent is None:
            return
        absent = absent[:, :, plan.reuse.keep]
        if not bool(absent.any()):
            return
        heads = absent.shape[1]
        for layer in self.layers:
            if isinstance(layer, AttnStoreSparseLayer):
                slot = layer.held_slot
                self._present[slot] = torch.nonzero(~absent[slot])[:, 1].view(heads, -1)
                layer.present(self._present[slot])

    def _columns(self, slot: int) -> torch.Tensor | None:
        """Session positions of the keys KV slot `slot` attends to now (None: all, in order)."""
        return getattr(self.layers[self._layout.kv_layers[slot]], "columns", None)

    def scoring(self):
        """The context of a forward: the model's attention feeds this turn's scorer (importance.py), or selects per
        query for a query-aware turn (query_aware.py)."""
        if self.selection is not None:
            return query_aware.selecting(self.selection)
        return importance.scoring(self.scorer) if self.scorer is not None else contextlib.nullcontext()

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

    # -- the model's RoPE regimes ----------------------------------------------------------------------------
    @property
    def length_dependent(self) -> bool:
        """Whether the model's RoPE frequencies depend on each forward's length (see rope.RopeAdapter.regime)."""
        return self._rope.length_dependent

    def regime_of(self, length: int) -> str | None:
        """The frequency regime of a forward whose sequence is `length` long (rope.RopeAdapter.regime)."""
        return self._rope.regime(length)

    def leave_regime(self) -> None:
        """The sequence grows past the length where the RoPE frequencies change: see `Recorder.leave_regime`."""
        self._recorder.leave_regime()

    # -- each forward: load what it reuses, record what it computes -----------------------------------------
    def forward_started(self) -> None:
        """A forward of this turn's model begins: the store's writer yields to compute (store.py)."""
        self._store.forward_started()

    def forward_finished(self) -> None:
        """The forward ended (see :meth:`forward_started`)."""
        self._store.forward_finished()

    def load_layer(self, idx: int, length: int, new_keys: torch.Tensor, new_values: torch.Tensor):
        """Layer `idx`'s reused KV followed by this forward's new KV (see `ReuseLoader.load_layer`)."""
        if length == 0:
            return new_keys, new_values
        return self.loader.load_layer(idx, length, new_keys, new_values)

    def record(self, idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keeps a layer's new KV (keys still rotated) until the forward completes (`Recorder.record`)."""
        self._recorder.record(idx, keys, values)

    def attended_sparse(self, position: int) -> None:
        """A sparse layer's forward from session position `position` attends to a selection of the history."""
        self._recorder.attended_sparse(position)

    def begin_forward(self, input_ids, inputs_embeds, position_ids) -> None:
        """Called by the base model's pre-hook before each forward through this cache."""
        if self._broken or self._recorder.in_forward:
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
        if self._clock is not None:
            self._clock.collect()
            loading = self.loader is not None and self.loader.snapshot is not None
            if not loading and self.scorer is None and self.sparse is None:
                self._clock.begin(x.device, past, length)  # computes without waiting for stored KV: a prefill sample
            else:
                self._clock.cancel()
        positions = torch.arange(past, past + length, device=x.device)
        if position_ids is not None and not torch.equal(position_ids.reshape(-1).to(x.device), positions):
            raise ValueError(
                "AttnStoreCache needs contiguous positions that continue the cache (no padding, no custom "
                "`position_ids`)"
            )
        if input_ids is not None:
            prompt_left = self.input_ids.shape[1] - past
            n = min(length, max(prompt_left, 0))
            if n and not torch.equal(input_ids[0, :n].to(self.input_ids.device), self.input_ids[0, past : past + n]):
                raise ValueError(
                    "the ids fed to the model differ from `cache.input_ids`: pass `cache.input_ids` (the full, "
                    "possibly truncated prompt) to `generate`, or its remainder after `cache.get_seq_length()` "
                    "tokens to a plain forward"
                )
        self._recorder.begin(input_ids, positions, past + length)

    def end_forward(self) -> None:
        """Called after the base model's forward: the new KV goes to the store (`Recorder.end_forward`)."""
        if self._clock is not None:
            self._clock.end()
        self._recorder.end_forward()

    def recompute_forward(self, original, args: tuple, kwargs: dict):
        """Runs the current forward again over the whole prompt, without reused KV (see hooks.py): the turn starts
        over from a plan that reuses nothing (`TurnPlan.without_reuse`: the same ids)."""
        _once.warning("recompute", f"stored KV of session {self.session_id!r} could not be loaded: recomputing it")
        fed = self._fwd_input_len
        total = self.reused_tokens + fed  # a load can only fail in the first forward of a turn
        if self._recorder.writer is not None:
            self._recorder.writer.close()
        self._start(self.turn_plan.without_reuse())
        self.recomputed = True
        self._cache().layers = self.layers
        kwargs = {k: v for k, v in kwargs.items() if k not in ("position_ids", "attention_mask", "cache_position")}
        kwargs["input_ids"] = self.input_ids[:, :total]
        self.begin_forward(kwargs["input_ids"], None, None)
        with self.scoring():
            output = original(**kwargs)
        self.end_forward()
        # The caller asked for the last `fed` positions only.
        output.last_hidden_state = output.last_hidden_state[:, -fed:]
        return output

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
        self._recorder.stage(token_ids, positions, keys, values)
        self.end_forward()

    def close(self) -> None:
        """Ends the turn: the store may demote the session again; later forwards are not saved."""
        self.turn_end()  # closes the writer, with a hybrid model's states
        self._recorder.save = False
        if self._clock is not None:
            self._clock.collect()

    def cropped(self, total: int) -> None:
        """The cache was cropped to `total` tokens (assisted generation rejected drafts): the session follows, so
        that the store holds exactly the tokens the model kept (cache/speculative.py)."""
        self._recorder.cropped(total, self.reused_tokens)


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
