"""MMLU through lm-eval for each truncation mode (or sparse attention budget), plus fidelity to a reference.

A 135M model is close to chance on MMLU, so accuracy alone says little about whether a truncation mode
keeps the model's behaviour. Agreement (the same answer as the reference: ``recompute``, token truncation, when
it runs, else ``none``, the whole history) and the mean KL divergence of the 4-choice answer distribution from
the reference's measure fidelity whatever the model size.

A mode is a truncation (``none``, ``recompute``, ``decoupled``, ``naive``) or ``POLICY@BUDGET`` (``alisa@0.2``,
``h2o@0.2``, ``streaming@0.2``): the whole history, attended sparsely (`kv_budget`, 80% sparsity at 0.2).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


@dataclass
class ModeScores:
    """Per-question choice log-likelihoods of one mode, in document order.

    Example:
        >>> scores = ModeScores("decoupled", torch.tensor([[-1.0, -2.0], [-3.0, -0.5]]), torch.tensor([0, 0]), 1.5)
        >>> scores.accuracy  # right on the first question only
        0.5
    """

    mode: str
    choice_logprobs: torch.Tensor  # [questions, choices]
    targets: torch.Tensor  # [questions]
    seconds: float

    @property
    def accuracy(self) -> float:
        return float((self.choice_logprobs.argmax(-1) == self.targets).float().mean())


def agreement(a: ModeScores, b: ModeScores) -> float:
    """Fraction of questions where both modes pick the same answer.

    Example:
        >>> a = ModeScores("recompute", torch.tensor([[-1.0, -2.0], [-3.0, -0.5]]), torch.tensor([0, 1]), 1.0)
        >>> b = ModeScores("naive", torch.tensor([[-1.0, -2.0], [-0.5, -3.0]]), torch.tensor([0, 1]), 1.0)
        >>> agreement(a, b), agreement(a, a)
        (0.5, 1.0)
    """
    return float((a.choice_logprobs.argmax(-1) == b.choice_logprobs.argmax(-1)).float().mean())


def mean_kl(reference: ModeScores, other: ModeScores) -> float:
    """Mean KL(reference || other) of the answer distributions (softmax over the choices' log-likelihoods).

    Example:
        >>> a = ModeScores("recompute", torch.tensor([[-1.0, -2.0]]), torch.tensor([0]), 1.0)
        >>> b = ModeScores("decoupled", torch.tensor([[-1.0, -2.0]]) + 5, torch.tensor([0]), 1.0)  # same distribution
        >>> mean_kl(a, a), round(mean_kl(a, b), 12)
        (0.0, 0.0)
    """
    p = torch.log_softmax(reference.choice_logprobs.double(), -1)
    q = torch.log_softmax(other.choice_logprobs.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def scores_from_samples(mode: str, samples: list[dict], seconds: float) -> ModeScores:
    """Reads lm-eval's logged samples (``log_samples=True``) of a multiple-choice task.

    Example:
        >>> samples = [{"doc_id": 1, "filtered_resps": [["-0.5", False], ["-2.0", False]], "target": 1},
        ...            {"doc_id": 0, "filtered_resps": [["-1.0", False], ["-3.0", False]], "target": 0}]
        >>> scores = scores_from_samples("none", samples, seconds=2.0)
        >>> scores.choice_logprobs.tolist(), scores.targets.tolist(), scores.accuracy
        ([[-1.0, -3.0], [-0.5, -2.0]], [0, 1], 0.5)
    """
    samples = sorted(samples, key=lambda s: s["doc_id"])
    logprobs = torch.tensor([[float(r[0]) for r in s["filtered_resps"]] for s in samples])
    targets = torch.tensor([int(s["target"]) for s in samples])
    return ModeScores(mode, logprobs, targets, seconds)


def run_mmlu(model, tokenizer, *, modes=("none", "recompute", "decoupled", "naive"), limit: int | None = 500,
             context_window: int = 1024, keep_first: int = 4, task: str = "mmlu_offline",
             print_fn=print) -> dict[str, ModeScores]:
    """Runs `task` through lm-eval once per mode with the same model, and prints a Markdown table.

    Returns:
        ``{mode: ModeScores}``.
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from .harness import TASKS_DIR, AttnStoreLM

    manager = TaskManager(include_path=str(TASKS_DIR))
    results: dict[str, ModeScores] = {}
    for mode in modes:
        started = time.perf_counter()
        lm = AttnStoreLM(pretrained=model, tokenizer=tokenizer, context_window=context_window, keep_first=keep_first,
                         **mode_options(mode))
        out = simple_evaluate(model=lm, tasks=[task], limit=limit, log_samples=True, task_manager=manager,
                              bootstrap_iters=0)
        results[mode] = scores_from_samples(mode, out["samples"][task], time.perf_counter() - started)
    n = len(next(iter(results.values())).targets)
    name = next((m for m in ("recompute", "none") if m in results), None)
    ref = results.get(name)
    print_fn(f"\n{task}: {n} questions (0-shot), window {context_window}, filler {context_window - 1} tokens, "
             f"keep_first {keep_first}")
    print_fn(f"| mode | accuracy | agreement with {name} | mean KL vs {name} | time |\n| --- | --- | --- | --- | --- |")
    for mode, s in results.items():
        agree = f"{100 * agreement(s, ref):.1f}%" if ref is not None else ""
        kl = f"{mean_kl(ref, s):.2e}" if ref is not None else ""
        print_fn(f"| {mode} | {100 * s.accuracy:.1f}% ± {100 * _stderr(s.accuracy, n):.1f} | {agree} | {kl} | "
                 f"{s.seconds:.0f} s |")
    return results


def mode_options(mode: str) -> dict:
    """The `AttnStoreLM` options of a mode: a truncation, or ``POLICY@BUDGET`` (the whole history, sparse).

    Example:
        >>> mode_options("decoupled"), mode_options("alisa@0.2")
        ({'truncation': 'decoupled'}, {'truncation': 'none', 'kv_budget': 0.2, 'sparse_policy': 'alisa'})
    """
    if "@" not in mode:
        return {"truncation": mode}
    policy, _, budget = mode.partition("@")
    try:
        fraction = float(budget)
    except ValueError:
        raise ValueError(f"mode {mode!r}: the budget after '@' must be a fraction of the history, e.g. alisa@0.2")
    return {"truncation": "none", "kv_budget": fraction, "sparse_policy": policy}


def _stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")
