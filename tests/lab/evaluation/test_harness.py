"""The lm-eval model `attnstore`: exact scores against direct computation, and an end-to-end lm-eval run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_attnstore import AttnStoreCache
from hf_attnstore.cache.config import TruncationConfig
from hf_attnstore.lab.evaluation.harness import TASKS_DIR, AttnStoreLM
from hf_attnstore.cache.truncation import tokens_to_drop

from ...conftest import char_tokenizer, make_tiny


@pytest.fixture(scope="module")
def parts():
    return make_tiny("llama"), char_tokenizer()


def lm(parts, **kwargs):
    model, tok = parts
    return AttnStoreLM(pretrained=model, tokenizer=tok, context_window=kwargs.pop("context_window", 96), **kwargs)


def requests_of(lm_, pairs):
    return [((c, x), *lm_._encode_pair(c, x)) for c, x in pairs]


@torch.no_grad()
def by_hand(model, filler, context, continuation, window, keep_first=4):
    """Token truncation by hand: the truncated filler and the request recomputed in one plain forward."""
    ids = torch.tensor(filler.tolist() + context + continuation)
    if window is not None:
        drop = tokens_to_drop(ids.numel(), TruncationConfig(window, 0.5, keep_first, "recompute"))
        ids = torch.cat([ids[:keep_first], ids[keep_first + drop :]])
    logp = F.log_softmax(model(ids[None]).logits[0, -len(continuation) - 1 : -1], -1)
    return float(logp.gather(1, torch.tensor(continuation)[:, None]).sum())


PAIRS = [("Question: 2+2?\nAnswer:", " A"), ("Question: 2+2?\nAnswer:", " B"), ("Question: 2+2?\nAnswer:", " C"),
         ("Another one", " is longer"), ("Another one", " x"), ("Q", " yes")]


@pytest.mark.parametrize("truncation, window", [("recompute", 96), ("none", None)])
def test_scores_equal_a_direct_computation(parts, truncation, window):
    model = parts[0]
    m = lm(parts, truncation=truncation)
    reqs = requests_of(m, PAIRS)
    got = m._loglikelihood_tokens(reqs, disable_tqdm=True)
    for (_, ctx, cont), (logprob, _) in zip(reqs, got):
        assert math.isclose(logprob, by_hand(model, m._filler, ctx, cont, window), rel_tol=1e-4, abs_tol=1e-4)


def test_grouped_single_token_choices_equal_separate_requests(parts):
    m = lm(parts, truncation="decoupled")
    reqs = requests_of(m, PAIRS)
    together = m._loglikelihood_tokens(reqs, disable_tqdm=True)
    alone = [m._loglikelihood_tokens([r], disable_tqdm=True)[0] for r in reqs]
    assert [round(a[0], 5) for a in together] == [round(b[0], 5) for b in alone]
    assert [a[1] for a in together] == [b[1] for b in alone]


def test_modes_see_different_contexts_and_the_store_keeps_the_filler(parts):
    scores = {}
    for mode in ("none", "recompute", "decoupled", "naive"):
        m = lm(parts, truncation=mode)
        scores[mode] = m._loglikelihood_tokens(requests_of(m, PAIRS[:1]), disable_tqdm=True)[0][0]
        stored = m._store.token_ids("filler", AttnStoreCache.fingerprint_of(m.model))
        assert torch.equal(stored, m._filler)  # read-only turns never modified it
    assert len({round(s, 4) for s in scores.values()}) == 4


def test_a_lossy_filler_is_read_back_from_its_cold_copy(parts):
    lossless = lm(parts, truncation="decoupled")
    want = [s for s, _ in lossless._loglikelihood_tokens(requests_of(lossless, PAIRS), disable_tqdm=True)]
    m = lm(parts, truncation="decoupled", kv_codec="int8")
    got = [s for s, _ in m._loglikelihood_tokens(requests_of(m, PAIRS), disable_tqdm=True)]
    assert m._store.stats().hits_disk == 1  # the first request loaded the lossy copy; the rest reuse it in memory
    assert got != want and all(math.isclose(a, b, rel_tol=0.02, abs_tol=0.02) for a, b in zip(got, want))


def test_the_history_is_attended_within_its_budget(parts):
    """`kv_budget`: the requests attend to the stored filler sparsely, by the scores stored with it; the whole
    budget is the dense history."""
    dense = lm(parts, truncation="none")
    want = [s for s, _ in dense._loglikelihood_tokens(requests_of(dense, PAIRS), disable_tqdm=True)]
    for policy in ("alisa", "h2o"):
        whole = lm(parts, truncation="none", kv_budget=1.0, sparse_policy=policy)
        got = [s for s, _ in whole._loglikelihood_tokens(requests_of(whole, PAIRS), disable_tqdm=True)]
        assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(got, want))
        sparse = lm(parts, truncation="none", kv_budget=0.2, sparse_policy=policy)
        got = [s for s, _ in sparse._loglikelihood_tokens(requests_of(sparse, PAIRS), disable_tqdm=True)]
        assert all(math.isfinite(a) for a in got) and got != want


def test_a_context_longer_than_the_window_is_cut_from_the_left(parts):
    m = lm(parts, truncation="decoupled", context_window=64)
    long_ctx = "x" * 200
    (logprob, _), = m._loglikelihood_tokens(requests_of(m, [(long_ctx, " A")]), disable_tqdm=True)
    assert math.isfinite(logprob) and m._truncated_requests == 1


class TestBadInput:
    def test_unknown_truncation(self, parts):
        with pytest.raises(ValueError, match="unknown truncation"):
            lm(parts, truncation="fancy")

    def test_filler_must_fit_the_window(self, parts):
        with pytest.raises(ValueError, match="filler_tokens"):
            lm(parts, filler_tokens=200)

    def test_model_object_needs_its_tokenizer(self, parts):
        with pytest.raises(ValueError, match="tokenizer"):
            AttnStoreLM(pretrained=parts[0])

    def test_rolling_loglikelihood_points_to_the_ppl_command(self, parts):
        with pytest.raises(NotImplementedError, match="attnstore eval ppl"):
            lm(parts).loglikelihood_rolling([])


def test_lm_eval_runs_mmlu_offline_end_to_end(parts):
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    assert get_model("attnstore") is AttnStoreLM
    m = lm(parts, truncation="decoupled", context_window=512)
    out = simple_evaluate(model=m, tasks=["mmlu_offline"], limit=3, log_samples=True,
                          task_manager=TaskManager(include_path=str(TASKS_DIR)))
    acc = out["results"]["mmlu_offline"]["acc,none"]
    samples = out["samples"]["mmlu_offline"]
    assert len(samples) == 3 and 0.0 <= acc <= 1.0
    # Interleaved subjects: the first three questions come from three different subjects.
    assert len({s["doc"]["subject"] for s in samples}) == 3
    assert all(len(s["resps"]) == 4 for s in samples)
    assert acc == sum(s["acc"] for s in samples) / 3


def test_mmlu_report_agreement_and_kl(parts):
    from hf_attnstore.lab.evaluation.mmlu import ModeScores, agreement, mean_kl, run_mmlu

    a = ModeScores("a", torch.tensor([[0.0, -1.0, -2.0, -3.0], [-1.0, 0.0, -2.0, -3.0]]), torch.tensor([0, 0]), 0.0)
    b = ModeScores("b", torch.tensor([[0.0, -1.0, -2.0, -3.0], [0.0, -1.0, -2.0, -3.0]]), torch.tensor([0, 0]), 0.0)
    assert a.accuracy == 0.5 and b.accuracy == 1.0
    assert agreement(a, b) == 0.5 and agreement(a, a) == 1.0
    assert mean_kl(a, a) == 0.0 and mean_kl(a, b) > 0
    lines = []
    results = run_mmlu(*parts, modes=("recompute", "decoupled"), limit=2, context_window=256, print_fn=lines.append)
    assert set(results) == {"recompute", "decoupled"} and results["recompute"].choice_logprobs.shape == (2, 4)
    assert any(line.startswith("| recompute | ") and "100.0%" in line for line in lines)
