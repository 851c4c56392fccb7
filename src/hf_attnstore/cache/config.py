"""The cache side's typed configuration: how a session that overflows the context window is truncated, and
how a session is kept sparse (sparse window attention)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

TRUNCATION_MODES = ("decoupled", "importance", "recompute", "naive")


@dataclass(frozen=True)
class TruncationConfig:
    """How a session that overflows the context window is truncated.

    Args:
        context_window: Maximum number of tokens the model may see. ``None`` disables truncation.
        truncation_ratio: Fraction of the window (after the sink tokens) dropped at each overflow; at least as
            many tokens as needed to fit are dropped.
        keep_first: Number of leading tokens always kept (attention sinks, usually the system prompt start).
        mode: ``"decoupled"`` (re-rotate the kept pre-RoPE keys, AttentionStore), ``"importance"`` (as
            decoupled, but the least important tokens are dropped rather than the oldest: ALISA's selection, by
            the importance scores kept with the session; sinks and the last `keep_recent` reusable tokens stay),
            ``"recompute"`` (token truncation: kept tokens are recomputed) or ``"naive"`` (kept keys keep their
            stale positions; an evaluation baseline only).
        keep_recent: ``"importance"`` only: the most recent stored tokens never dropped (the local context).

    Example:
        >>> config = TruncationConfig(context_window=2048, truncation_ratio=0.5, keep_first=4)
        >>> config.mode
        'decoupled'
    """

    context_window: int | None = None
    truncation_ratio: float = 0.5
    keep_first: int = 4
    mode: str = "decoupled"
    keep_recent: int = 64

    def __post_init__(self):
        if self.mode not in TRUNCATION_MODES:
            raise ValueError(f"`truncation`={self.mode!r} is unknown; choose one of {', '.join(TRUNCATION_MODES)}")
        if not 0.0 < float(self.truncation_ratio) <= 1.0:
            raise ValueError(f"`truncation_ratio` must be in (0, 1], got {self.truncation_ratio!r}")
        if not isinstance(self.keep_recent, int) or isinstance(self.keep_recent, bool) or self.keep_recent < 0:
            raise ValueError(f"`keep_recent` must be a non-negative integer, got {self.keep_recent!r}")
        if not isinstance(self.keep_first, int) or self.keep_first < 0:
            raise ValueError(f"`keep_first` must be a non-negative integer, got {self.keep_first!r}")
        if self.context_window is not None:
            if not isinstance(self.context_window, int) or self.context_window < 2:
                raise ValueError(f"`context_window` must be an integer >= 2 or None, got {self.context_window!r}")
            if self.keep_first >= self.context_window:
                raise ValueError(
                    f"`keep_first` ({self.keep_first}) must be smaller than `context_window` "
                    f"({self.context_window}): the kept sink tokens alone would fill the window"
                )


#: The keywords `AttnStoreCache` and `ChatPipeline` took before they moved into `TruncationConfig`.
LEGACY_TRUNCATION = ("truncation_ratio", "keep_first")


def truncation_of(context_window: int | None, truncation: str | TruncationConfig, legacy: dict, owner: str,
                  stacklevel: int = 3) -> TruncationConfig:
    """The TruncationConfig of `owner`'s everyday `context_window` and `truncation` (a mode or a whole config).

    `legacy` holds ``truncation_ratio`` and ``keep_first`` if the caller passed them as keywords of their own (the
    pre-TruncationConfig way): they still work for one release, with a ``FutureWarning``.

    Raises:
        TypeError: An unknown keyword, or a `TruncationConfig` together with separate options.

    Example:
        >>> truncation_of(2048, "recompute", {}, "AttnStoreCache")
        TruncationConfig(context_window=2048, truncation_ratio=0.5, keep_first=4, mode='recompute', keep_recent=64)
    """
    unknown = sorted(set(legacy) - set(LEGACY_TRUNCATION))
    if unknown:
        raise TypeError(f"{owner} got unexpected keyword argument(s) {', '.join(f'`{n}`' for n in unknown)}")
    if isinstance(truncation, TruncationConfig):  # a caller's validated settings, taken as they are
        if context_window is not None or legacy:
            raise TypeError("pass either a `TruncationConfig` as `truncation` or the separate options")
        return truncation
    if legacy:
        names = sorted(legacy)
        warnings.warn(f"passing {', '.join(f'`{n}`' for n in names)} to {owner} directly is deprecated and will be "
                      f"removed in the next release: use `truncation=TruncationConfig(context_window, "
                      f"{', '.join(f'{n}=...' for n in names)}, mode=...)`", FutureWarning, stacklevel=stacklevel)
    return TruncationConfig(context_window, mode=truncation, **legacy)


SPARSE_POLICIES = ("alisa", "h2o", "streaming", "quest", "sparq", "oracle")
#: The policies that keep every token and choose per query, inside the attention (query_aware.py).
QUERY_AWARE_POLICIES = ("quest", "sparq", "oracle")
#: The policies whose history can stay in host memory (`SparseConfig.history_on_host`): a step reads a selection.
HOST_HISTORY_POLICIES = ("quest", "sparq")


@dataclass(frozen=True)
class SparseConfig:
    """Sparse attention over a session: with the window policies (ALISA, H2O, StreamingLLM) the device keeps sinks,
    a recent window and the most important of the other tokens, and new tokens attend to those alone; with the
    query-aware ones (Quest, SparQ, the oracle) the layers keep every token and each query attends to a budget of them
    it chooses. The store still keeps every token.

    Args:
        kv_budget: Tokens kept of the history before each forward: a fraction in (0, 1] of the session's length
            (``0.2`` is 80% sparsity), or a token count (an int >= 1). At least `sink_tokens` + 1 are kept.
        sink_tokens: Leading tokens always kept (StreamingLLM's attention sinks).
        recent_ratio: Share of the budget (after the sinks) given to the most recent tokens; the rest goes to
            the most important ones. Ignored by ``"streaming"``, whose budget is all recent. Default (None): 0.5 for
            the window policies (H2O's split), 0.1 for the query-aware ones, whose queries choose the rest.
        policy: ``"alisa"`` (importance = attention received from the last `score_window` queries, ALISA's
            sparse window attention), ``"h2o"`` (attention received from every query so far, H2O's heavy
            hitters), ``"streaming"`` (sinks and recent tokens only, StreamingLLM), ``"quest"`` (query-aware:
            the layer keeps every token and each query attends to the sinks, a recent window and the pages whose
            key bounds promise it the most, Quest; query_aware.py), ``"sparq"`` (query-aware, per token: each
            query scores every token from `sketch_dims` of the keys' components, those where it is largest, and
            attends to the sinks, a recent window and the tokens of the highest scores, SparQ) or ``"oracle"`` (each query head attends to its
            top `kv_budget` keys by its true attention logits: the bound of every selection, an evaluation that
            computes dense attention first and saves nothing).
        score_window: How many recent queries the ``"alisa"`` importance sums over.
        page_tokens: ``"quest"``: tokens per page, the unit a query selects (each page keeps a min and a max key).
        sketch_dims: ``"sparq"``: key components each query reads to score the tokens (of the head dimension).
        history_on_host: ``"quest"`` and ``"sparq"`` only: keep the session's history in host memory (pinned when
            the layers run on CUDA) and on the device only what the selection reads every step, moving each decoding
            step's selected tokens from the host (cache/host_history.py). On the device stay the sinks, the recent
            window and the current turn's tokens, and what chooses: Quest's page summaries; for SparQ all the keys
            (its sketch reads any `sketch_dims` of their components), so only the values move.
        layer_slope: The query-aware policies only: how the budget is spread over the sparse layers, in (-1, 1).
            ``0`` (default): every layer keeps ``budget(history)``. ``a > 0``: PyramidKV's pyramid, layer i of n keeps
            the budget times ``1 + a·(1 - 2i/(n - 1))``, from ``1 + a`` at the first layer down to ``1 - a`` at the
            last (``a < 0``: the other way), the same total over the layers (see :meth:`budget`).
        layer: Set by the cache, not by hand: this layer's (position among the sparse layers, their count), which
            :meth:`budget` reads with `layer_slope` (:meth:`at_layer`). None: the budget of every layer alike.

    Example:
        >>> SparseConfig(kv_budget=0.2).budget(1000)  # 80% sparsity
        200
        >>> SparseConfig(kv_budget=64).budget(1000), SparseConfig(kv_budget=64).budget(40)
        (64, 40)
    """

    kv_budget: float | int
    sink_tokens: int = 4
    recent_ratio: float | None = None
    policy: str = "alisa"
    score_window: int = 32
    page_tokens: int = 16
    sketch_dims: int = 16
    history_on_host: bool = False
    layer_slope: float = 0.0
    layer: tuple[int, int] | None = None

    def __post_init__(self):
        budget = self.kv_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise ValueError(f"`kv_budget` must be a fraction in (0, 1] or a token count, got {budget!r}")
        if isinstance(budget, float) and not 0.0 < budget <= 1.0:
            raise ValueError(f"`kv_budget` as a fraction must be in (0, 1], got {budget!r}; pass an int for a "
                             "token count")
        if isinstance(budget, int) and budget < 1:
            raise ValueError(f"`kv_budget` as a token count must be >= 1, got {budget!r}")
        if self.policy not in SPARSE_POLICIES:
            raise ValueError(f"`policy`={self.policy!r} is unknown; choose one of {', '.join(SPARSE_POLICIES)}")
        if not isinstance(self.sink_tokens, int) or isinstance(self.sink_tokens, bool) or self.sink_tokens < 0:
            raise ValueError(f"`sink_tokens` must be a non-negative integer, got {self.sink_tokens!r}")
        if self.recent_ratio is not None and (isinstance(self.recent_ratio, bool)
                                              or not isinstance(self.recent_ratio, (int, float))
                                              or not 0.0 <= self.recent_ratio <= 1.0):
            raise ValueError(f"`recent_ratio` must be in [0, 1], got {self.recent_ratio!r}")
        if not isinstance(self.score_window, int) or isinstance(self.score_window, bool) or self.score_window < 1:
            raise ValueError(f"`score_window` must be an integer >= 1, got {self.score_window!r}")
        if not isinstance(self.sketch_dims, int) or isinstance(self.sketch_dims, bool) or self.sketch_dims < 1:
            raise ValueError(f"`sketch_dims` must be an integer >= 1, got {self.sketch_dims!r}")
        if not isinstance(self.page_tokens, int) or isinstance(self.page_tokens, bool) or self.page_tokens < 1:
            raise ValueError(f"`page_tokens` must be an integer >= 1, got {self.page_tokens!r}")
        if not isinstance(self.history_on_host, bool):
            raise ValueError(f"`history_on_host` must be True or False, got {self.history_on_host!r}")
        if self.history_on_host and self.policy not in HOST_HISTORY_POLICIES:
            raise ValueError(f"`history_on_host` needs a policy that reads a selection of the history per step: use "
                             f"policy='quest' or 'sparq' (got {self.policy!r}: the window policies already keep only "
                             "their selection on the device, the oracle reads every key)")
        slope = self.layer_slope
        if isinstance(slope, bool) or not isinstance(slope, (int, float)) or not -1.0 < slope < 1.0:
            raise ValueError(f"`layer_slope` must be a number in (-1, 1) (0: the same budget in every layer), got "
                             f"{slope!r}")
        if slope != 0 and not self.query_aware:
            raise ValueError(f"`layer_slope` needs a query-aware policy, 'quest', 'sparq' or 'oracle' (got "
                             f"{self.policy!r}): a window policy's layers share one attention mask, so every layer "
                             "keeps the same count; use layer_slope=0")
        if self.layer is not None and not (isinstance(self.layer, tuple) and len(self.layer) == 2
                                           and all(isinstance(v, int) and not isinstance(v, bool) for v in self.layer)
                                           and 0 <= self.layer[0] < self.layer[1]):
            raise ValueError(f"`layer` must be (index, count) with 0 <= index < count, or None, got {self.layer!r}; "
                             "the cache sets it (`at_layer`), leave it None")

    @property
    def scored(self) -> bool:
        """Whether the policy ranks tokens by importance scores kept with the session (``"alisa"``, ``"h2o"``)."""
        return self.policy in ("alisa", "h2o")

    @property
    def query_aware(self) -> bool:
        """Whether the policy keeps every token and selects per query (``"quest"``, ``"sparq"``, ``"oracle"``).

        Example:
            >>> SparseConfig(0.2, policy="quest").query_aware, SparseConfig(0.2).query_aware
            (True, False)
        """
        return self.policy in QUERY_AWARE_POLICIES

    def budget(self, length: int) -> int:
        """How many of a history of `length` tokens are kept (by this layer, for a config :meth:`at_layer`).

        With a `layer_slope`, layer i of n keeps its share of the n layers' uniform total ``n·u`` (``u``: the budget
        of every layer alike), rounded so that the shares add up exactly: layer i keeps ``round(u·W(i+1)) -
        round(u·W(i))``, where ``W(i) = i + a·i·(n - i)/(n - 1)`` is the weight of the layers before it (``W(n) =
        n``). Then each share is held within ``[sink_tokens + 1, length]``; only that clamp, on short histories,
        makes the total differ from ``n·u``.

        Example:
            >>> SparseConfig(kv_budget=0.25).budget(100)
            25
            >>> SparseConfig(kv_budget=0.25, sink_tokens=4).budget(8)  # always more than the sinks
            5
            >>> pyramid = SparseConfig(0.2, policy="sparq", layer_slope=0.5)
            >>> [pyramid.at_layer(i, 4).budget(1000) for i in range(4)]  # 200 each, uniform: 800 in all
            [300, 233, 167, 100]
        """
        if isinstance(self.kv_budget, float):
            keep = math.ceil(self.kv_budget * length)
        else:
            keep = self.kv_budget
        keep = min(length, max(keep, self.sink_tokens + 1))
        if self.layer is None or self.layer_slope == 0:
            return keep
        index, count = self.layer
        if count == 1:
            return keep

        def before(i: int) -> int:  # the budget of layers 0 .. i - 1, rounded half up
            return math.floor(keep * (i + self.layer_slope * i * (count - i) / (count - 1)) + 0.5)

        return min(length, max(before(index + 1) - before(index), self.sink_tokens + 1))

    def at_layer(self, index: int, count: int) -> "SparseConfig":
        """This config for sparse layer `index` of `count`: its :meth:`budget` is that layer's share.

        Example:
            >>> SparseConfig(0.2, policy="oracle", layer_slope=0.5).at_layer(0, 30).budget(1000)
            300
        """
        return dataclasses.replace(self, layer=(index, count))

    def split(self, keep: int, length: int) -> tuple[int, int]:
        """Of `keep` kept tokens out of `length`: how many sinks and how many recent ones (the rest: important).

        Example:
            >>> config = SparseConfig(kv_budget=0.2, sink_tokens=4, recent_ratio=0.5)
            >>> config.split(keep=200, length=1000)  # 4 sinks, 98 recent tokens; the other 98 chosen by importance
            (4, 98)
        """
        sinks = min(self.sink_tokens, keep)
        rest = keep - sinks
        share = self.recent_ratio if self.recent_ratio is not None else 0.1 if self.query_aware else 0.5
        recent = rest if self.policy == "streaming" else math.ceil(share * rest)
        return sinks, min(recent, length - sinks)
