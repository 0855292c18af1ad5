"""The idempotency key of a received log record: a retried request (an acknowledgement lost) is recognised.

A log record has no id of its own (a span has its trace and span ids), so its key is a 64-bit digest of what the
sender sent: rank, step (as received, before the sink fills in a missing one), time (the record's, else its
observed time, as decoded), severity, body, logger, attributes and trace/span ids. A sender that retries sends
the same bytes, so the same key; two records differ in at least their time. `SeriesLedger.new_logs` keeps the keys
per run, bounded and persisted with the run's other state.
"""

from __future__ import annotations

import hashlib

from otel_train.vocab.rows import LogRow

__all__ = ["log_key"]


def log_key(record: LogRow) -> int:
    """The record's key (an unsigned 64-bit integer: msgpack stores it as is).

    Example:
        >>> from otel_train.vocab.run_identity import RunInfo
        >>> one = LogRow(RunInfo("r", "r"), 3, 1_700_000_000_000_000_000, 13, "WARN", "slow", "job", {"a": 1})
        >>> again = LogRow(RunInfo("r", "r"), 3, 1_700_000_000_000_000_000, 13, "WARN", "slow", "job", {"a": 1})
        >>> log_key(one) == log_key(again), log_key(one) == log_key(LogRow(RunInfo("r", "r"), 3, 1, 13, "WARN",
        ...                                                                 "slow", "job", {"a": 1}))
        (True, False)
    """
    text = repr((record.run.rank, record.step, record.time_unix_nano, record.severity_number,
                 record.severity_text, record.body, record.logger, sorted(record.attributes.items()),
                 record.trace_id, record.span_id))
    digest = hashlib.blake2b(text.encode("utf-8", "backslashreplace"), digest_size=8).digest()
    return int.from_bytes(digest, "big")
