"""Perplexity against KV sparsity (lab/evaluation/sparsity.py) on a tiny model: exact where the answer is known."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_attnstore.cache.config import SparseConfig
from hf_attnstore.lab.evaluation.sparsity import sparse_perplexity, sparsity_report

from ...conftest import make_tiny, random_ids


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama")


@pytest.mark.parametrize("protocol", ["turns", "turn"])
def test_dense_and_a_whole_budget_equal_one_forward(model, protocol):
    ids = random_ids(100, 1)[0]
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    nll = float(F.cross_entropy(logits[29:-1], ids[30:], reduction="sum"))
    for config in (None, SparseConfig(1.0), SparseConfig(1.0, policy="h2o")):
        result = sparse_perplexity(model, ids, config, chunk_tokens=9, score_from=30, protocol=protocol)
        assert result.tokens == 70
        assert math.isclose(result.nll, nll, rel_tol=1e-5), config


def test_streaming_is_the_same_in_both_protocols(model):
    # Sinks and a recent window: what one turn drops never comes back, so a session resumed turn by turn keeps
    # exactly what one long turn keeps.
    ids = random_ids(120, 2)[0]
    config = SparseConfig(0.3, policy="streaming")
    turns = sparse_perplexity(model, ids, config, chunk_tokens=10, score_from=20, protocol="turns")
    turn = sparse_perplexity(model, ids, config, chunk_tokens=10, score_from=20, protocol="turn")
    assert math.isclose(turns.nll, turn.nll, rel_tol=1e-5)


def test_sparsity_changes_the_result_and_the_policies_differ(model):
    ids = random_ids(120, 3)[0]
    dense = sparse_perplexity(model, ids, None, chunk_tokens=10, score_from=20)
    sparse = {policy: sparse_perplexity(model, ids, SparseConfig(0.2, policy=policy), chunk_tokens=10, score_from=20)
              for policy in ("streaming", "alisa", "h2o")}
    assert all(r.tokens == dense.tokens == 100 and math.isfinite(r.ppl) for r in sparse.values())
    assert len({round(r.nll, 4) for r in [dense, *sparse.values()]}) == 4


def test_report_rows(model, monkeypatch):
    import hf_attnstore.lab.evaluation.corpora as corpora

    texts = [random_ids(80, 5)[0], random_ids(80, 6)[0]]
    monkeypatch.setattr(corpora, "load_texts", lambda corpus, tokenizer, n, length: texts[:n])
    lines = []
    rows = sparsity_report(model, None, corpora=("pydoc",), texts=2, length=80, sparsities=(0.5, 0.8),
                           policies=("dense", "streaming"), chunk_tokens=10, score_from=20, print_fn=lines.append)
    assert set(rows["pydoc"]) == {("dense", 0.0), ("streaming", 0.5), ("streaming", 0.8)}
    assert rows["pydoc"][("dense", 0.0)].tokens == 120
    assert sum(line.startswith("| streaming |") for line in lines) == 2


class TestBadInput:
    def test_unknown_protocol(self, model):
        with pytest.raises(ValueError, match="unknown protocol"):
            sparse_perplexity(model, random_ids(50, 0)[0], None, protocol="fancy")

    def test_bad_chunk(self, model):
        with pytest.raises(ValueError, match="chunk_tokens"):
            sparse_perplexity(model, random_ids(50, 0)[0], None, chunk_tokens=0)

    def test_text_too_short(self, model):
        with pytest.raises(ValueError, match="nothing after token"):
            sparse_perplexity(model, random_ids(50, 0)[0], None, score_from=50)
