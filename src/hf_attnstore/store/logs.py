"""Warnings that are logged once per kind: a store or a model may hit the same condition every turn."""

from __future__ import annotations

import logging
import threading


class OnceLogger:
    """Logs each kind of warning once (thread-safe).

    Example:
        >>> once = OnceLogger(logging.getLogger(__name__))
        >>> once.warning("full", "disk full: %s", "/tmp/kv")  # logged
        >>> once.warning("full", "disk full: %s", "/tmp/kv")  # not again
    """

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def warning(self, kind: str, message: str, *args) -> None:
        with self._lock:
            if kind in self._seen:
                return
            self._seen.add(kind)
        self.logger.warning(message, *args)
