"""Evaluation helpers shared by `eval/` scripts and the CLI."""

from .corpora import CORPORA, corpus_description, load_texts
from .ppl import MODES, VARIANTS, PerplexityResult, perplexity_report, sliding_perplexity

__all__ = ["CORPORA", "MODES", "PerplexityResult", "VARIANTS", "perplexity_report", "corpus_description", "load_texts", "sliding_perplexity"]
