"""Perplexity of long texts read turn by turn through a bounded context window (the paper's Table 1).

A text is fed to the model in chunks, as the turns of a conversation would be: each chunk resumes the
session from the store, and whenever the context exceeds the window the history is truncated with the
mode under test. Every token is scored by the forward that feeds it, so the numbers include the damage a
truncation does to all later turns, not only to the turn that overflowed.
"""

from __future__ import annotations

import dataclasses
import tempfile

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from transformers import DynamicCache

from ...cache.cache import AttnStoreCache
from ...cache.config import TruncationConfig
from ...store import AttnStore, StoreTuning
from ...cache.truncation import tokens_to_drop
from ...cache.upstream import cache_kwargs

#: Truncation modes the evaluator understands: ``full`` never truncates (the upper bound, needs a model
#: whose position range covers the whole text); ``recompute``, ``decoupled`` and ``naive`` are
#: :class:`AttnStoreCache` modes, and so is ``importance`` (decoupled, dropping the least important tokens by
#: stored attention scores instead of the oldest, cache/importance.py); ``naive-rotated`` is an engine that
#: caches keys after RoPE and drops the oldest entries on overflow, so the kept keys keep their stale positions.
MODES = ("full", "recompute", "decoupled", "importance", "naive", "naive-rotated")


@dataclass
class PerplexityResult:
    """Summed negative log-likelihood over the scored tokens of one or more texts.

    Attributes:
        nll: Sum of the scored tokens' negative log-likelihoods (nats).
        tokens: How many tokens were scored.
        overflows: How many turns truncated the history.

    Example:
        >>> import math
        >>> a = PerplexityResult(nll=2 * math.log(4), tokens=2)
        >>> b = PerplexityResult(nll=math.log(4), tokens=1, overflows=1)
        >>> total = a + b
        >>> round(total.ppl, 6), total.tokens, total.overflows  # exp(mean NLL)
        (4.0, 3, 1)
    """

    nll: float = 0.0
    tokens: int = 0
    overflows: int = 0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    def __add__(self, other: "PerplexityResult") -> "PerplexityResult":
        return PerplexityResult(self.nll + other.nll, self.tokens + other.tokens, self.overflows + other.overflows)


