"""The per-layer objects of an :class:`~hf_attnstore.cache.AttnStoreCache`, and which layer gets which.

Most models keep KV in every layer: each one is an :class:`AttnStoreLayer`. Hybrid models mix attention
layers with linear-attention or state-space layers (transformers' layer types ``linear_attention`` and
``conv``), layers that have both (``hybrid``: falcon_h1, zamba2) and layers with no cache (``dummy``:
nemotron_h's MLP layers). :class:`LayerLayout` reads the types from the model's config, as
`DynamicCache(config=...)` does, and numbers the KV-carrying layers: the store keeps one KV *slot* per
such layer, so its geometry counts slots, not model layers.

Multi-head latent attention (deepseek_v2/v3 and the families built on them, `LATENT_MODEL_TYPES`) caches two
single-head tensors per layer: as "keys" the compressed latent ``[1, 1, n, kv_lora_rank]``, which carries no
position, and as "values" the rotary part of the key ``[1, 1, n, qk_rope_head_dim]``, rotated. The store keeps
them the other way round, so that its keys are always the rotated tensor (un-rotated on save, re-rotated on
load, quantized per channel by a codec): the layers swap them at the boundary (`LayerLayout.latent`).

States are restored into transformers' own `LinearAttentionLayer` (the models call its
`update_conv_state` / `update_recurrent_state`), and captured from it at the end of a turn (states.py).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from ..store import SessionState
from . import query_aware
from .config import SparseConfig
from .host_history import GatherBuffers, HostHistory
from .layout import BOTH, KV, STATE, LayerLayout
from .sparse import select
from .upstream import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    set_linear_length,
)


class LayerOwner(Protocol):
    """What a sparse layer asks of the turn that owns it (`turn.CacheTurn`), named here so that this module does not
    import the turn's, which imports this one. Every layer loads from the turn's `ReuseLoader` and records to its
    `Recorder` directly (`build_layers`)."""

    def can_select(self, start: int) -> bool: ...

    def scores_for(self, slot: int, columns: torch.Tensor) -> torch.Tensor: ...


logger = logging.getLogger(__name__)


class AttnStoreLayer(DynamicLayer):
    """One KV layer of an :class:`AttnStoreCache` (store slot `slot`).

    Until the layer's first `update()`, its reused KV stays in the store and only its length is known
    (`generate` needs the length before any forward). The first update loads this layer alone and
    re-applies RoPE for the new positions, so loading proceeds layer by layer with the forward pass.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from hf_attnstore import AttnStore, AttnStoreCache, cache_kwargs
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> store = AttnStore(host_bytes="1MiB")
        >>> with AttnStoreCache(model, store, "alice", torch.tensor([[1, 5, 9, 4]])) as cache:
        ...     _ = model(cache.input_ids, **cache_kwargs(cache))
        >>> cache = AttnStoreCache(model, store, "alice", torch.tensor([[1, 5, 9, 4, 7]]))
        >>> layer = cache.layers[0]
        >>> type(layer).__name__, layer.get_seq_length(), layer.keys is None  # 4 tokens reused, not loaded yet
        ('AttnStoreLayer', 4, True)
    """

    def __init__(self, owner: LayerOwner, slot: int, reused: int, swap: bool = False):
        DynamicLayer.__init__(self)
        # A weak reference: no cycle between the cache and its layers, so a cache dropped by its user is freed
        # (and its turn closed, see AttnStoreCache.close) at once rather than at the next garbage collection.
        self._owner = weakref.proxy(owner)
        self._layer_idx = slot
        self._pending_reuse = reused
        self._swap = swap  # multi-head latent attention: the store's keys are the model's values (module doc)
        # The turn's loader of reused KV (load.ReuseLoader, None when nothing is reused) and its recorder
        # (record.Recorder), set by `build_layers`.
        self._loader = self._recorder = None

    def _with_reused(self, length: int, new_keys: torch.Tensor, new_values: torch.Tensor):
        """The layer's `length` reused tokens, loaded and re-rotated (`ReuseLoader.load_layer`), then the new KV."""
        if length == 0:
            return new_keys, new_values
        return self._loader.load_layer(self._layer_idx, length, new_keys, new_values)

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return self._pending_reuse
        return super().get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(
                f"AttnStoreCache supports batch size 1 (got {key_states.shape[0]}): no beam search, "
                "num_return_sequences=1, one session per cache"
            )
        # In the store's roles: `rotated` is what RoPE turned (the model's keys, or an MLA model's values).
        rotated, other = (value_states, key_states) if self._swap else (key_states, value_states)
        if not self.is_initialized:
            # First forward of the turn: this layer's reused KV (re-rotated) and the new KV, written into one
            # tensor each (DynamicLayer's own concatenation would copy as much).
            self.dtype, self.device = key_states.dtype, key_states.device
            all_rotated, all_other = self._with_reused(self._pending_reuse, rotated, other)
            self.keys, self.values = (all_other, all_rotated) if self._swap else (all_rotated, all_other)
            self._recorder.record(self._layer_idx, rotated, other)
            self.is_initialized = True
            return self.keys, self.values
        self._recorder.record(self._layer_idx, rotated, other)
        return DynamicLayer.update(self, key_states, value_states)

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_initialized:
            self._pending_reuse = max(0, self._pending_reuse + min(0, tokens_to_remove))
            return
        DynamicLayer.crop(self, tokens_to_remove)


