"""What one session captures as OTel log records, installed by `init()` and removed by `shutdown()`.

One object owns every way a log record enters the run: the `logging` hook (`log_records`), the
uncaught-exception hooks (`uncaught`), the global OTel logger provider (`otel_logs`) and, with
`OTEL_TRAIN_CAPTURE_OUTPUT`, the stdout/stderr line capture (`output_lines`). All hand `CapturedLog`s to one
`target`, which a forked child swaps for its connection to the exporter process (`retarget`). One rate limit
(`OTEL_TRAIN_LOG_RATE`) covers them all; what it drops is counted in `rate_limited`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from otel_train.capture.log_records import CapturedLog, LogRecordHandler
from otel_train.capture.otel_logs import SESSION_LOGGER_PROVIDER, install_global
from otel_train.capture.output_lines import OutputLines
from otel_train.capture.uncaught import UncaughtHooks

__all__ = ["LogCapture"]


class LogCapture:
    """The session's log-record capture.

    Args:
        target: Takes each captured record (the training process's `LogBuffer.append_log`).
        level: The lowest `logging` level captured; None: no `logging` records (exceptions still are).
        rate_per_s: `OTEL_TRAIN_LOG_RATE`.
        capture_output: Also capture stdout/stderr lines (`OTEL_TRAIN_CAPTURE_OUTPUT`).
    """

    def __init__(self, target: Callable[[CapturedLog], None], level: int | None, rate_per_s: float,
                 capture_output: bool = False) -> None:
        self._target = target
        self.handler = LogRecordHandler(self._hand, level if level is not None else logging.WARNING, rate_per_s)
        self._handle_logging = level is not None
        self.hooks = UncaughtHooks(self._hand)
        self._capture_output = capture_output
        self._output: OutputLines | None = None

    def _hand(self, record: CapturedLog) -> None:
        self._target(record)

    def _hand_limited(self, record: CapturedLog, event: bool) -> None:
        """A raw OTel record: rate-limited as `logging` records are (events never)."""
        if event or self.handler.limit.allow():
            self._target(record)

    def install(self) -> None:
        if self._handle_logging:
            self.handler.install()
        self.hooks.install()
        if install_global():
            SESSION_LOGGER_PROVIDER.target = self._hand_limited
        if self._capture_output:
            lines = OutputLines(self._hand, self.handler.limit, self.handler.printing)
            lines.install()
            self._output = lines

    def retarget(self, target: Callable[[CapturedLog], None], on_drop: Callable[[], None] | None = None) -> None:
        """Hand records to `target` from now on (a forked child: its connection to the exporter process), and
        each record the rate limit drops to `on_drop`. The limit starts over: each process has its own budget,
        and the drops counted before the fork are the parent's to report."""
        self._target = target
        self.handler.limit.restart()
        self.handler.limit.on_drop = on_drop

    @property
    def rate_limited(self) -> int:
        """Records dropped by the rate limit so far."""
        return self.handler.limit.dropped

    def remove(self) -> None:
        """Stop capturing (idempotent): the earlier `logging`, exception hooks and streams are back."""
        self.handler.remove()
        self.hooks.remove()
        if SESSION_LOGGER_PROVIDER.target == self._hand_limited:
            SESSION_LOGGER_PROVIDER.target = None
        output, self._output = self._output, None
        if output is not None:
            output.remove()
