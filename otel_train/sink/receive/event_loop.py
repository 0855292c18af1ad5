"""The one asyncio event loop both receivers (OTLP/gRPC and OTLP/HTTP) run on, in a thread of its own."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from otel_train._internal.ratelimit import LogOnce

__all__ = ["LoopThread"]

T = TypeVar("T")
_logger = logging.getLogger(__name__)
# asyncio reports each failed accept (descriptors exhausted: one per connection attempt) with a traceback;
# one line per kind of error a minute says the same without filling the disk.
_loop_errors = LogOnce(_logger, interval_s=60.0)


def _rate_limited(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    message = str(context.get("message") or "event loop error")
    err = context.get("exception")
    key = f"{message[:80]}:{type(err).__name__ if err is not None else ''}"
    _loop_errors.error(key, "%s%s (logged at most once a minute per kind)", message,
                       f": {type(err).__name__}: {err}" if err is not None else "")


class LoopThread:
    """An event loop running forever on a daemon thread; `run` executes a coroutine on it and waits.

    Example:
        >>> async def answer() -> int:
        ...     return 42
        >>> loop = LoopThread()
        >>> loop.run(answer(), timeout_s=5)
        42
        >>> loop.close()
    """

    def __init__(self, name: str = "otel-train-sink-receivers") -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_rate_limited)
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coro` on the loop and return its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        """Cancel what still runs on the loop (e.g. idle keep-alive connections), stop it and its thread;
        idempotent."""
        if self.loop.is_running():
            try:
                self.run(_cancel_others(), 10.0)
            except Exception:  # noqa: S110 - closing anyway
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


async def _cancel_others() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
