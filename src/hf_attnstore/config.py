"""Typed configuration shared by the cache and the store."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

TRUNCATION_MODES = ("decoupled", "recompute", "naive")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(value: int | float | str, name: str = "size") -> int:
    """Parses a byte size such as ``4096``, ``"512MiB"`` or ``"2GB"``.

    Args:
        value: An integer number of bytes or a string with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).
        name: The argument name, used in error messages.

    Returns:
        The size in bytes.

    Example:
        >>> parse_bytes("2GiB")
        2147483648
    """
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be a byte count or a string like '2GiB', got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite byte count, got {value!r}")
    if isinstance(value, (int, float)):
        size = int(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"`{name}`={value!r} is not a byte size: use a number of bytes or a string like '512MiB' or '2GB'"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"`{name}` must be a byte count or a string like '2GiB', got {type(value).__name__}")
    if size <= 0:
        raise ValueError(f"`{name}` must be positive, got {value!r}")
    return size


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
