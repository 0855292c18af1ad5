"""Logging that cannot flood: once per key, or at most once per interval per key."""

from __future__ import annotations

import logging
import threading
import time


class LogOnce:
    """Log each key once per process (or once per `interval_s` when given)."""

    def __init__(self, logger: logging.Logger, interval_s: float | None = None) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def should_log(self, key: str) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and (self._interval_s is None or now - last < self._interval_s):
                return False
            self._last[key] = now
            return True

    def warning(self, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        if self.should_log(key):
            self._logger.warning(msg, *args, exc_info=exc_info)

    def error(self, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        if self.should_log(key):
            self._logger.error(msg, *args, exc_info=exc_info)
