"""Reuse without truncation: greedy turns resumed from the store vs full recomputation, on ShareGPT.

Each conversation is replayed turn by turn. The reference recomputes the whole history with a fresh
``DynamicCache``; the store path resumes the same prompt from stored KV. Both see the same prompt every
turn (the reference's own history), so a difference can only come from reuse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ...cache.cache import AttnStoreCache
from ...cache.chat import ChatTokens, clip_text
from ..data import load_sharegpt
from ...store import AttnStore, StoreTuning
from ...cache.upstream import cache_kwargs


@dataclass
class FidelityResult:
    """What reuse changed, over the resumed turns (a conversation's first turn has nothing to reuse).

    Attributes:
        turns: Resumed turns compared.
        identical: Turns whose greedy tokens equal the recomputation's.
        max_abs_logit_diff: Largest |Δlogit| over all compared decoding steps (steps up to the first
            differing token; the logits after it have different inputs).
        reused_tokens / prompt_tokens: Totals over the resumed turns.
        first_difference: ``(conversation, turn, step)`` of each turn that differed.

    Example:
        >>> result = FidelityResult(turns=4, identical=3, max_abs_logit_diff=0.02, reused_tokens=900,
        ...                         prompt_tokens=1000)
        >>> result.identical_fraction, result.reused_tokens / result.prompt_tokens
        (0.75, 0.9)
    """

    turns: int = 0
    identical: int = 0
    max_abs_logit_diff: float = 0.0
    reused_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    first_difference: list = field(default_factory=list)

    @property
    def identical_fraction(self) -> float:
        return self.identical / self.turns if self.turns else float("nan")


def _generate(model, ids, cache, max_new_tokens: int, pad: int):
    out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, dim=1)[0].float()  # [steps, vocab]


@torch.no_grad()
def reuse_fidelity(model, tokenizer, *, turns: int = 200, max_new_tokens: int = 16, max_user_tokens: int = 256,
                   max_turns_per_conversation: int = 8, max_prompt_tokens: int = 4096,
                   progress: bool = True) -> FidelityResult:
    """Compares `turns` resumed turns of real ShareGPT conversations with full recomputation.

    Args:
        model, tokenizer: A chat model and its tokenizer (with a chat template).
        turns: Resumed turns to compare (first turns of conversations are run but not counted).
        max_new_tokens: Greedy tokens generated per turn.
        max_user_tokens: User messages are clipped to this many tokens.
        max_turns_per_conversation: User turns replayed per conversation at most.
        max_prompt_tokens: A conversation stops before its prompt grows past this.
        progress: Show a progress bar.

    Example:
        >>> from hf_attnstore import load_default_model
        >>> model, tokenizer = load_default_model()  # doctest: +SKIP
        >>> result = reuse_fidelity(model, tokenizer, turns=10, progress=False)  # doctest: +SKIP
        >>> result.turns, result.identical_fraction  # doctest: +SKIP
        (10, 1.0)
    """
    store = AttnStore(host_bytes=2**62)
    try:
        return _replay(model, tokenizer, {"host": (store, False)}, turns, max_new_tokens, max_user_tokens,
                       max_turns_per_conversation, max_prompt_tokens, progress)["host"]
    finally:
        store.close()


@torch.no_grad()
def codec_fidelity(model, tokenizer, codecs=("int8", "int4"), *, turns: int = 200, max_new_tokens: int = 16,
                   max_user_tokens: int = 256, max_turns_per_conversation: int = 8, max_prompt_tokens: int = 4096,
                   progress: bool = True) -> dict[str, FidelityResult]:
    """Like :func:`reuse_fidelity`, with every turn resumed from a cold copy stored with each codec in `codecs`.

    After each turn the session is flushed to a disk tier (``kv_codec``) and evicted from host memory, so the
    next turn loads its whole history from the lossy copy: the worst case, a session that always went cold.
    All codecs are compared with the same recomputation, turn by turn.

    Example:
        >>> from hf_attnstore import load_default_model
        >>> model, tokenizer = load_default_model()  # doctest: +SKIP
        >>> results = codec_fidelity(model, tokenizer, ("int8",), turns=10, progress=False)  # doctest: +SKIP
        >>> sorted(results), results["int8"].turns  # doctest: +SKIP
        (['int8'], 10)
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="attnstore-codec-") as root:
        stores = {name: AttnStore(host_bytes=2**62, disk_dir=f"{root}/{name}", kv_codec=name,
                                  tuning=StoreTuning(fsync=False, idle_flush_s=0.05)) for name in codecs}
        try:
            return _replay(model, tokenizer, {name: (store, True) for name, store in stores.items()}, turns,
                           max_new_tokens, max_user_tokens, max_turns_per_conversation, max_prompt_tokens, progress)
        finally:
            for store in stores.values():
                store.close()


def _replay(model, tokenizer, variants: dict, turns: int, max_new_tokens: int, max_user_tokens: int,
            max_turns_per_conversation: int, max_prompt_tokens: int, progress: bool) -> dict[str, FidelityResult]:
    """Replays ShareGPT turns through each variant ``name -> (store, cold)`` against one recomputation; a cold
    variant's session is flushed and evicted after each turn."""
    from tqdm.auto import tqdm

    chat = ChatTokens(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    results = {name: FidelityResult() for name in variants}
    started = time.perf_counter()
    bar = tqdm(total=turns, desc="resumed turns", disable=not progress)
    for conv in load_sharegpt(min_user_turns=2):
        ids = None
        for turn, message in enumerate(conv.user_turns[:max_turns_per_conversation], start=1):
            message = clip_text(tokenizer, message, max_user_tokens)
            ids = chat.first_turn(message) if ids is None else chat.next_turn(ids, message)
            if ids.shape[1] + max_new_tokens > max_prompt_tokens:
                break
            ref, ref_logits = _generate(model, ids, DynamicCache(config=model.config), max_new_tokens, pad)
            for name, (store, cold) in variants.items():
                cache = AttnStoreCache(model, store, conv.id, ids)
                out, logits = _generate(model, cache.input_ids, cache, max_new_tokens, pad)
                cache.close()
                if cold:
                    store.flush()
                    store.evict(conv.id)
                if turn > 1:
                    result = results[name]
                    _compare(result, conv.id, turn, out, ref, logits, ref_logits, ids.shape[1])
                    result.reused_tokens += cache.reused_tokens
                    result.prompt_tokens += ids.shape[1]
            if turn > 1:
                bar.update(1)
                if next(iter(results.values())).turns == turns:
                    bar.close()
                    for result in results.values():
                        result.seconds = time.perf_counter() - started
                    return results
            ids = ref
    bar.close()
    raise ValueError(f"ShareGPT ran out after {next(iter(results.values())).turns} resumed turns: ask for fewer")


def _compare(result: FidelityResult, conv: str, turn: int, out, ref, logits, ref_logits, prompt_len: int) -> None:
    gen, ref_gen = out[0, prompt_len:], ref[0, prompt_len:]
    n = min(gen.numel(), ref_gen.numel())
    differs = (gen[:n] != ref_gen[:n]).nonzero()
    same = gen.numel() == ref_gen.numel() and differs.numel() == 0
    # Logits up to and including the first differing step had identical inputs.
    steps = n if differs.numel() == 0 else int(differs[0, 0]) + 1
    diff = (logits[:steps] - ref_logits[:steps]).abs().max()
    result.turns += 1
    result.identical += int(same)
    result.max_abs_logit_diff = max(result.max_abs_logit_diff, float(diff))
    if not same:
        result.first_difference.append((conv, turn, steps - 1))
