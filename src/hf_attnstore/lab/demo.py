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


def run_demo(conversations: int = 3, turns: int = 4, max_new_tokens: int = 32, max_user_tokens: int = 128,
             model=None, tokenizer=None, echo=print) -> list[TurnResult]:
    """Replays the first multi-turn ShareGPT conversations and compares each turn with recomputation.

    Every turn runs twice with greedy decoding: once resuming from the store, once recomputing the whole
    history with a fresh `DynamicCache` (the baseline). TTFT includes the store lookup and KV loading.

    Example:
        >>> results = run_demo(conversations=1, turns=2, echo=lambda line: None)  # doctest: +SKIP
        >>> results[1].reused_tokens > 0, all(r.identical for r in results)  # doctest: +SKIP
        (True, True)
    """
    if model is None:
        model, tokenizer = load_default_model()
    chat = ChatTokens(tokenizer)
    store = AttnStore(host_bytes="2GiB")
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    results: list[TurnResult] = []
    # Warm up kernels and allocator so the first measured turn is not penalized.
    with torch.no_grad():
        model.generate(chat.first_turn("warm up"), max_new_tokens=2, **{k: v for k, v in gen.items() if k != "max_new_tokens"})
    echo(f"{'conversation':<14}{'turn':>5}{'prompt':>8}{'reused':>8}{'TTFT store':>12}{'TTFT recomp':>13}{'speedup':>9}  same")
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
                 f"{1000 * r.ttft_store:>10.0f}ms{1000 * r.ttft_recompute:>11.0f}ms"
                 f"{r.ttft_recompute / r.ttft_store:>8.1f}x  {'yes' if r.identical else 'NO'}")
            ids = out
    later = [r for r in results if r.turn >= 2]
    if later:
        store_ms = 1000 * statistics.mean(r.ttft_store for r in later)
        recompute_ms = 1000 * statistics.mean(r.ttft_recompute for r in later)
        echo(f"\nturns >= 2: mean TTFT {store_ms:.0f} ms with the store vs {recompute_ms:.0f} ms recomputing "
             f"({100 * (1 - store_ms / recompute_ms):.0f}% lower); "
             f"{sum(r.reused_tokens for r in later)} of {sum(r.prompt_tokens for r in later)} prompt tokens reused")
    echo(f"greedy outputs identical to recomputation: {sum(r.identical for r in results)}/{len(results)} turns")
    s = store.stats()
    echo(f"store: {s.sessions} sessions, {s.host_bytes_used / 2**20:.1f} MiB, {s.hits} hits / {s.misses} misses")
    return results
