"""Evaluation helpers shared by `eval/` scripts and the CLI."""

from .ppl import nll_after_overflow

__all__ = ["nll_after_overflow"]
