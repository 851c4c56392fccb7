"""Reuse fidelity evaluator on a tiny model: real ShareGPT turns, exact agreement in fp32."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_attnstore.cache.chat import ChatTokens, clip_text
from hf_attnstore.cache.upstream import cache_kwargs
from hf_attnstore.lab.data import load_sharegpt
from hf_attnstore.lab.evaluation.fidelity import FidelityResult, _compare, _generate, codec_fidelity, reuse_fidelity

from ...conftest import char_tokenizer, make_tiny


@torch.no_grad()
def separation(model, tokenizer, conversations: int = 6, new_tokens: int = 5) -> tuple[float, float]:
    """(largest |Δlogit| of a correct resume, smallest of a resume over a wholly different history), measured
    as the evaluator measures (`_compare`: greedy steps up to the first differing token) on the prompts it
    replays (ShareGPT second turns): the first turn is prefilled into a DynamicCache, or another conversation's
    first tokens are, and the whole prompt is generated over it."""
    chat, prompts = ChatTokens(tokenizer), []
    for conv in load_sharegpt(min_user_turns=2):
        first = chat.first_turn(clip_text(tokenizer, conv.user_turns[0], 40))
        prompts.append((first.shape[1], chat.next_turn(first, clip_text(tokenizer, conv.user_turns[1], 40))))
        if len(prompts) == conversations:
            break
    correct, wrong = 0.0, float("inf")
    for i, (cut, ids) in enumerate(prompts):
        ref, ref_logits = _generate(model, ids, DynamicCache(config=model.config), new_tokens, tokenizer.pad_token_id)
        other = next(p for j, (_, p) in enumerate(prompts) if j != i and p.shape[1] >= cut)
        for history, is_wrong in ((ids[:, :cut], False), (other[:, :cut], True)):
            cache = DynamicCache(config=model.config)
            model(history, **cache_kwargs(cache), use_cache=True)
            out, logits = _generate(model, ids, cache, new_tokens, tokenizer.pad_token_id)
            r = FidelityResult()
            _compare(r, "c", 2, out, ref, logits, ref_logits, ids.shape[1])
            correct, wrong = (correct, min(wrong, r.max_abs_logit_diff)) if is_wrong else \
                (max(correct, r.max_abs_logit_diff), wrong)
    return correct, wrong


def exact_tolerance(correct: float, wrong: float) -> float:
    """Between fp32 rounding and a wrong history: their geometric mean, with both sides 10x or more from it."""
    correct = max(correct, torch.finfo(torch.float32).eps)
    assert wrong > 100 * correct, (correct, wrong)
    return (correct * wrong) ** 0.5


def test_fp32_reuse_is_identical_on_real_turns():
    model, tokenizer = make_tiny("llama"), char_tokenizer()
    tol = exact_tolerance(*separation(model, tokenizer))  # here: correct ~1e-7, wrong >= 0.10, tol ~1e-4
    r = reuse_fidelity(model, tokenizer, turns=4, max_new_tokens=5, max_user_tokens=40, max_prompt_tokens=500,
                       progress=False)
    assert r.turns == 4 and r.identical == 4 and r.first_difference == []
    assert r.max_abs_logit_diff < tol, (r.max_abs_logit_diff, tol)
    assert 0 < r.reused_tokens < r.prompt_tokens


def test_codecs_are_compared_on_turns_resumed_from_their_cold_copies():
    """A lossy copy is not exact (above the fp32 tolerance) and moves the logits at most a quarter of what a wrong
    history does (here int4 ~8.6e-3, int8 ~6.4e-4, a wrong history >= 0.10): KV of another history, or at shifted
    positions, fails."""
    model, tokenizer = make_tiny("llama"), char_tokenizer()
    correct, wrong = separation(model, tokenizer)
    exact = exact_tolerance(correct, wrong)
    results = codec_fidelity(model, tokenizer, ("int8", "int4"), turns=3, max_new_tokens=5,
                             max_user_tokens=40, max_prompt_tokens=500, progress=False)
    assert set(results) == {"int8", "int4"}
    for name, r in results.items():
        assert r.turns == 3 and 0 < r.reused_tokens < r.prompt_tokens
        assert exact < r.max_abs_logit_diff < wrong / 4, (name, exact, r.max_abs_logit_diff, wrong)
    assert results["int8"].max_abs_logit_diff < results["int4"].max_abs_logit_diff


def test_compare_counts_a_difference_and_stops_logits_at_it():
    r = FidelityResult()
    out, ref = torch.tensor([[9, 1, 2, 3]]), torch.tensor([[9, 1, 5, 3]])
    logits = torch.zeros(3, 4)
    ref_logits = torch.zeros(3, 4)
    ref_logits[1, 0] = 0.5  # the step that chose the differing token
    ref_logits[2, 0] = 9.0  # after the difference: inputs differ, not counted
    _compare(r, "c", 2, out, ref, logits, ref_logits, prompt_len=1)
    assert (r.turns, r.identical, r.first_difference) == (1, 0, [("c", 2, 1)])
    assert r.max_abs_logit_diff == 0.5
