"""The cache side's typed configuration: how a session that overflows the context window is truncated."""

from __future__ import annotations

from dataclasses import dataclass

TRUNCATION_MODES = ("decoupled", "recompute", "naive")


@dataclass(frozen=True)
class TruncationConfig:
    """How a session that overflows the context window is truncated.

    Args:
        context_window: Maximum number of tokens the model may see. ``None`` disables truncation.
        truncation_ratio: Fraction of the window (after the sink tokens) dropped at each overflow; at least as
            many tokens as needed to fit are dropped.
        keep_first: Number of leading tokens always kept (attention sinks, usually the system prompt start).
        mode: ``"decoupled"`` (re-rotate the kept pre-RoPE keys, AttentionStore), ``"recompute"`` (token
            truncation: kept tokens are recomputed) or ``"naive"`` (kept keys keep their stale positions;
            an evaluation baseline only).

    Example:
        >>> config = TruncationConfig(context_window=2048, truncation_ratio=0.5, keep_first=4)
        >>> config.mode
        'decoupled'
    """

    context_window: int | None = None
    truncation_ratio: float = 0.5
    keep_first: int = 4
    mode: str = "decoupled"

    def __post_init__(self):
        if self.mode not in TRUNCATION_MODES:
            raise ValueError(f"`truncation`={self.mode!r} is unknown; choose one of {', '.join(TRUNCATION_MODES)}")
        if not 0.0 < float(self.truncation_ratio) <= 1.0:
            raise ValueError(f"`truncation_ratio` must be in (0, 1], got {self.truncation_ratio!r}")
        if not isinstance(self.keep_first, int) or self.keep_first < 0:
            raise ValueError(f"`keep_first` must be a non-negative integer, got {self.keep_first!r}")
        if self.context_window is not None:
            if not isinstance(self.context_window, int) or self.context_window < 2:
                raise ValueError(f"`context_window` must be an integer >= 2 or None, got {self.context_window!r}")
            if self.keep_first >= self.context_window:
                raise ValueError(
                    f"`keep_first` ({self.keep_first}) must be smaller than `context_window` "
                    f"({self.context_window}): the kept sink tokens alone would fill the window"
                )