class AttnStoreSlidingLayer(AttnStoreLayer, DynamicSlidingWindowLayer):
    """A sliding-window KV layer (store slot `slot`): like transformers' `DynamicSlidingWindowLayer`, it keeps
    only the last ``sliding_window - 1`` tokens, all its next query can attend to, and it loads only those of
    the reused ones. The store keeps every token (a later turn may diverge or truncate earlier).

    Example:
        >>> from transformers import MistralConfig, MistralForCausalLM
        >>> from hf_attnstore import AttnStore, AttnStoreCache, cache_kwargs
        >>> model = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, sliding_window=4)).eval()
        >>> store = AttnStore(host_bytes="1MiB")
        >>> cache = AttnStoreCache(model, store, "alice", torch.arange(10).view(1, -1))
        >>> _ = model(cache.input_ids, **cache_kwargs(cache))
        >>> stored = store.token_ids("alice", cache.fingerprint)
        >>> type(cache.layers[0]).__name__, cache.layers[0].keys.shape[2], len(stored)  # the store keeps all 10
        ('AttnStoreSlidingLayer', 3, 10)
    """

    is_sliding = True

    def __init__(self, owner: LayerOwner, slot: int, reused: int, swap: bool, sliding_window: int):
        AttnStoreLayer.__init__(self, owner, slot, reused, swap)
        # DynamicSlidingWindowLayer's state (its mask sizes, past recording and crop are used as they are).
        self.sliding_window = sliding_window
        self._sliding_window_tensor = torch.tensor(sliding_window, dtype=torch.long)
        self.cumulative_length = reused  # tokens seen, including those no longer kept
        self.record_past = False  # set by assisted decoding, which crops what it rejects

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            return AttnStoreLayer.update(self, key_states, value_states)  # raises the batch-size error
        rotated, other = (value_states, key_states) if self._swap else (key_states, value_states)
        if not self.is_initialized:
            # The reused tokens the window still sees (the cache loads only those), then the new ones.
            self.dtype, self.device = key_states.dtype, key_states.device
            self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
            all_rotated, all_other = self._with_reused(self._pending_reuse, rotated, other)
            full_keys, full_values = (all_other, all_rotated) if self._swap else (all_rotated, all_other)
            self.is_initialized = True
        else:
            full_keys = torch.cat([self.keys, key_states], dim=-2)
            full_values = torch.cat([self.values, value_states], dim=-2)
        self._recorder.record(self._layer_idx, rotated, other)
        self.cumulative_length += key_states.shape[-2]
        if self.record_past:  # kept whole until `crop` (as DynamicSlidingWindowLayer)
            self.keys, self.values = full_keys, full_values
            visible = self.sliding_window - 1 + key_states.shape[-2]
            return full_keys[:, :, -visible:], full_values[:, :, -visible:]
        self.keys = full_keys[:, :, -self.sliding_window + 1 :]
        self.values = full_values[:, :, -self.sliding_window + 1 :]
        return full_keys, full_values

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_initialized:
            AttnStoreLayer.crop(self, tokens_to_remove)
            self.cumulative_length = self._pending_reuse
            return
        DynamicSlidingWindowLayer.crop(self, tokens_to_remove)


