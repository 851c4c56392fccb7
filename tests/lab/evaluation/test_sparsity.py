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


@pytest.mark.parametrize("protocol", ["turns", "turn", "decode"])
def test_dense_and_a_whole_budget_equal_one_forward(model, protocol):
    ids = random_ids(100, 1)[0]
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    nll = float(F.cross_entropy(logits[29:-1], ids[30:], reduction="sum"))
    for config in (None, SparseConfig(1.0), SparseConfig(1.0, policy="h2o"), SparseConfig(1.0, policy="sparq"),
                   SparseConfig(1.0, policy="oracle")):
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
    policies = ("streaming", "alisa", "h2o", "quest", "sparq", "oracle")
    sparse = {policy: sparse_perplexity(model, ids, SparseConfig(0.2, policy=policy, page_tokens=4), chunk_tokens=10,
                                        score_from=20) for policy in policies}
    assert all(r.tokens == dense.tokens == 100 and math.isfinite(r.ppl) for r in sparse.values())
    assert len({round(r.nll, 4) for r in [dense, *sparse.values()]}) == 1 + len(policies)


def test_decoding_token_by_token_scores_each_token_after_the_prefill(model, monkeypatch):
    """The decode protocol: one forward of the first tokens, then one forward per token, each scored by the logit
    before it; a sparse policy changes the result (it selects at every step)."""
    ids = random_ids(60, 4)[0]
    forwards = []
    original = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: forwards.append(1) or original(*a, **k))
    dense = sparse_perplexity(model, ids, None, score_from=40, protocol="decode")
    assert dense.tokens == 20 and len(forwards) == 1 + 20
    oracle = sparse_perplexity(model, ids, SparseConfig(0.2, policy="oracle"), score_from=40, protocol="decode")
    assert oracle.tokens == 20 and not math.isclose(oracle.nll, dense.nll, rel_tol=1e-4)


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


def test_the_report_runs_the_oracle_first_and_reads_every_loss_against_it(model, monkeypatch):
    import hf_attnstore.lab.evaluation.corpora as corpora
    import hf_attnstore.lab.evaluation.sparsity as sparsity
    from hf_attnstore.lab.evaluation.ppl import PerplexityResult

    monkeypatch.setattr(corpora, "load_texts", lambda corpus, tokenizer, n, length: [random_ids(90, 7)[0]])
    ran = []
    ppl = {None: 10.0, "oracle": 11.0, "streaming": 13.0}  # losses: oracle 1, streaming 3

    def fake(model, ids, config, **kwargs):
        ran.append(None if config is None else config.policy)
        return PerplexityResult(nll=100 * math.log(ppl[ran[-1]]), tokens=100)

    monkeypatch.setattr(sparsity, "sparse_perplexity", fake)
    lines = []
    sparsity_report(model, None, corpora=("pydoc",), texts=1, length=90, sparsities=(0.8,),
                    policies=("streaming", "oracle", "dense"), print_fn=lines.append)
    assert ran == [None, "oracle", "streaming"]
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| policy")]
    assert [line.split(" | ")[:5] for line in table] == [["| dense", "0%", "10.000", "", ""],
                                                         ["| oracle", "80%", "11.000", "+10.00%", ""],
                                                         ["| streaming", "80%", "13.000", "+30.00%", "3.0x"]]


def test_layer_slopes_add_a_pyramid_row_per_query_aware_policy_read_against_the_uniform_oracle(model, monkeypatch):
    import hf_attnstore.lab.evaluation.corpora as corpora
    import hf_attnstore.lab.evaluation.sparsity as sparsity
    from hf_attnstore.lab.evaluation.ppl import PerplexityResult

    monkeypatch.setattr(corpora, "load_texts", lambda corpus, tokenizer, n, length: [random_ids(90, 7)[0]])
    ran = []
    ppl = {(None, 0.0): 10.0, ("oracle", 0.0): 11.0, ("oracle", 0.5): 12.0, ("sparq", 0.0): 10.5,
           ("sparq", 0.5): 12.0, ("alisa", 0.0): 13.0}

    def fake(model, ids, config, **kwargs):
        ran.append((None, 0.0) if config is None else (config.policy, config.layer_slope))
        return PerplexityResult(nll=100 * math.log(ppl[ran[-1]]), tokens=100)

    monkeypatch.setattr(sparsity, "sparse_perplexity", fake)
    lines = []
    rows = sparsity_report(model, None, corpora=("pydoc",), texts=1, length=90, sparsities=(0.8,),
                           policies=("dense", "oracle", "alisa", "sparq"), layer_slopes=(0.5,), print_fn=lines.append)
    assert ran == [(None, 0.0), ("oracle", 0.0), ("oracle", 0.5), ("alisa", 0.0), ("sparq", 0.0), ("sparq", 0.5)]
    assert ("sparq pyramid 0.5", 0.8) in rows["pydoc"]
    table = [line.split(" | ")[:5] for line in lines if line.startswith("| ") and not line.startswith("| policy")]
    assert table[2] == ["| oracle pyramid 0.5", "80%", "12.000", "+20.00%", "2.0x"]  # against the uniform oracle
    assert table[5] == ["| sparq pyramid 0.5", "80%", "12.000", "+20.00%", "2.0x"]


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
