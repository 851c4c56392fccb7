"""The sliding perplexity evaluator against direct computations on tiny models (exact, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_attnstore.cache.config import TruncationConfig
from hf_attnstore.lab.evaluation import CORPORA, load_texts, sliding_perplexity
from hf_attnstore.cache.truncation import tokens_to_drop

from ...conftest import char_tokenizer, make_tiny, random_ids


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama")


@torch.no_grad()
def reference_nll(model, ids, window, chunk, score_from, keep_first=4):
    """Token truncation done by hand: every turn recomputes its whole (truncated) prompt from scratch."""
    cfg = TruncationConfig(window, 0.5, keep_first, "recompute")
    history, last, nll, count = torch.empty(0, dtype=torch.long), None, 0.0, 0
    for start in range(0, ids.numel(), chunk):
        piece = ids[start : start + chunk]
        prompt = torch.cat([history, piece])
        drop = tokens_to_drop(prompt.numel(), cfg)
        prompt = torch.cat([prompt[:keep_first], prompt[keep_first + drop :]])
        logits = model(prompt[None]).logits[0]
        for j in range(piece.numel()):
            index = start + j
            pred = last if j == 0 else logits[-piece.numel() + j - 1]
            if pred is not None and index >= score_from:
                nll += float(F.cross_entropy(pred[None], piece[j : j + 1]))
                count += 1
        last, history = logits[-1], prompt
    return nll, count


def test_full_mode_equals_one_forward(model):
    ids = random_ids(90, 1)[0]
    result = sliding_perplexity(model, ids, context_window=40, chunk_tokens=16, mode="full")
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    nll = F.cross_entropy(logits[39:-1], ids[40:], reduction="sum")
    assert result.tokens == 50 and result.overflows == 0
    assert math.isclose(result.nll, float(nll), rel_tol=1e-5)


def test_recompute_mode_equals_token_truncation_by_hand(model):
    ids = random_ids(120, 2)[0]
    result = sliding_perplexity(model, ids, context_window=48, chunk_tokens=10, mode="recompute")
    nll, count = reference_nll(model, ids, 48, 10, score_from=48)
    assert result.tokens == count == 72
    assert result.overflows >= 2
    assert math.isclose(result.nll, nll, rel_tol=1e-5)


def test_without_overflow_every_mode_is_the_full_computation(model):
    ids = random_ids(60, 3)[0]
    full = sliding_perplexity(model, ids, context_window=100, chunk_tokens=7, mode="full", score_from=10)
    for mode in ("recompute", "decoupled", "importance", "naive", "naive-rotated"):
        r = sliding_perplexity(model, ids, context_window=100, chunk_tokens=7, mode=mode, score_from=10)
        assert r.overflows == 0 and r.tokens == full.tokens == 50
        assert math.isclose(r.nll, full.nll, rel_tol=1e-5), mode


def test_truncating_modes_differ_from_each_other(model):
    ids = random_ids(120, 4)[0]
    # keep_recent=8: the importance mode then chooses what to drop among most of the window.
    results = {m: sliding_perplexity(model, ids, context_window=48, chunk_tokens=10, mode=m, keep_recent=8)
               for m in ("recompute", "decoupled", "importance", "naive", "naive-rotated")}
    assert len({round(r.nll, 4) for r in results.values()}) == 5
    assert all(r.overflows == results["recompute"].overflows and math.isfinite(r.ppl) for r in results.values())


class TestBadInput:
    def test_unknown_mode(self, model):
        with pytest.raises(ValueError, match="unknown mode"):
            sliding_perplexity(model, random_ids(50, 0)[0], context_window=20, mode="fancy")

    def test_text_shorter_than_the_window(self, model):
        with pytest.raises(ValueError, match="longer texts"):
            sliding_perplexity(model, random_ids(20, 0)[0], context_window=20)

    def test_full_beyond_the_model_positions(self, model):
        with pytest.raises(ValueError, match="positions"):
            sliding_perplexity(model, random_ids(600, 0)[0], context_window=100, mode="full")


def test_corpora_are_deterministic_and_cut_to_length():
    tok = char_tokenizer()
    a = load_texts("pydoc", tok, 2, 300)
    b = load_texts("pydoc", tok, 2, 300)
    assert [t.shape for t in a] == [torch.Size([300])] * 2
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])
    assert tok.decode(a[0]).startswith(tok.decode(a[0][:20]))


def test_corpus_errors():
    tok = char_tokenizer()
    with pytest.raises(ValueError, match="unknown corpus"):
        load_texts("wiki", tok, 1, 10)
    with pytest.raises(ValueError, match="documents"):
        load_texts("pydoc", tok, 10**6, 10)
    assert set(CORPORA) == {"sharegpt", "pydoc"}


def test_a_lossy_cold_copy_moves_ppl_a_little_and_int4_more_than_int8(model):
    ids = random_ids(120, 4)[0]
    lossless = sliding_perplexity(model, ids, context_window=48, chunk_tokens=10, mode="decoupled")
    got = {c: sliding_perplexity(model, ids, context_window=48, chunk_tokens=10, mode="decoupled", kv_codec=c)
           for c in ("int8", "int4")}
    gaps = {c: abs(r.nll - lossless.nll) / lossless.nll for c, r in got.items()}
    assert all(r.overflows == lossless.overflows and r.tokens == lossless.tokens for r in got.values())
    assert 0 < gaps["int8"] < gaps["int4"] < 0.02, gaps
    with pytest.raises(ValueError, match="naive-rotated"):
        sliding_perplexity(model, ids, context_window=48, chunk_tokens=10, mode="naive-rotated", kv_codec="int8")
