"""Recall across turns (lab/evaluation/recall.py) on a tiny model with a character tokenizer."""

from __future__ import annotations

import math

from hf_attnstore.cache.config import SparseConfig
from hf_attnstore.lab.evaluation.recall import recall_across_turns, recall_chats

from ...conftest import char_tokenizer, make_tiny


def test_chats_state_the_fact_first_and_ask_last():
    chats = recall_chats(char_tokenizer(), trials=3, filler_turns=2, filler_tokens=20)
    assert len(chats) == 3 and len({code for *_, code in chats}) == 3
    for messages, question, start, code in chats:
        assert code in messages[0]["content"] and len(messages) == 2 + 2 * 2
        assert all(len(m["content"]) <= 20 for m in messages[2:])  # one character per token
        assert question["role"] == "user" and start.split()[-1] == "is"


def test_a_whole_budget_recalls_exactly_as_dense():
    model, tokenizer = make_tiny("llama"), char_tokenizer()
    results = recall_across_turns(model, tokenizer, {"dense": None, "whole": SparseConfig(1.0)}, trials=2,
                                  filler_turns=1, filler_tokens=12)
    assert results["dense"].trials == results["whole"].trials == 2
    assert math.isfinite(results["dense"].nll) and results["dense"].nll > 0
    assert math.isclose(results["dense"].nll, results["whole"].nll, rel_tol=1e-5)
    assert results["dense"].correct == results["whole"].correct
