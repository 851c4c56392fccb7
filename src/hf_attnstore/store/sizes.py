"""Byte sizes given as numbers or strings ("4GiB"): one parser for every size the store and the CLI take."""

from __future__ import annotations

import math
import re

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
