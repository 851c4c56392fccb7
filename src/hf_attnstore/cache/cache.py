"""AttnStoreCache: a `transformers` cache that resumes a chat session from stored pre-RoPE KV.

As transformers' own caches, it is a thin `Cache` over per-layer objects (layers.py); the turn's work (the
reuse plan, loading and re-rotating reused KV, saving what the model computes) is its `CacheTurn` (turn.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..store import AttnStore, validate_session_id
from .config import SparseConfig, TruncationConfig, truncation_of
from .fingerprint import model_fingerprint, salted_fingerprint
from .hooks import install_generation_hook, install_hooks
from .rope import RopeAdapter
from .layout import LayerLayout
from .turn import CacheTurn, check_scored, head_prefill_key, regime_keys
from .upstream import Cache, DynamicCache, seq_length


def _as_prompt_ids(input_ids) -> torch.Tensor:
    """Normalizes a prompt to a 1-D int64 CPU tensor; refuses batches and padding."""
    mask = None
    if isinstance(input_ids, Mapping):
        mask = input_ids.get("attention_mask")
        input_ids = input_ids["input_ids"]
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids.detach()
    elif isinstance(input_ids, Sequence) and not isinstance(input_ids, (str, bytes)):
        try:
            ids = torch.tensor(list(input_ids))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"`input_ids` must be a tensor or a list of token ids: {exc}") from None
    else:
        raise TypeError(f"`input_ids` must be a tensor or a list of token ids, got {type(input_ids).__name__}")
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(
                f"AttnStoreCache holds one session, so `input_ids` must have batch size 1, got {ids.shape[0]}; "
                "create one cache per session"
            )
        ids = ids[0]
    if ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(f"`input_ids` must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(f"`input_ids` must be a non-empty [1, seq] or [seq] tensor of ids, got {tuple(ids.shape)}")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("padded prompts are not supported: pass the ids of one session without padding")
    return ids.to("cpu", torch.long)


def _from_turn(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.turn, name), doc=doc)


class AttnStoreCache(DynamicCache):
    """A cache that reuses a chat session's stored KV and saves everything the model computes through it.

    Keys are stored before RoPE. On load, each layer's keys are rotated for their (possibly new) positions
    with the model's own rotary module, so a context that overflowed can be truncated without recomputing.
    Only the longest common prefix of `input_ids` and the stored token ids is reused, and at least one token
    is always left to compute: a history that does not match costs recomputation, never wrong output.

    Args:
        model: The causal LM the cache is used with (its fingerprint keys the stored entries).
        store: Where sessions' KV lives between turns.
        session_id: Any non-empty string naming the conversation.
        input_ids: The full prompt of this turn (history + new message), ``[1, seq]`` or a list of ids.
        context_window: Maximum tokens the model may see; ``None`` disables truncation.
        truncation: ``"decoupled"`` (default), ``"importance"`` (drop the least important tokens rather than the
            oldest), ``"recompute"`` or ``"naive"`` (evaluation baseline only), or a whole
            :class:`TruncationConfig` (with `context_window` in it, and its `truncation_ratio`, `keep_first` and
            `keep_recent`; then leave `context_window` unset). ``truncation_ratio=`` and ``keep_first=`` as
            keywords of their own still work for one release, with a ``FutureWarning``.
        save: If ``False`` the cache only reads: the turn reuses the stored KV but the store is left exactly
            as it was (for scoring, evaluation, or branching several continuations off one history).
        cache_salt: KV is stored under, and reused from, this salt only (vLLM's ``cache_salt``): requests with
            different salts, or one with and one without, never share KV, and so never learn of each other's
            prompts through timing. ``None`` (default): the unsalted space. At most 1 KiB.
        kv_budget: Sparse window attention (ALISA): the history kept on the device, and attended to, before each
            forward: a fraction of the session's length (``0.2``: 80% sparsity) or a token count, or a whole
            :class:`SparseConfig` (policy, sinks, recent share). ``None`` (default): dense. The store still
            keeps every token; the tokens' importance scores are kept with the session. Tokens computed
            attending to a selection are stored labelled inexact: a later sparse turn reuses them, a dense turn
            reuses the tokens before them and recomputes the rest (its reuse stays exact). Needs SDPA or eager
            attention (``"streaming"``: any; the query-aware ``"quest"``, ``"sparq"`` and ``"oracle"``: SDPA, and
            their layers keep every token, each query choosing what it attends to, cache/query_aware.py; with
            ``SparseConfig(history_on_host=True)`` Quest's and SparQ's keep it in host memory, and each decoding
            step moves only what it chose to the device, cache/host_history.py), full-attention layers, and neither chunked nor latent attention nor recurrent layers (cache/sparse.py).

    With ``StoreConfig.share_prefixes`` (the default), a turn whose prompt begins with a longer stored prefix
    in another session than in its own (a shared system prompt, a regenerated or edited message, a branch)
    starts from that session's KV, exactly (ids compared), and `shared_from` names it.

    Attributes:
        input_ids: The ids to pass to ``generate``/``forward`` (truncated if the context overflowed).
        reused_tokens: How many of them come from the store; the rest is prefilled.
        dropped_tokens: How many tokens truncation removed.

    Example (a tiny random model; any causal LM of transformers works alike):
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from hf_attnstore import cache_kwargs
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
        >>> store = AttnStore(host_bytes="1GiB")
        >>> ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
        >>> cache = AttnStoreCache(model, store, session_id="alice", input_ids=ids)
        >>> out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, do_sample=False,
        ...                      min_new_tokens=4)  # a random model may say EOS early: always 4 tokens here
        >>> next_turn = torch.cat([out, torch.tensor([[4, 8]])], dim=1)  # the reply, then the user's next message
        >>> AttnStoreCache(model, store, "alice", input_ids=next_turn).reused_tokens  # all but the last reply token
        9
    """

    _brackets_forwards = True  # tells hooks.py to bracket forwards through this cache (no import cycle)

    def __init__(
        self,
        model: nn.Module,
        store: AttnStore,
        session_id: str,
        input_ids,
        *,
        context_window: int | None = None,
        truncation: str | TruncationConfig = "decoupled",
        save: bool = True,
        cache_salt: str | None = None,
        kv_budget: float | int | SparseConfig | None = None,
        **legacy,
    ):
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"`model` must be a transformers model, got {type(model).__name__}")
        if not isinstance(store, AttnStore):
            raise TypeError(f"`store` must be an AttnStore, got {type(store).__name__}")
        # `truncation_ratio` and `keep_first` as keywords of their own: one more release, with a FutureWarning.
        self.truncation = truncation_of(context_window, truncation, legacy, "AttnStoreCache")
        self.session_id = validate_session_id(session_id)
        if kv_budget is not None and not isinstance(kv_budget, SparseConfig):
            kv_budget = SparseConfig(kv_budget)
        self.sparse = kv_budget
        prompt = _as_prompt_ids(input_ids)
        self.turn = CacheTurn(self, model, store, self.session_id, prompt, self.truncation, save, cache_salt, kv_budget)
        # Cache.__init__ directly: DynamicCache's would set up lazily-created DynamicLayers instead of ours.
        Cache.__init__(self, layers=self.turn.layers)
        if self.turn.turn_end.has_state and self.turn.turn_end.writer is not None:
            weakref.finalize(self, self.turn.turn_end)  # a hybrid's states are kept also when the cache is dropped
        install_hooks(model)
        install_generation_hook(model)

    # What the turn planned and did (read-only here; see CacheTurn).
    input_ids = _from_turn("input_ids", "The ids to pass to `generate`/`forward` (truncated on overflow).")
    reused_tokens = _from_turn("reused_tokens", "How many of `input_ids` come from the store.")
    dropped_tokens = _from_turn("dropped_tokens", "How many tokens truncation removed.")
    kv_source = _from_turn("kv_source", "Where the reused KV came from: host, disk, remote, or miss.")
    recomputed = _from_turn("recomputed", "Whether stored KV proved unreadable mid-forward and was recomputed.")
    recomputed_head = _from_turn("recomputed_head", "Leading tokens recomputed instead of loaded: a partially evicted "
                                 "head, or chunks cheaper to recompute (`recompute_by_cost`).")
    reused_recomputed = _from_turn("reused_recomputed", "Of `reused_tokens`, those whose KV was recomputed this turn "
                                   "(a head) rather than loaded: usage reports them as computed.")
    shared_from = _from_turn("shared_from", "The other session whose stored prefix this turn reuses (None: its own).")
    plan = _from_turn("plan", "The reuse plan (truncation.ReusePlan).")
    regime = _from_turn("regime", "The RoPE frequency regime of the turn (\"\" for static RoPE).")
    fingerprint = _from_turn("fingerprint", "The key of this model's KV in the store (regime included).")
    saved_tokens = _from_turn("saved_tokens", "Tokens this turn handed to the store.")
    save_seconds = _from_turn("save_seconds", "Seconds this turn spent un-rotating keys and handing KV to the store.")
    token_ids = _from_turn("token_ids", "The ids the cache's KV covers so far.")

    @staticmethod
    def fingerprint_of(model: nn.Module, store: AttnStore | None = None, cache_salt: str | None = None) -> str:
        """The fingerprint under which this model's sessions are stored (in `store`'s namespace, if given, and
        under `cache_salt`); see :meth:`fingerprints_of` for length-dependent RoPE.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
            >>> a, b = AttnStore(namespace="tenant-a"), AttnStore(namespace="tenant-b")
            >>> AttnStoreCache.fingerprint_of(model, a) != AttnStoreCache.fingerprint_of(model, b)
            True
        """
        return salted_fingerprint(model_fingerprint(model, store.config.namespace if store is not None else None),
                                  cache_salt)

    @staticmethod
    def prefill_key_of(model: nn.Module, store: AttnStore) -> str | None:
        """What a scheduler passes to ``store.prefetch(..., prefill_key=...)`` for a turn of `model` about to run,
        so that the load is decided by cost as the turn's own lookup would be (`recompute_by_cost`): the key the
        turn reports its prefills under, or None for models whose head cannot be recomputed alone (hybrids,
        length-dependent RoPE).

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
            >>> store = AttnStore()
            >>> AttnStoreCache.prefill_key_of(model, store) == AttnStoreCache.fingerprint_of(model, store)
            True
        """
        return head_prefill_key(model_fingerprint(model, store.config.namespace), LayerLayout.of(model),
                                RopeAdapter(model))

    @staticmethod
    def sparse_config(model: nn.Module, kv_budget: float | int | SparseConfig | None,
                      truncation: str = "decoupled") -> SparseConfig | None:
        """Checks, before any turn, that caches of `model` can have this `kv_budget` (and `truncation`), as each
        cache would: a server refuses at start what every request would fail on. Returns the SparseConfig (None:
        dense).

        Raises:
            ValueError: A budget out of range, or a model that cannot be kept sparse (why is said).

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
            >>> AttnStoreCache.sparse_config(model, 0.2).budget(1000)
            200
        """
        if kv_budget is not None and not isinstance(kv_budget, SparseConfig):
            kv_budget = SparseConfig(kv_budget)
        scored = (kv_budget is not None and kv_budget.scored) or truncation == "importance"
        if kv_budget is not None or scored:
            check_scored(model, LayerLayout.of(model), RopeAdapter(model).model_type, kv_budget, scored)
        return kv_budget

    @staticmethod
    def fingerprints_of(model: nn.Module, store: AttnStore | None = None, cache_salt: str | None = None) -> list[str]:
        """Every key under which this model's sessions may be stored, the one of longer contexts first: one
        for most models; two for `longrope`, whose KV is keyed by its frequency regime (short, long).

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
            >>> AttnStoreCache.fingerprints_of(model) == [AttnStoreCache.fingerprint_of(model)]  # static RoPE: one key
            True
        """
        return regime_keys(AttnStoreCache.fingerprint_of(model, store, cache_salt), RopeAdapter(model))

    def batch_row(self):
        """What a batch that decodes this session after its prompt needs (serving/batching.py): ``(scorer, columns,
        slot_of)``, the turn's importance scorer (None when it does not score), the session positions of the keys
        each KV slot holds (``{slot: [kv_heads, K]}``, for a cache kept sparse; None when every layer holds every
        position in order), and which model layer is which slot among the full-attention ones.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
            >>> cache = AttnStoreCache(model, AttnStore(host_bytes="1MiB"), "alice", torch.tensor([[1, 5, 9]]))
            >>> cache.batch_row()  # dense: no scorer, every position in order; layers 0 and 1 are KV slots 0 and 1
            (None, None, {0: 0, 1: 1})
        """
        return self.turn.batch_row()

    def append_computed(self, token_ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                        values: list[torch.Tensor], sparse_from: int | None = None) -> None:
        """Stores KV the model computed for this session outside this cache (a batched decoding step over
        several sessions), exactly as a forward through the cache would store it: see `CacheTurn.append_computed`.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> from hf_attnstore import cache_kwargs
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
            >>> store = AttnStore(host_bytes="1MiB")
            >>> cache = AttnStoreCache(model, store, "alice", input_ids=torch.tensor([[1, 5, 9]]))
            >>> _ = model(cache.input_ids, **cache_kwargs(cache))  # the prompt, through the cache
            >>> kv = [torch.zeros(1, 2, 1, 8) for _ in range(2)]  # token 4 at position 3, decoded by a batch elsewhere
            >>> cache.append_computed(torch.tensor([4]), torch.tensor([3]), kv, kv)
            >>> store.token_ids("alice", cache.fingerprint).tolist()
            [1, 5, 9, 4]
        """
        self.turn.append_computed(token_ids, positions, keys, values, sparse_from)

    def close(self) -> None:
        """Ends the turn: the store may demote the session again. Later forwards through this cache are not
        saved. Called when the cache is garbage-collected; call it (or use ``with``) when keeping caches.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> from hf_attnstore import cache_kwargs
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
            >>> store = AttnStore(host_bytes="1MiB")
            >>> with AttnStoreCache(model, store, "alice", input_ids=torch.tensor([[1, 5, 9]])) as cache:
            ...     _ = model(cache.input_ids, **cache_kwargs(cache))
            >>> _ = model(torch.tensor([[2]]), **cache_kwargs(cache))  # after close: not saved
            >>> store.token_ids("alice", cache.fingerprint).tolist()
            [1, 5, 9]
        """
        self.turn.close()

    def __enter__(self) -> "AttnStoreCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens the cache holds, as an int (`upstream.seq_length`: from transformers 5.25 a linear-attention
        layer 0 reports its own counter, a tensor it adds to in place; on CUDA the int costs one sync per call,
        that is per forward)."""
        return seq_length(super().get_seq_length(layer_idx))

    # -- operations a single-session cache does not support -------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last tokens (assisted generation rejecting drafts; a negative count removes that many): from
        the layers, and from the session in the store (see cache/speculative.py).

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> from hf_attnstore import cache_kwargs
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
            >>> store = AttnStore(host_bytes="1MiB")
            >>> cache = AttnStoreCache(model, store, "alice", input_ids=torch.tensor([[1, 5, 9, 12, 7, 3]]))
            >>> _ = model(cache.input_ids, **cache_kwargs(cache))
            >>> cache.crop(-2)  # two drafted tokens rejected
            >>> cache.get_seq_length(), store.token_ids("alice", cache.fingerprint).tolist()
            (4, [1, 5, 9, 12])
        """
        super().crop(tokens_to_remove)
        self.turn.cropped(self.get_seq_length())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refuses to repeat the session (beam search, several return sequences): the cache holds one session.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
            >>> cache = AttnStoreCache(model, AttnStore(host_bytes="1MiB"), "alice", torch.tensor([[1, 5, 9]]))
            >>> cache.batch_repeat_interleave(1)  # one row: nothing to do
            >>> cache.batch_repeat_interleave(2)
            Traceback (most recent call last):
            ...
            ValueError: AttnStoreCache holds one session: use num_beams=1 and num_return_sequences=1
        """
        if repeats != 1:
            raise ValueError("AttnStoreCache holds one session: use num_beams=1 and num_return_sequences=1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refuses to select batch rows other than the one session it holds.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
            >>> cache = AttnStoreCache(model, AttnStore(host_bytes="1MiB"), "alice", torch.tensor([[1, 5, 9]]))
            >>> cache.batch_select_indices(torch.tensor([0]))  # its one row: nothing to do
            >>> cache.batch_select_indices(torch.tensor([0, 0]))
            Traceback (most recent call last):
            ...
            ValueError: AttnStoreCache holds one session and cannot select several batch rows
        """
        if indices.numel() != 1:
            raise ValueError("AttnStoreCache holds one session and cannot select several batch rows")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refuses beam search (``num_beams > 1``): the cache holds one session.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
            >>> cache = AttnStoreCache(model, AttnStore(host_bytes="1MiB"), "alice", torch.tensor([[1, 5, 9]]))
            >>> cache.reorder_cache(torch.tensor([0]))
            Traceback (most recent call last):
            ...
            ValueError: AttnStoreCache does not support beam search: use num_beams=1
        """
        raise ValueError("AttnStoreCache does not support beam search: use num_beams=1")
