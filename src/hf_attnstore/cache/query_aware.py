"""Query-aware sparse attention over the full stored KV (Quest), and the oracle that bounds every selection.

The window policies (sparse.py: ALISA, H2O, StreamingLLM) drop tokens before a forward, from scores of past
queries, so the current query cannot get back what it needs. The policies here keep every token of the session
where it is and choose, inside the attention, per current query:

- ``"quest"`` (Quest, ICML'24): the history after the `sink_tokens` is cut into pages of `page_tokens`. Each page
  has a summary, the elementwise min and max of its keys, from which ``sum_d max(q_d·min_d, q_d·max_d)`` is an upper
  bound of ``q·k`` over the page's keys. Each query keeps the sinks, a recent window and the pages of the highest
  bound, up to its budget, and attends exactly (softmax over the kept keys alone) to those. The bound is taken over
  the keys as attention sees them, rotated: the store keeps them pre-RoPE, but the loaded layer holds them rotated
  at their positions, and a bound over rotated keys is exact for the rotated query with no per-query rotation of
  the summaries. Pages are chosen per KV head (the query heads of a group add their softmax over page bounds), so
  a decoding step reads the same number of tokens from every head: ``sinks + recent + pages · page_tokens``.
- ``"oracle"``: each query head attends to the top `budget` history keys by its true attention logits. It computes
  the dense logits first, so it saves nothing: it is the evaluation bound no selection at that budget can beat.

Budget and masks, as for the window policies: a forward's queries select among the history before the forward
(``config.budget(history)`` of its ``history`` held tokens) and attend to the forward's own tokens causally and
in full. The layer holds all the tokens (layers.AttnStoreSparseLayer reports them all to the mask), so
transformers builds the dense causal mask; this function narrows it to the selection. Tokens computed this way
attended to a selection: their KV is labelled inexact like any sparse turn's (`CacheTurn.sparse_from`).

With ``history_on_host`` (quest, sparq) a layer keeps its history in host memory and hands a decoding step only what
the device holds (host_history.py); the step selects on the device as above and gathers the chosen tokens from the
host, in the order the device-resident history gives, so its attention is the same.

Example:
    >>> from hf_attnstore import SparseConfig
    >>> config = SparseConfig(8, sink_tokens=2, recent_ratio=0.0, policy="quest", page_tokens=2)
    >>> keys = torch.zeros(1, 1, 12, 2)
    >>> keys[0, 0, 6], keys[0, 0, 4] = torch.tensor([5.0, 0.0]), torch.tensor([2.0, 0.0])  # along the query
    >>> query = torch.tensor([[[[1.0, 0.0]]]])  # [batch, heads, q, head_dim]; the 11 keys before it: history
    >>> history_indices(query, keys, config, PageSummaries(2, 2)).tolist()  # 2 sinks, pages [4, 8), recent 10
    [[[0, 1, 4, 5, 6, 7, 10]]]
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from . import upstream
from .config import SparseConfig
from .host_history import HostHistory

_active: ContextVar["Selection | None"] = ContextVar("hf_attnstore_selection", default=None)


@dataclass(frozen=True)
class Pick:
    """What the queries of a forward keep of a history of `history` tokens, per KV head: the first `sinks`, the
    `chosen` positions (``[kv_heads, q, m]``, ascending, between the sinks and the recent window) and the last
    `recent`.

    Example:
        >>> Pick(2, torch.tensor([[[4, 5]]]), 1, 9).indices().tolist()
        [[[0, 1, 4, 5, 8]]]
    """

    sinks: int
    chosen: torch.Tensor
    recent: int
    history: int

    def indices(self) -> torch.Tensor:
        """Every kept position, ``[kv_heads, q, sinks + m + recent]`` ascending."""
        kv_heads, q, device = self.chosen.shape[0], self.chosen.shape[1], self.chosen.device
        first = torch.arange(self.sinks, device=device).expand(kv_heads, q, -1)
        last = torch.arange(self.history - self.recent, self.history, device=device).expand(kv_heads, q, -1)
        return torch.cat([first, self.chosen, last], dim=2)


class PageSummaries:
    """Per-page min and max of one layer's history keys, for pages of `page` tokens after `sinks` tokens.

    A layer that holds all its tokens only appends within a turn, so a full page's summary never changes: it is
    computed once, when the page fills, and each forward summarizes only the pages that filled since.

    Example:
        >>> summaries = PageSummaries(sinks=1, page=2)
        >>> keys = torch.tensor([[[[9.0], [1.0], [3.0], [2.0], [7.0]]]])  # [1, kv_heads, 5, 1]
        >>> low, high = summaries.of(keys, pages=2)  # pages [1, 3) and [3, 5)
        >>> low.tolist(), high.tolist()
        ([[[1.0], [2.0]]], [[[3.0], [7.0]]])
    """

    def __init__(self, sinks: int, page: int):
        self.sinks, self.page = sinks, page
        self.low: torch.Tensor | None = None  # [kv_heads, pages, head_dim]
        self.high: torch.Tensor | None = None

    @property
    def pages(self) -> int:
        return 0 if self.low is None else self.low.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the summaries."""
        return 0 if self.low is None else self.low.nbytes + self.high.nbytes

    def of(self, keys: torch.Tensor, pages: int, device: torch.device | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The summaries of the first `pages` pages of `keys` (``[1, kv_heads, K, d]``): ``[kv_heads, pages, d]``, on
        `device` (default: the keys'; keys in host memory are summarized there, the summaries kept on the device)."""
        if pages > self.pages:
            start, end = self.sinks + self.pages * self.page, self.sinks + pages * self.page
            block = keys[0, :, start:end].float().unflatten(1, (pages - self.pages, self.page))
            low, high = block.amin(2).to(device or keys.device), block.amax(2).to(device or keys.device)
            self.low = low if self.low is None else torch.cat([self.low, low], dim=1)
            self.high = high if self.high is None else torch.cat([self.high, high], dim=1)
        return self.low[:, :pages], self.high[:, :pages]


@dataclass
class Selection:
    """One turn's query-aware selection: its config, each layer's page summaries, and what its forwards attended.

    Attributes:
        config: The turn's SparseConfig (policy ``"quest"`` or ``"oracle"``).
        summaries: Model layer index -> that layer's :class:`PageSummaries` (quest).
        attended: History keys attended, summed over the selecting layers, KV heads and queries of the forwards.
        held: History keys those queries could have attended (the same sum, dense).
        gathered: Of `attended`, the keys decoding steps gathered (quest, sparq; one query per forward): what a
            step would read of a history kept in host memory, per layer and KV head, summed.
        steps: Decoding steps that gathered, counted per layer.
        host: Model layer index -> that layer's history in host memory (`SparseConfig.history_on_host`), set by the
            turn; the layer hands a decoding step only what the device holds, and the step gathers the rest there.
        configs: Model layer index -> that layer's config, set by the turn: the one its cache layer holds
            (`SparseConfig.at_layer`), whose budget is the layer's own. A layer not in it selects by `config`.

    Example:
        >>> selection = Selection(SparseConfig(0.2, policy="quest"))
        >>> selection.attended, selection.held
        (0, 0)
    """

    config: SparseConfig
    summaries: dict[int, PageSummaries] = field(default_factory=dict)
    attended: int = 0
    held: int = 0
    gathered: int = 0
    steps: int = 0
    host: dict[int, HostHistory] = field(default_factory=dict)
    configs: dict[int, SparseConfig] = field(default_factory=dict)


def selecting(selection: Selection | None):
    """A context in which the model's attention (importance.scored_attention calls :func:`attention`) selects
    for `selection`'s turn; nothing when None.

    Example:
        >>> with selecting(Selection(SparseConfig(0.2, policy="oracle"))) as active:
        ...     active.config.policy
        'oracle'
    """
    if selection is None:
        return contextlib.nullcontext()
    return _activated(selection)


@contextlib.contextmanager
def _activated(selection: Selection):
    token = _active.set(selection)
    try:
        yield selection
    finally:
        _active.reset(token)


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
              **kwargs):
    """SDPA over the keys the active selection keeps for each query (all of them outside a selecting turn).

    ``query`` ``[1, q_heads, q, d]``; ``key``/``value`` ``[1, kv_heads, K, d]``, the last q of them the forward's
    own. Returns transformers' ``(output [1, q, q_heads, d], None)``.

    Example:
        >>> import math
        >>> module = type("Attention", (), {"layer_idx": 0, "is_causal": True, "num_key_value_groups": 1})()
        >>> q, k, v = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 9, 4), torch.randn(1, 1, 9, 4)
        >>> dense, _ = attention(module, q, k, v, None, scaling=0.5)
        >>> with selecting(Selection(SparseConfig(8, sink_tokens=1, policy="oracle"))):
        ...     same, _ = attention(module, q, k, v, None, scaling=0.5)  # 8 of 8 history keys: dense
        >>> torch.allclose(dense, same)
        True
    """
    selection = _active.get()
    layer = getattr(module, "layer_idx", id(module))
    host = None if selection is None else selection.host.get(layer)
    # A layer whose history is on the host hands a decoding step only what the device holds (layers.py): the
    # session's length is the host history's.
    q, n_keys = query.shape[2], key.shape[2] if host is None else host.total
    history = n_keys - q
    if selection is None or query.shape[0] != 1 or history <= 0:
        return upstream.sdpa_attention(module, query, *_whole(host, key, value), attention_mask, **kwargs)
    config = selection.configs.get(layer, selection.config)  # the layer's own budget (`SparseConfig.layer_slope`)
    keep = config.budget(history)
    if keep >= history:
        return upstream.sdpa_attention(module, query, *_whole(host, key, value), attention_mask, **kwargs)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    kv_heads = key.shape[1]
    selection.held += history * q * kv_heads
    if config.policy == "oracle":
        selection.attended += keep * q * kv_heads  # per query head; counted as if per KV head
        kept = _oracle_mask(query, key[:, :, :history], keep, scaling)  # [q_heads, q, history]
    else:
        if config.policy == "sparq":
            pick = sparq_pick(query, key, config, scaling)  # SparQ's keys are all on the device, host or not
        else:
            summaries = selection.summaries.setdefault(layer, PageSummaries(min(config.sink_tokens, keep),
                                                                            config.page_tokens))
            pick = quest_pick(query, history, config, summaries, key if host is None else host.host_keys(), scaling)
        indices = pick.indices()  # [kv_heads, q, kept]
        selection.attended += indices.numel()
        if q == 1 and attention_mask is None:
            # Decoding: gather the kept keys and attend to them and the new token, no mask needed (a step given a
            # mask of its own takes the mask path below). A history on the host sends the chosen ones to the device.
            selection.gathered += indices.numel()
            selection.steps += 1
            if host is not None:
                keys, values = host.step(pick.sinks, pick.chosen[:, 0], pick.recent, history)
                return upstream.sdpa_attention(module, query, keys, values, None, **kwargs)
            index = indices[None, :, 0, :, None]
            keys = torch.cat([key[:, :, :history].gather(2, index.expand(-1, -1, -1, key.shape[-1])),
                              key[:, :, history:]], dim=2)
            values = torch.cat([value[:, :, :history].gather(2, index.expand(-1, -1, -1, value.shape[-1])),
                                value[:, :, history:]], dim=2)
            return upstream.sdpa_attention(module, query, keys, values, None, **kwargs)
        key, value = _whole(host, key, value)
        kept = torch.zeros(kv_heads, q, history, dtype=torch.bool, device=key.device)
        kept.scatter_(2, indices, True)
        kept = kept.repeat_interleave(query.shape[1] // kv_heads, dim=0)
    mask = _causal(q, n_keys, key.device).expand(kept.shape[0], -1, -1).clone()
    mask[:, :, :history] = kept
    mask = mask[None]  # [1, heads, q, K]
    if attention_mask is not None:
        given = attention_mask[:, :, :, :n_keys]
        mask = mask & (given if given.dtype == torch.bool else given > torch.finfo(given.dtype).min / 2)
    return upstream.sdpa_attention(module, query, key, value, mask, **kwargs)


def _whole(host: HostHistory | None, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's keys and values: as given, or from the host for a history kept there."""
    return (key, value) if host is None else host.whole(key, value)


def _causal(q: int, n_keys: int, device) -> torch.Tensor:
    """``[1, q, K]``: query i of the forward sees the history and its own tokens up to itself."""
    limit = n_keys - q + torch.arange(q, device=device) + 1
    return (torch.arange(n_keys, device=device)[None, :] < limit[:, None])[None]


def _oracle_mask(query: torch.Tensor, history_keys: torch.Tensor, keep: int, scaling: float) -> torch.Tensor:
    """Each query head's `keep` history keys of the highest logit: ``[q_heads, q, history]`` bool."""
    q_heads, kv_heads = query.shape[1], history_keys.shape[1]
    keys = history_keys[0].float().repeat_interleave(q_heads // kv_heads, dim=0)  # [q_heads, history, d]
    logits = torch.bmm(query[0].float(), keys.transpose(1, 2)) * scaling  # [q_heads, q, history]
    best = logits.topk(keep, dim=-1, sorted=False).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(2, best, True)


def page_bounds(queries: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Upper bounds of ``q·k`` over each page's keys: ``sum_d max(q_d·low_d, q_d·high_d)``, where a positive query
    component meets the page's max and a negative one its min. `queries` ``[kv_heads, m, d]``, `low`/`high`
    ``[kv_heads, pages, d]``: ``[kv_heads, m, pages]``.

    Example:
        >>> low, high = torch.tensor([[[-1.0, 0.0]]]), torch.tensor([[[2.0, 3.0]]])  # one page
        >>> page_bounds(torch.tensor([[[1.0, -1.0]]]), low, high)  # 1·2 + (-1)·0
        tensor([[[2.]]])
    """
    return torch.bmm(queries.clamp(min=0), high.transpose(1, 2)) + torch.bmm(queries.clamp(max=0), low.transpose(1, 2))


def history_indices(query: torch.Tensor, key: torch.Tensor, config: SparseConfig, summaries: PageSummaries,
                    scaling: float | None = None) -> torch.Tensor:
    """Quest's choice: the history positions each query keeps, per KV head, ``[kv_heads, q, kept]`` ascending.

    The history is ``key[:, :, :K - q]``. Kept: the first `sinks`, the pages of the highest bound, then the most
    recent tokens (at least ``config.split``'s share; the window reaches back to where the candidate pages end), so
    the three never overlap and every head and query keeps the same count: ``config.budget(history)``, less the
    part of a page that does not fit.

    Example:
        >>> config = SparseConfig(6, sink_tokens=1, recent_ratio=0.0, policy="quest", page_tokens=2)
        >>> key = torch.zeros(1, 1, 10, 1)
        >>> key[0, 0, 3], key[0, 0, 7] = 1.0, 0.5  # pages [3, 5) and [7, 9) hold what a positive query prefers
        >>> history_indices(torch.ones(1, 1, 1, 1), key, config, PageSummaries(1, 2)).tolist()  # 9 history keys
        [[[0, 3, 4, 7, 8]]]
    """
    return quest_pick(query, key.shape[2] - query.shape[2], config, summaries, key, scaling).indices()


def _quest_layout(config: SparseConfig, history: int) -> tuple[int, int, int, int, int]:
    """Quest's split of a history: (keep, sinks, recent, candidate pages, pages kept)."""
    keep = config.budget(history)
    sinks, recent = config.split(keep, history)
    page = config.page_tokens
    # The candidate pages end before the recent window; the window then reaches back to the last page's end.
    candidates = max(0, (history - recent - sinks) // page)
    recent = history - sinks - candidates * page
    pages = min(candidates, max(0, keep - sinks - recent) // page)
    if pages == 0 and recent + sinks > keep:  # no whole page fits: the budget goes to the recent tokens alone
        recent = keep - sinks
    return keep, sinks, recent, candidates, pages


def recent_start(config: SparseConfig, history: int) -> int:
    """The first position of the recent window a query after `history` tokens keeps (0: it keeps them all): what a
    layer whose history is on the host keeps on the device, with the sinks (host_history.py).

    Example:
        >>> recent_start(SparseConfig(0.2, policy="sparq"), 1000)  # budget 200: 4 sinks, 20 recent
        980
        >>> recent_start(SparseConfig(0.2, policy="quest"), 1001)  # back to the last page's end: 21 recent, not 20
        980
    """
    keep = config.budget(history)
    if keep >= history:
        return 0
    if config.policy == "quest":
        recent = _quest_layout(config, history)[2]
    else:
        recent = config.split(keep, history)[1]
    return history - recent


def quest_pick(query: torch.Tensor, history: int, config: SparseConfig, summaries: PageSummaries,
               keys: torch.Tensor, scaling: float | None = None) -> Pick:
    """Quest's choice (:func:`history_indices`) for `query` after `history` tokens, as a :class:`Pick`; the pages
    are summarized from `keys` (``[1, kv_heads, >= history, d]``, rotated; in host memory for a history kept there:
    the summaries go to the query's device).

    Example:
        >>> config = SparseConfig(6, sink_tokens=1, recent_ratio=0.0, policy="quest", page_tokens=2)
        >>> keys = torch.zeros(1, 1, 9, 1)
        >>> keys[0, 0, 3], keys[0, 0, 7] = 1.0, 0.5
        >>> pick = quest_pick(torch.ones(1, 1, 1, 1), 9, config, PageSummaries(1, 2), keys)
        >>> pick.sinks, pick.chosen.tolist(), pick.recent  # 1 sink, pages [3, 5) and [7, 9), no recent window
        (1, [[[3, 4, 7, 8]]], 0)
    """
    q_heads, q, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads, device = keys.shape[1], query.device
    keep, sinks, recent, candidates, pages = _quest_layout(config, history)
    page = config.page_tokens
    if pages == 0:
        return Pick(sinks, torch.empty(kv_heads, q, 0, dtype=torch.long, device=device), recent, history)
    low, high = summaries.of(keys, candidates, device)  # [kv_heads, candidates, d]
    group = q_heads // kv_heads
    queries = query[0].float().reshape(kv_heads, group * q, dim)
    bound = page_bounds(queries, low, high)
    # A group's heads vote with their softmax over the pages' bounds (a head with sharp logits is not drowned out
    # by one whose logits are large but flat), summed: [kv_heads, q, candidates].
    weight = (bound * (scaling or dim ** -0.5)).softmax(-1).view(kv_heads, group, q, candidates).sum(1)
    best = weight.topk(pages, dim=-1, sorted=False).indices.sort(dim=-1).values  # [kv_heads, q, pages]
    offsets = torch.arange(page, device=device)
    chosen = (sinks + best[..., None] * page + offsets).flatten(2)  # [kv_heads, q, pages * page] ascending
    return Pick(sinks, chosen, recent, history)


def sketch_indices(query: torch.Tensor, key: torch.Tensor, config: SparseConfig, scaling: float | None = None):
    """SparQ's choice: the history positions each query keeps, per KV head, ``[kv_heads, q, kept]`` ascending.

    Each query scores every history token from the `sketch_dims` components where its group's queries are largest
    in magnitude (reading those columns of the keys alone), with SparQ's temperature (the share of ``|q|`` they
    carry), and keeps the sinks, the most recent tokens and the tokens of the highest approximate weight (the group's
    query heads add their softmax), ``config.budget(history)`` in all.

    Example:
        >>> config = SparseConfig(4, sink_tokens=1, recent_ratio=0.0, policy="sparq", sketch_dims=1)
        >>> key = torch.zeros(1, 1, 9, 2)
        >>> key[0, 0, [2, 5, 6], 0] = torch.tensor([3.0, 1.0, 2.0])  # along the query's large component
        >>> key[0, 0, 7, 1] = 9.0  # along its small component, which the sketch does not read
        >>> sketch_indices(torch.tensor([[[[1.0, 0.1]]]]), key, config).tolist()  # 8 history keys
        [[[0, 2, 5, 6]]]
    """
    return sparq_pick(query, key, config, scaling).indices()


def sparq_pick(query: torch.Tensor, key: torch.Tensor, config: SparseConfig, scaling: float | None = None) -> Pick:
    """SparQ's choice (:func:`sketch_indices`) as a :class:`Pick`: `key` holds the history's keys then the
    forward's (on the query's device: the sketch reads components chosen per query).

    Example:
        >>> config = SparseConfig(4, sink_tokens=1, recent_ratio=0.0, policy="sparq", sketch_dims=1)
        >>> key = torch.zeros(1, 1, 9, 2)
        >>> key[0, 0, [2, 5, 6], 0] = torch.tensor([3.0, 1.0, 2.0])
        >>> pick = sparq_pick(torch.tensor([[[[1.0, 0.1]]]]), key, config)
        >>> pick.sinks, pick.chosen.tolist(), pick.recent
        (1, [[[2, 5, 6]]], 0)
    """
    q_heads, q, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads, history = key.shape[1], key.shape[2] - query.shape[2]
    keep = config.budget(history)
    sinks, recent = config.split(keep, history)
    device = key.device
    chosen = keep - sinks - recent
    if chosen <= 0:
        return Pick(sinks, torch.empty(kv_heads, q, 0, dtype=torch.long, device=device), recent, history)
    fixed = torch.cat([torch.arange(sinks, device=device), torch.arange(history - recent, history, device=device)])
    group = q_heads // kv_heads
    queries = query[0].float().reshape(kv_heads, group, q, dim)
    r = min(config.sketch_dims, dim)
    dims = queries.abs().sum(1).topk(r, dim=-1).indices  # [kv_heads, q, r]: one set per KV head and query
    partial = queries.gather(3, dims[:, None].expand(-1, group, -1, -1))  # [kv_heads, group, q, r]
    # q[dims]·k[dims] is q'·k for q' = q with its other components zeroed: one matrix product, not a gather of the
    # keys per query (a device that holds the keys elsewhere reads only those r columns of them).
    kept = torch.zeros_like(queries).scatter_(3, dims[:, None].expand(-1, group, -1, -1), partial)
    approx = torch.matmul(kept.reshape(kv_heads, group * q, dim), key[0, :, :history].float().transpose(1, 2))
    approx = approx.view(kv_heads, group, q, history)
    # SparQ's temperature: the chosen components carry a share of |q|; the softmax over fewer terms is sharpened
    # as if they carried it all.
    share = partial.abs().sum(-1) / queries.abs().sum(-1).clamp_min(1e-12)  # [kv_heads, group, q]
    scale = (scaling or dim ** -0.5) / share.clamp_min(1e-6).sqrt()
    approx[..., fixed] = float("-inf")  # sinks and recent tokens are kept anyway
    weight = (approx * scale[..., None]).softmax(-1).sum(1)  # [kv_heads, q, history]
    # Chosen between the sinks and the recent window (a weight that underflows to 0 never ties with a kept token).
    best = weight[..., sinks : history - recent].topk(chosen, dim=-1, sorted=False).indices + sinks
    return Pick(sinks, best.sort(dim=-1).values, recent, history)
