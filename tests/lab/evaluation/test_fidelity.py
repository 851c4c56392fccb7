"""Reuse fidelity evaluator on a tiny model: real ShareGPT turns, exact agreement in fp32."""

from __future__ import annotations

import torch

from hf_attnstore.lab.evaluation.fidelity import FidelityResult, _compare, codec_fidelity, reuse_fidelity

from ...conftest import char_tokenizer, make_tiny


def test_fp32_reuse_is_identical_on_real_turns():
    r = reuse_fidelity(make_tiny("llama"), char_tokenizer(), turns=4, max_new_tokens=5, max_user_tokens=40,
                       max_prompt_tokens=500, progress=False)
    assert r.turns == 4 and r.identical == 4 and r.first_difference == []
    assert r.max_abs_logit_diff < 1e-4
    assert 0 < r.reused_tokens < r.prompt_tokens


def test_codecs_are_compared_on_turns_resumed_from_their_cold_copies():
    results = codec_fidelity(make_tiny("llama"), char_tokenizer(), ("int8", "int4"), turns=3, max_new_tokens=5,
                             max_user_tokens=40, max_prompt_tokens=500, progress=False)
    assert set(results) == {"int8", "int4"}
    for r in results.values():
        assert r.turns == 3 and 0 < r.reused_tokens < r.prompt_tokens
        assert 0 < r.max_abs_logit_diff < 1.0  # lossy, never bit-identical, and close
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
