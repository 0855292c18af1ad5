"""Logging that cannot flood: once per key, or at most once per interval per key."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

#: Keys one `LogOnce` remembers. Keys may carry user data (a metric key, a run id), so the store is bounded: past
#: it the key logged longest ago is forgotten, and may log again, but only after this many other distinct keys.
MAX_KEYS = 1024


class LogOnce:
    """Log each key once per process (or once per `interval_s` when given), remembering at most `max_keys`."""

    def __init__(self, logger: logging.Logger, interval_s: float | None = None, max_keys: int = MAX_KEYS) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._max_keys = max(1, max_keys)
        self._last: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def should_log(self, key: str) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and (self._interval_s is None or now - last < self._interval_s):
                return False
            self._last[key] = now
            self._last.move_to_end(key)
            if len(self._last) > self._max_keys:
                self._last.popitem(last=False)
            return True

    def __len__(self) -> int:
        """How many keys are remembered now (at most `max_keys`)."""
        return len(self._last)

    def warning(self, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        if self.should_log(key):
            self._logger.warning(msg, *args, exc_info=exc_info)

    def error(self, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        if self.should_log(key):
            self._logger.error(msg, *args, exc_info=exc_info)
