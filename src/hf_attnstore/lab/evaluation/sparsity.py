"""Perplexity against KV sparsity: dense attention, StreamingLLM, ALISA's sparse window attention, H2O, the
query-aware selections (Quest, SparQ) and the oracle (each query head's true top-k keys), the bound every policy is
measured against: the report gives each policy's loss as a multiple of the oracle's at the same sparsity.

A long text is fed in chunks. Before each chunk the history is trimmed to the budget (a fraction of the text
so far: 20% kept is 80% sparsity), and the chunk attends to the kept tokens and causally to itself: every
token is predicted from the sparse context the policy left, so the number includes what earlier selections
cost later (a token dropped in one chunk is missing for all that follow).

Two protocols:

- ``turns`` (the store's own case): every chunk is a turn of a stored session: a new
  :class:`~hf_attnstore.cache.AttnStoreCache` resumes the session from the store, selects the history it
  keeps from the importance scores stored with it (cache/importance.py), and saves the chunk. Turn k+1 is
  scored on a session kept sparse since turn k; the store keeps every token, so a token a turn dropped may
  come back in a later one (when its stored score ranks it again).
- ``turn`` (one long turn): one cache is fed chunk after chunk; a token dropped stays dropped (H2O's rule).
- ``decode`` (a held-out segment decoded token by token): the first `score_from` tokens are one forward (dense: no
  history before it), then every later token is its own forward of one token in the same turn, as ``generate``
  decodes (teacher forced); a policy selects before (or, query-aware, inside) every step.

Each token is scored by the forward that feeds it; the first of a chunk by the previous chunk's last logit.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ...cache.cache import AttnStoreCache
from ...cache.config import QUERY_AWARE_POLICIES, SparseConfig
from ...cache.upstream import cache_kwargs
from ...store import AttnStore
from .ppl import PerplexityResult, score_turns

#: The policies compared: dense, the oracle, then the other :class:`SparseConfig` policies.
POLICIES = ("dense", "oracle", "streaming", "alisa", "h2o", "quest", "sparq")
PROTOCOLS = ("turns", "turn", "decode")


@torch.no_grad()
def sparse_perplexity(model, ids, config: SparseConfig | None, *, chunk_tokens: int = 32, score_from: int = 256,
                      protocol: str = "turns") -> PerplexityResult:
    """Scores a text read in chunks through a session kept sparse by `config` (None: dense).

    Args:
        model: A causal LM that :class:`AttnStoreCache` can keep sparse (SDPA or eager attention).
        ids: The text's ids, ``[1, L]`` or ``[L]``.
        config: The sparsity (budget and policy), or None for dense attention.
        chunk_tokens: Tokens per chunk (per turn with ``"turns"``).
        score_from: First token index scored (earlier ones only build the history).
        protocol: ``"turns"`` or ``"turn"`` (see the module docstring).

    Returns:
        A :class:`PerplexityResult` for this text.

    Example:
        >>> sparse_perplexity(model, ids, SparseConfig(0.2), chunk_tokens=32).ppl  # doctest: +SKIP
        14.2
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    if chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` must be >= 1, got {chunk_tokens}")
    ids = torch.as_tensor(ids).reshape(-1).cpu()
    if ids.numel() <= score_from:
        raise ValueError(f"the text has {ids.numel()} tokens: nothing after token {score_from} is scored")
    store = AttnStore(host_bytes=2**62)  # one session; the store keeps it between turns
    try:
        if protocol == "decode":
            return _decode(model, store, config, ids, score_from)
        return score_turns(_turns(model, store, config) if protocol == "turns" else _one_turn(model, store, config),
                      ids, chunk_tokens, score_from)
    finally:
        store.close()


def _turns(model, store: AttnStore, config: SparseConfig | None):
    history = torch.empty(0, dtype=torch.long)

    def turn(chunk: torch.Tensor):
        nonlocal history
        with AttnStoreCache(model, store, "sparse", torch.cat([history, chunk]), kv_budget=config) as cache:
            logits = model(cache.input_ids[:, cache.reused_tokens :], **cache_kwargs(cache)).logits[0].float()
            history = cache.input_ids[0].cpu()
        return logits, 0

    return turn


def _decode(model, store: AttnStore, config: SparseConfig | None, ids: torch.Tensor, score_from: int):
    """The ``decode`` protocol: one forward of the first `score_from` tokens, then one forward per token."""
    cache = AttnStoreCache(model, store, "sparse", ids[:score_from], kv_budget=config, save=False)
    last = model(cache.input_ids, **cache_kwargs(cache)).logits[0, -1].float()
    result = PerplexityResult()
    for t in range(score_from, ids.numel()):
        target = ids[t : t + 1].to(model.device)
        result.nll += float(F.cross_entropy(last[None], target))
        result.tokens += 1
        last = model(target.view(1, 1), **cache_kwargs(cache)).logits[0, -1].float()
    return result


def _one_turn(model, store: AttnStore, config: SparseConfig | None):
    cache = None

    def turn(chunk: torch.Tensor):
        nonlocal cache
        if cache is None:
            cache = AttnStoreCache(model, store, "sparse", chunk, kv_budget=config, save=False)
        chunk = chunk.view(1, -1).to(model.device)
        return model(chunk, **cache_kwargs(cache)).logits[0].float(), 0

    return turn


def sparsity_report(model, tokenizer, *, corpora=("pydoc", "sharegpt"), texts: int = 2, length: int = 2048,
                    sparsities=(0.5, 0.8, 0.9), policies=POLICIES, chunk_tokens: int = 32, score_from: int = 256,
                    protocol: str = "turns", layer_slopes=(0.0,), print_fn=print) -> dict:
    """Runs :func:`sparse_perplexity` per corpus, policy and sparsity, and prints a Markdown table per corpus.

    `layer_slopes`: the query-aware policies (``oracle``, ``quest``, ``sparq``) run once per slope
    (`SparseConfig.layer_slope`: 0 the same budget in every layer, ``a > 0`` PyramidKV's pyramid), a row each,
    named ``policy`` for 0 and ``policy pyramid a`` otherwise; every row's "x oracle's loss" is read against the
    uniform oracle. The other policies run once (their layers share one mask: one budget).

    Returns:
        ``{corpus: {(row name, sparsity): PerplexityResult}}`` (dense under sparsity 0).
    """
    if any(slope != 0 for slope in layer_slopes) and 0.0 not in layer_slopes:
        layer_slopes = (0.0, *layer_slopes)  # the uniform oracle: what every row is read against
    from .corpora import corpus_description, load_texts

    results = {}
    for corpus in corpora:
        docs = load_texts(corpus, tokenizer, texts, length)
        feed = "decoded token by token" if protocol == "decode" else f"chunks of {chunk_tokens} ({protocol})"
        print_fn(f"\n{corpus}: {corpus_description(corpus)}; {len(docs)} texts of {length} tokens, {feed}, "
                 f"scored after token {score_from}")
        print_fn("| policy | sparsity | PPL | vs dense | x oracle's loss | time |\n| --- | --- | --- | --- | --- | --- |")
        rows = {}
        # Dense and the oracle first: every other row is read against them.
        runs = [(policy, slope) for policy in sorted(policies, key=lambda p: {"dense": 0, "oracle": 1}.get(p, 2))
                for slope in (layer_slopes if policy in QUERY_AWARE_POLICIES else (0.0,))]
        for policy, slope in runs:
            name = policy if slope == 0 else f"{policy} pyramid {slope:g}"
            for sparsity in ((0.0,) if policy == "dense" else sparsities):
                config = None if policy == "dense" else SparseConfig(round(1.0 - sparsity, 6), policy=policy,
                                                                     layer_slope=slope)
                started = time.perf_counter()
                total = PerplexityResult()
                for ids in docs:
                    total = total + sparse_perplexity(model, ids, config, chunk_tokens=chunk_tokens,
                                                      score_from=score_from, protocol=protocol)
                rows[(name, sparsity)] = total
                dense, oracle = rows.get(("dense", 0.0)), rows.get(("oracle", sparsity))
                rel = f"{100 * (total.ppl / dense.ppl - 1):+.2f}%" if dense is not None and policy != "dense" else ""
                times = ""
                if dense is not None and oracle is not None and name not in ("dense", "oracle") \
                        and oracle.ppl > dense.ppl:
                    times = f"{(total.ppl - dense.ppl) / (oracle.ppl - dense.ppl):.1f}x"
                print_fn(f"| {name} | {sparsity:.0%} | {total.ppl:.3f} | {rel} | {times} | "
                         f"{time.perf_counter() - started:.0f} s |")
        results[corpus] = rows
    return results