@torch.no_grad()
def sliding_perplexity(model, ids, *, context_window: int, chunk_tokens: int = 128, mode: str = "decoupled",
                       keep_first: int = 4, truncation_ratio: float = 0.5,
                       score_from: int | None = None, kv_codec: str | None = None,
                       keep_recent: int = 64) -> PerplexityResult:
    """Scores a text read in turns of `chunk_tokens` through a window of `context_window` tokens.

    Each turn appends the next chunk to the (possibly already truncated) history and resumes from the
    store: ``decoupled`` reuses the kept KV with re-applied RoPE, ``recompute`` recomputes the kept tokens
    (token truncation), ``naive`` reuses them at their stale positions in the overflowing turn (our store
    keeps keys pre-RoPE, so the next turn re-positions them: a lower bound on naive truncation's damage),
    ``naive-rotated`` keeps stale positions for good (a post-RoPE ``DynamicCache`` cropped at the front),
    ``importance`` reuses like ``decoupled`` but drops the same number of the least important tokens (not the
    oldest; the last 64 are always kept), and ``full`` never truncates.

    A chunk's first token is scored by the last logit of the previous turn, the others by this turn's
    forward, so each token is predicted from exactly the context the model had when it was fed.

    Args:
        model: A causal LM supported by :class:`AttnStoreCache`.
        ids: The text's token ids, ``[1, L]`` or ``[L]``.
        context_window: The window W; the history is truncated when a turn's prompt exceeds it.
        chunk_tokens: Tokens per turn.
        mode: One of :data:`MODES`.
        keep_first: Attention-sink tokens kept at every truncation.
        truncation_ratio: Fraction of the window dropped at an overflow.
        score_from: First token index scored; default `context_window`, i.e. only tokens the model reads
            after the first overflow (before it, all modes are the same computation).
        kv_codec: With a lossy codec (``"int8"``, ``"int4"``), the store keeps the history in a disk tier with
            that codec and evicts it from host memory after every turn: each turn resumes from the cold,
            lossy copy (store modes only).
        keep_recent: ``importance`` only: the most recent tokens never dropped (`TruncationConfig.keep_recent`).

    Returns:
        A :class:`PerplexityResult` for this text.

    Raises:
        ValueError: Unknown `mode`, a text too short to overflow, or ``full`` beyond the model's positions.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> ids = torch.randint(0, 32, (48,))
        >>> decoupled = sliding_perplexity(model, ids, context_window=24, chunk_tokens=16, mode="decoupled")
        >>> recompute = sliding_perplexity(model, ids, context_window=24, chunk_tokens=16, mode="recompute")
        >>> decoupled.tokens == recompute.tokens, decoupled.overflows > 0  # the same tokens scored; overflows
        (True, True)
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")
    if chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` must be >= 1, got {chunk_tokens}")
    ids = torch.as_tensor(ids).reshape(-1).cpu()
    score_from = context_window if score_from is None else score_from
    if ids.numel() <= max(score_from, 1):
        raise ValueError(
            f"the text has {ids.numel()} tokens, so nothing after token {score_from} is scored: "
            "use longer texts or a smaller window"
        )
    limit = getattr(model.config, "max_position_embeddings", None)
    if mode == "full" and limit is not None and ids.numel() > limit:
        raise ValueError(f"mode 'full' needs the whole text ({ids.numel()} tokens) in the model's {limit} positions")
    config = TruncationConfig(context_window, truncation_ratio, keep_first, "recompute", keep_recent)
    if mode == "naive-rotated":
        if kv_codec is not None:
            raise ValueError("`kv_codec` applies to the store's modes, not 'naive-rotated'")
        turn, close = _rotated_turns(model, config), lambda: None
    else:
        turn, close = _store_turns(model, config, mode, kv_codec)
    try:
        return score_turns(turn, ids, chunk_tokens, score_from)
    finally:
        close()


def score_turns(turn, ids: torch.Tensor, chunk_tokens: int, score_from: int) -> PerplexityResult:
    """Feeds `ids` in chunks to ``turn(chunk) -> (logits of the chunk's ids, tokens dropped)`` and sums the NLL of
    the tokens from `score_from` on, each predicted by the logit of the forward that had the token before it.

    Example:
        >>> def uniform(chunk):  # a model that knows nothing: every one of 8 ids equally likely, nothing dropped
        ...     return torch.zeros(chunk.numel(), 8), 0
        >>> result = score_turns(uniform, torch.arange(6), chunk_tokens=2, score_from=1)
        >>> result.tokens, round(result.ppl, 6)
        (5, 8.0)
    """
    result = PerplexityResult()
    last_logit = None
    for start in range(0, ids.numel(), chunk_tokens):
        chunk = ids[start : start + chunk_tokens]
        logits, dropped = turn(chunk)
        result.overflows += int(dropped > 0)
        # The last len(chunk) logits belong to the chunk; logits[j] predicts the id after the j-th one.
        n = chunk.numel()
        predicted = torch.cat([last_logit[None], logits[-n:-1]]) if last_logit is not None else logits[-n:-1]
        targets = chunk if last_logit is not None else chunk[1:]
        first_index = start if last_logit is not None else start + 1
        scored = torch.arange(first_index, start + n) >= score_from
        if scored.any():
            nll = F.cross_entropy(predicted, targets.to(predicted.device), reduction="none")
            result.nll += float(nll[scored.to(nll.device)].sum())
            result.tokens += int(scored.sum())
        last_logit = logits[-1]
    return result


def _store_turns(model, config: TruncationConfig, mode: str, kv_codec: str | None = None):
    """Turns through an :class:`AttnStoreCache`: returns ``turn(chunk) -> (logits of the fed ids, dropped)`` and
    a function that releases the store."""
    tmp = None
    if kv_codec is None:
        store = AttnStore(host_bytes=2**62)  # one session; the store only keeps it between turns
    else:
        tmp = tempfile.TemporaryDirectory(prefix="attnstore-ppl-")
        store = AttnStore(host_bytes=2**62, disk_dir=tmp.name, kv_codec=kv_codec,
                          tuning=StoreTuning(fsync=False, idle_flush_s=0.05))
    if mode == "full":
        config = dataclasses.replace(config, context_window=None, mode="decoupled")
    else:
        config = dataclasses.replace(config, mode=mode)
    history = torch.empty(0, dtype=torch.long)

    def turn(chunk: torch.Tensor):
        nonlocal history
        cache = AttnStoreCache(model, store, "ppl", torch.cat([history, chunk]), truncation=config)
        assert cache.input_ids.shape[1] - cache.reused_tokens >= chunk.numel(), "the chunk is always computed"
        logits = model(cache.input_ids[:, cache.reused_tokens :], **cache_kwargs(cache)).logits[0].float()
        history = cache.input_ids[0].cpu()
        if tmp is not None:  # the next turn resumes from the cold copy
            cache.close()
            store.flush()
            store.evict("ppl")
        return logits, cache.dropped_tokens

    def close() -> None:
        store.close()
        if tmp is not None:
            tmp.cleanup()

    return turn, close


def _rotated_turns(model, config: TruncationConfig):
    """Turns through a plain ``DynamicCache`` of rotated keys, cropped at the front on overflow."""
    cache = DynamicCache()
    k = config.keep_first

    def turn(chunk: torch.Tensor):
        past = cache.get_seq_length()
        drop = tokens_to_drop(past + chunk.numel(), config)
        if drop:
            for layer in cache.layers:
                layer.keys = torch.cat([layer.keys[:, :, :k], layer.keys[:, :, k + drop :]], dim=2)
                layer.values = torch.cat([layer.values[:, :, :k], layer.values[:, :, k + drop :]], dim=2)
        # Positions continue from the (shorter) cache length, below the kept keys' original positions.
        logits = model(chunk.view(1, -1).to(model.device), **cache_kwargs(cache)).logits[0].float()
        return logits, drop

    return turn


#: The rows of the report: (mode, keep_first); ``keep_first=0`` shows what the attention sinks are worth.
VARIANTS = (("full", 4), ("recompute", 4), ("decoupled", 4), ("decoupled", 0), ("importance", 4), ("naive", 4),
            ("naive-rotated", 4))


def perplexity_report(model, tokenizer, *, corpora=("sharegpt", "pydoc"), texts: int = 3, length: int = 3072,
                      context_window: int = 1024, chunk_tokens: int = 128, variants=VARIANTS,
                      print_fn=print) -> dict[str, dict[tuple[str, int], PerplexityResult]]:
    """Runs :func:`sliding_perplexity` for each corpus and variant and prints a Markdown table per corpus.

    Returns:
        ``{corpus: {(mode, keep_first): PerplexityResult}}``.

    Example:
        >>> from hf_attnstore import load_default_model
        >>> model, tokenizer = load_default_model()  # doctest: +SKIP
        >>> table = perplexity_report(model, tokenizer, corpora=("pydoc",), texts=1)  # doctest: +SKIP
        >>> table["pydoc"][("decoupled", 4)].ppl < table["pydoc"][("naive", 4)].ppl  # doctest: +SKIP
        True
    """
    import time

    from tqdm.auto import tqdm

    from .corpora import corpus_description, load_texts

    results = {}
    for corpus in corpora:
        docs = load_texts(corpus, tokenizer, texts, length)
        rows = {}
        print_fn(f"\n{corpus}: {corpus_description(corpus)}; {len(docs)} texts of {length} tokens, window "
                 f"{context_window}, turns of {chunk_tokens} tokens, ratio 0.5, scored after token {context_window}")
        print_fn("| mode | keep_first | PPL | vs recompute | overflows | time |\n| --- | --- | --- | --- | --- | --- |")
        for mode, keep in variants:
            started = time.perf_counter()
            total = PerplexityResult()
            for ids in tqdm(docs, desc=f"{corpus} {mode}/{keep}", leave=False):
                total = total + sliding_perplexity(model, ids, context_window=context_window,
                                                   chunk_tokens=chunk_tokens, mode=mode, keep_first=keep)
            rows[(mode, keep)] = total
            ref = rows.get(("recompute", 4))
            rel = f"{100 * (total.ppl / ref.ppl - 1):+.2f}%" if ref is not None and mode != "recompute" else ""
            print_fn(f"| {mode} | {keep} | {total.ppl:.3f} | {rel} | {total.overflows} | "
                     f"{time.perf_counter() - started:.0f} s |")
        results[corpus] = rows
    return results