class AttnStoreHybridLayer(LinearAttentionLayer, AttnStoreLayer):
    """A layer with both KV (an :class:`AttnStoreLayer`) and linear-attention states (falcon_h1, zamba2)."""

    is_compileable = False  # its KV grows

    def __init__(self, owner: LayerOwner, slot: int, reused: int, number_of_states: int):
        AttnStoreLayer.__init__(self, owner, slot, reused)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # As transformers' LinearAttentionAndFullAttentionLayer: the KV path passes two positional tensors,
        # the state path keyword arguments.
        if len(args) == 2 and not kwargs:
            DynamicLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return AttnStoreLayer.update(self, key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return AttnStoreLayer.get_seq_length(self)

    def get_max_length(self) -> int:
        return DynamicLayer.get_max_length(self)

    def get_mask_sizes(self, *args, **kwargs):
        return DynamicLayer.get_mask_sizes(self, *args, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        DynamicLayer.reset(self)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        AttnStoreLayer.crop(self, tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        DynamicLayer.reorder_cache(self, beam_idx)


class AttnStoreSparseLayer(AttnStoreLayer):
    """A full-attention KV layer kept sparse (store slot `slot`): see sparse.py for what it keeps and its masks.

    Attributes:
        total: The session's tokens so far (what `get_seq_length` reports).
        columns: ``[kv_heads, K]`` session positions of the K keys the layer holds (per head).
        host: With ``history_on_host``: the layer's history in host memory (host_history.py). `keys`/`values` are
            then what the device holds; a forward of several tokens gets the whole history, a decoding step those.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from hf_attnstore import AttnStore, AttnStoreCache
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
        >>> store = AttnStore(host_bytes="1MiB")
        >>> cache = AttnStoreCache(model, store, "alice", torch.tensor([[1, 5, 9]]), kv_budget=0.5)
        >>> [type(layer).__name__ for layer in cache.layers]
        ['AttnStoreSparseLayer', 'AttnStoreSparseLayer']
    """

    # A selection cannot be put back as it was before a forward (`crop` refuses): transformers then never relies on it.
    is_croppable = False

    def __init__(self, owner: LayerOwner, slot: int, reused: int, config: SparseConfig,
                 host: HostHistory | None = None):
        AttnStoreLayer.__init__(self, owner, slot, reused)
        self.config, self.host = config, host
        self.total = reused
        self.columns: torch.Tensor | None = None
        # The reused tokens that have KV, per head (`present`): a session loaded from sparse cold copies. None: all.
        self._present: torch.Tensor | None = None

    def present(self, columns: torch.Tensor) -> None:
        """Starts from the reused tokens at session positions `columns` (``[kv_heads, P]``) alone: the others have
        no KV (a sparse cold copy, store/sparse_copies.py), so no forward may attend to them."""
        self._present = columns

    def get_seq_length(self) -> int:
        return self.total

    def _held(self) -> int:
        if self.is_initialized:
            return self.host.total if self.host is not None else self.keys.shape[-2]
        return self._pending_reuse if self._present is None else self._present.shape[1]

    def _target(self) -> int:
        """How many of the held tokens the next forward keeps (the same in every sparse layer of the cache)."""
        held = self._held()
        if self.config.query_aware:
            return held  # every token stays; each query selects inside the attention (query_aware.py)
        if not self._owner.can_select(self.total):
            return held  # no scores yet (a session resumed without them: its first forward is dense), or mid-prompt
        return min(held, self.config.budget(self.total))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept = self._target()
        return kept + query_length, self.total - kept

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            return AttnStoreLayer.update(self, key_states, value_states)  # raises the batch-size error
        keep = self._target()
        n = key_states.shape[-2]
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            held = self._pending_reuse
            keys, values = self._with_reused(held, key_states, value_states)
            old_keys, old_values = keys[:, :, :held], values[:, :, :held]
            columns = torch.arange(held, device=key_states.device).expand(key_states.shape[1], -1)
            if self._present is not None:  # only the tokens with KV (the load holds zeros for the others)
                columns = self._present.to(key_states.device)
                index = columns[None, :, :, None]
                old_keys = old_keys.gather(2, index.expand(-1, -1, -1, old_keys.shape[-1]))
                old_values = old_values.gather(2, index.expand(-1, -1, -1, old_values.shape[-1]))
            self.is_initialized = True
            if self.host is not None:
                return self._update_host(key_states, value_states, old_keys, old_values, columns)
        elif self.host is not None:
            return self._update_host(key_states, value_states, None, None, self.columns)
        else:
            old_keys, old_values, columns = self.keys, self.values, self.columns
        old_keys, old_values, columns = self._selected(old_keys, old_values, columns, keep)
        held = columns.shape[1]
        if held < self.total or (self.config.query_aware and self.config.budget(held) < held):
            # The new tokens attend to a selection (query-aware: the one their attention will make, of the same
            # budget of `held`): their KV is not the dense one.
            self._recorder.attended_sparse(self.total)
        new = torch.arange(self.total, self.total + n, device=key_states.device).expand(columns.shape[0], -1)
        self.columns = torch.cat([columns, new], dim=1)
        self.keys = torch.cat([old_keys, key_states], dim=-2)
        self.values = torch.cat([old_values, value_states], dim=-2)
        self.total += n
        self._recorder.record(self._layer_idx, key_states, value_states)
        return self.keys, self.values

    def _update_host(self, key_states: torch.Tensor, value_states: torch.Tensor, old_keys: torch.Tensor | None,
                     old_values: torch.Tensor | None, columns: torch.Tensor):
        """`update` with the history on the host: the first forward hands the loaded history there, every forward
        its new tokens; the device keeps the sinks and what the forward's recent window reads on."""
        # The history rows this forward's queries select from (fewer than `total` for a session loaded from sparse
        # cold copies: `present`).
        n, history = key_states.shape[-2], self.host.total if old_keys is None else old_keys.shape[-2]
        if history < self.total or self.config.budget(history) < history:
            self._recorder.attended_sparse(self.total)  # the new tokens attend to a selection: their KV is not dense
        # The device drops (or gets back) rows before this forward's recent window, then takes its new tokens.
        self.host.keep_from(query_aware.recent_start(self.config, history))
        whole = None
        if old_keys is not None:  # the turn's first forward: the loaded history and the new tokens, whole
            whole = (torch.cat([old_keys, key_states], dim=-2), torch.cat([old_values, value_states], dim=-2))
            self.host.append(*whole)
        else:
            self.host.append(key_states, value_states)
        new = torch.arange(self.total, self.total + n, device=columns.device).expand(columns.shape[0], -1)
        self.columns = torch.cat([columns, new], dim=1)
        self.total += n
        self.keys, self.values = self.host.resident()
        self._recorder.record(self._layer_idx, key_states, value_states)
        if n == 1:
            return self.keys, self.values  # a decoding step gathers the rest from the host (query_aware.attention)
        return whole if whole is not None else self.host.whole(self.keys, self.values)

    def _selected(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, keep: int):
        """The `keep` of the held tokens the layer keeps (sparse.select), as (keys, values, columns)."""
        if keep >= keys.shape[-2]:
            return keys, values, columns
        scores = self._owner.scores_for(self._layer_idx, columns) if self.config.scored else None
        picked = select(columns, scores, keep, self.config)
        index = picked[None, :, :, None]
        return (keys.gather(2, index.expand(-1, -1, -1, keys.shape[-1])),
                values.gather(2, index.expand(-1, -1, -1, values.shape[-1])), columns.gather(1, picked))

    def select_now(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Drops now the tokens the next forward would drop, and returns the kept KV ``[1, kv_heads, kept, d]``:
        what a batch takes as this session's row (batching.py), the selection the turn's next forward makes."""
        assert self.host is None, "a batch row's history is on the device (batching refuses the query-aware policies)"
        self.keys, self.values, self.columns = self._selected(self.keys, self.values, self.columns, self._target())
        if self.columns.shape[1] < self.total:
            self._recorder.attended_sparse(self.total)
        return self.keys, self.values

    @property
    def held_slot(self) -> int:
        """The layer's KV slot in the store."""
        return self._layer_idx

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a cache with `kv_budget` cannot be cropped (assisted decoding): use a dense cache")


def build_layers(owner: LayerOwner, layout: LayerLayout, reused: int, state: SessionState | None,
                 device: torch.device, sparse=None, loader=None, recorder=None) -> list:
    """The cache's layers for a turn that reuses `reused` tokens (and, for a hybrid model, `state`: the states
    after exactly those tokens); with `sparse` (a SparseConfig), its full-attention layers are kept sparse. Each
    layer loads its reused KV from `loader` (None when nothing is reused) and records its new KV to `recorder`.

    Example:
        >>> layout = LayerLayout(kinds=("kv", "state", "none"), states=(0, 1, 0))
        >>> owner = type("Turn", (), {})()  # what the layers load from and record to: the cache's CacheTurn
        >>> layers = build_layers(owner, layout, reused=0, state=None, device=torch.device("cpu"))
        >>> [type(layer).__name__ for layer in layers]
        ['AttnStoreLayer', 'LinearAttentionLayer', 'DummyLayer']
    """
    layers, slot, buffers = [], 0, None
    # The layers kept sparse, in order: each gets its own budget of `sparse.layer_slope`'s schedule over them.
    kept_sparse = [idx for idx, kind in enumerate(layout.kinds) if sparse is not None and kind == KV
                   and not (layout.windows and layout.windows[idx]) and layout.full[idx]]
    for idx, (kind, n_states) in enumerate(zip(layout.kinds, layout.states)):
        if kind == KV and layout.windows and layout.windows[idx]:
            layers.append(AttnStoreSlidingLayer(owner, slot, reused, layout.latent, layout.windows[idx]))
        elif idx in kept_sparse:
            host = None
            if sparse.history_on_host:
                buffers = buffers or GatherBuffers()  # one per turn: its layers run one after the other
                host = HostHistory(sparse.sink_tokens, sparse.policy == "sparq", buffers)
            config = sparse.at_layer(kept_sparse.index(idx), len(kept_sparse))
            layers.append(AttnStoreSparseLayer(owner, slot, reused, config, host))
        elif kind == KV:
            layers.append(AttnStoreLayer(owner, slot, reused, layout.latent))
        elif kind == BOTH:
            layers.append(AttnStoreHybridLayer(owner, slot, reused, n_states))
        elif kind == STATE:
            layers.append(LinearAttentionLayer(number_of_states=n_states))
        else:
            layers.append(DummyLayer())
        if isinstance(layers[-1], AttnStoreLayer):  # weak, as the owner: the recorder's turn end holds the layers
            layers[-1]._loader = weakref.proxy(loader) if loader is not None else None
            layers[-1]._recorder = weakref.proxy(recorder) if recorder is not None else None
        slot += kind in (KV, BOTH)
        if state is not None and kind in (STATE, BOTH):
            _restore(layers[-1], idx, state, device)
    return layers


def _restore(layer: LinearAttentionCacheLayerMixin, idx: int, state: SessionState, device: torch.device) -> None:
    """Puts layer `idx`'s stored states into `layer`, as if it had computed them (`has_previous_state`)."""
    for i in range(layer.number_of_states):
        conv, rec = state.tensors.get(f"L{idx:04d}.c{i}"), state.tensors.get(f"L{idx:04d}.r{i}")
        if conv is not None:
            conv = conv.to(device)
            layer.lazy_initialization(conv_states=conv, state_idx=i, conv_kernel_size=conv.shape[-1])
            layer.conv_states[i].copy_(conv)
        if rec is not None:
            rec = rec.to(device)
            layer.lazy_initialization(recurrent_states=rec, state_idx=i)
            layer.recurrent_states[i].copy_(rec)
        layer.has_previous_state[i] = conv is not None or rec is not None
    set_linear_length(layer, state.tokens)  # 5.25+: the layer's own token count, which models place by


def state_tensors(layers: list) -> dict[str, torch.Tensor] | None:
    """The conv and recurrent states of every linear-attention layer (views: copy before the model runs
    again), or None if some layer has none yet.

    Example:
        >>> layout = LayerLayout(kinds=("kv", "state"), states=(0, 1))
        >>> owner = type("Turn", (), {})()  # what the layers load from and record to: the cache's CacheTurn
        >>> layers = build_layers(owner, layout, reused=0, state=None, device=torch.device("cpu"))
        >>> state_tensors(layers) is None, state_tensors(layers[:1])  # the linear layer has computed nothing yet
        (True, {})
    """
    out = {}
    for idx, layer in enumerate(layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        for i in range(layer.number_of_states):
            if not layer.has_previous_state[i]:
                return None
            if layer.is_conv_states_initialized[i]:
                out[f"L{idx:04d}.c{i}"] = layer.conv_states[i]
            if layer.is_recurrent_states_initialized[i]:
                out[f"L{idx:04d}.r{i}"] = layer.recurrent_states[i]
    return out
