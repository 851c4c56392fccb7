"""`make demo`: real ShareGPT conversations through SmolLM2, with the store vs full recomputation."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..cache.cache import AttnStoreCache
from ..cache.chat import ChatTokens, clip_text
from .data import load_sharegpt
from .models import load_default_model
from ..store import AttnStore
from ..serving.timing import FirstTokenTimer
from ..cache.upstream import cache_kwargs


@dataclass
class TurnResult:
    """One turn of :func:`run_demo`: prompt and reused tokens, TTFT from the store and recomputing, and whether the
    outputs agree.

    Example:
        >>> r = TurnResult("c1", 2, prompt_tokens=300, reused_tokens=250, ttft_store=0.02, ttft_recompute=0.05,
        ...                identical=True)
        >>> round(r.ttft_recompute / r.ttft_store, 2), r.identical  # the speedup the demo prints
        (2.5, True)
    """
    conversation: str
    turn: int
    prompt_tokens: int
    reused_tokens: int
    ttft_store: float
    ttft_recompute: float
    identical: bool


LEGEND = """\
prompt: the turn's prompt tokens (the history and the new message); reused: of them, KV from the store
TTFT AS: time to first token resuming from the store (lookup and load included); TTFT RE: recomputing the
whole history (a fresh DynamicCache); speedup: RE / AS; same: greedy tokens identical to RE's
A first turn has nothing stored: both compute the whole prompt and AS also saves it; a difference there is
the saving's cost, or noise from other work on the machine."""


def summary(results: list[TurnResult]) -> str:
    """The demo's last lines: resumed turns' mean TTFT with the store and recomputing, and identical outputs.

    Example:
        >>> rows = [TurnResult("c", 1, 100, 0, 0.2, 0.1, True), TurnResult("c", 2, 400, 300, 0.05, 0.25, True)]
        >>> print(summary(rows))
        resumed turns (2nd and later, 1 of 2): mean TTFT 50 ms with the store (AS) vs 250 ms recomputing (RE): 80% lower; 300 of 400 prompt tokens reused
        greedy outputs identical to recomputation: 2/2 turns
    """
    lines = []
    later = [r for r in results if r.turn >= 2]
    if later:
        store_ms = 1000 * statistics.mean(r.ttft_store for r in later)
        recompute_ms = 1000 * statistics.mean(r.ttft_recompute for r in later)
        lines.append(f"resumed turns (2nd and later, {len(later)} of {len(results)}): mean TTFT {store_ms:.0f} ms with "
                     f"the store (AS) vs {recompute_ms:.0f} ms recomputing (RE): {100 * (1 - store_ms / recompute_ms):.0f}% "
                     f"lower; {sum(r.reused_tokens for r in later)} of {sum(r.prompt_tokens for r in later)} prompt "
                     "tokens reused")
    lines.append(f"greedy outputs identical to recomputation: {sum(r.identical for r in results)}/{len(results)} turns")
    return "\n".join(lines)


def plot(results: list[TurnResult], path: str) -> None:
    """A PNG of TTFT per turn, recomputation (RE) against the store (AS), one panel per conversation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conversations = list(dict.fromkeys(r.conversation for r in results))
    fig, axes = plt.subplots(1, len(conversations), figsize=(4 * len(conversations), 3.2), squeeze=False, sharey=True)
    for ax, conv in zip(axes[0], conversations):
        rows = [r for r in results if r.conversation == conv]
        turns = [r.turn for r in rows]
        ax.plot(turns, [1000 * r.ttft_recompute for r in rows], "o-", label="RE (recompute)")
        ax.plot(turns, [1000 * r.ttft_store for r in rows], "s-", label="AS (the store)")
        ax.set_title(f"conversation {conv}", fontsize=9)
        ax.set_xlabel("turn (1: nothing stored yet)")
        ax.set_xticks(turns)
    axes[0][0].set_ylabel("TTFT (ms)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(conversations: int = 3, turns: int = 4, max_new_tokens: int = 32, max_user_tokens: int = 128,
             model=None, tokenizer=None, echo=print, plot_path: str | None = None) -> list[TurnResult]:
    """Replays the first multi-turn ShareGPT conversations and compares each turn with recomputation.

    Every turn runs twice with greedy decoding: once resuming from the store, once recomputing the whole
    history with a fresh `DynamicCache` (the baseline). TTFT includes the store lookup and KV loading. With
    `plot_path`, TTFT per turn is also drawn to that PNG.

    Example:
        >>> results = run_demo(conversations=1, turns=2, echo=lambda line: None)  # doctest: +SKIP
        >>> results[1].reused_tokens > 0, all(r.identical for r in results)  # doctest: +SKIP
        (True, True)
    """
    if model is None:
        echo("Loading SmolLM2-135M-Instruct (bundled; converted from its GGUF once, then reused) ...")
        model, tokenizer = load_default_model()
    chat = ChatTokens(tokenizer)
    store = AttnStore(host_bytes="2GiB")
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    results: list[TurnResult] = []
    # Warm up kernels and allocator so the first measured turn is not penalized.
    with torch.no_grad():
        model.generate(chat.first_turn("warm up"), max_new_tokens=2, **{k: v for k, v in gen.items() if k != "max_new_tokens"})
    echo(LEGEND + "\n")
    echo(f"{'conversation':<14}{'turn':>5}{'prompt':>8}{'reused':>8}{'TTFT AS':>10}{'TTFT RE':>10}{'speedup':>9}  same")
    for conv in load_sharegpt(limit=conversations, min_user_turns=2):
        ids = None
        for turn, message in enumerate(conv.user_turns[:turns], start=1):
            message = clip_text(tokenizer, message, max_user_tokens)
            ids = chat.first_turn(message) if ids is None else chat.next_turn(ids, message)
            timer = FirstTokenTimer().start()
            cache = AttnStoreCache(model, store, conv.id, ids)
            out = model.generate(cache.input_ids, **cache_kwargs(cache), streamer=timer, **gen)
            ttft_store = timer.ttft
            timer.start()
            ref = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), streamer=timer, **gen)
            r = TurnResult(conv.id, turn, ids.shape[1], cache.reused_tokens, ttft_store, timer.ttft,
                           torch.equal(out, ref))
            results.append(r)
            echo(f"{r.conversation:<14}{r.turn:>5}{r.prompt_tokens:>8}{r.reused_tokens:>8}"
                 f"{1000 * r.ttft_store:>8.0f}ms{1000 * r.ttft_recompute:>8.0f}ms"
                 f"{r.ttft_recompute / r.ttft_store:>8.1f}x  {'yes' if r.identical else 'NO'}"
                 f"{'  (first turn: nothing to reuse)' if r.turn == 1 else ''}")
            ids = out
    echo("\n" + summary(results))
    echo(f"store: {store.stats().summary()}")
    if plot_path:
        plot(results, plot_path)
        echo(f"TTFT per turn, RE vs AS: {plot_path}")
    store.close()
    return results
