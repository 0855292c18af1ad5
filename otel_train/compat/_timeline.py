"""Per-step Chrome trace files for `tracking_utils`' ``args.timeline_dump_dir``.

`TimelineDump` is an exporter that keeps the spans it is given; when step N is flushed,
`write_step` writes ``timeline_step_<N>.json`` with the spans that ended since the previous flush
(those belong to step N, as everything logged between two flushes does) plus the raw Chrome trace
events (``ph`` ``B``/``E``/``X``) logged for that step under the metric name ``timeline``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train.backend import RowExporter
from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.chrome_trace import json_safe, span_event
from otel_train.vocab.rows import SpanRow

__all__ = ["RAW_PHASES", "TimelineDump", "raw_events"]

_logger = logging.getLogger(__name__)

RAW_PHASES = frozenset({"B", "E", "X"})


def raw_events(value: Any) -> list[dict[str, Any]]:
    """The Chrome trace events in a logged ``timeline`` value (one event or a list); others are skipped."""
    items: Iterable[Any] = [value] if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return [dict(e) for e in items if isinstance(e, Mapping) and e.get("ph") in RAW_PHASES]


class TimelineDump(RowExporter):
    """Writes ``timeline_step_<N>.json`` into `directory` when step N is flushed.

    Args:
        directory: Where the files go (created).

    Example:
        >>> import tempfile
        >>> dump = TimelineDump(tempfile.mkdtemp())
        >>> dump.write_step(3, until_ns=0, events=[{"name": "fwd", "ph": "X", "ts": 0, "dur": 5, "pid": 0, "tid": 1}])
        >>> [e["name"] for e in json.loads((dump.directory / "timeline_step_3.json").read_text())["traceEvents"]]
        ['fwd']
    """

    name = "timeline_dump"
    handles_metrics = False
    handles_spans = True

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(ExporterOptions())
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._spans: list[SpanRow] = []
        self._spans_lock = threading.Lock()

    def write_spans(self, rows: Sequence[SpanRow]) -> None:
        with self._spans_lock:
            self._spans.extend(rows)

    def write_step(self, step: int, until_ns: int, events: Sequence[Mapping[str, Any]] = ()) -> None:
        """Write step `step`'s file: spans that ended by `until_ns` (not yet written) plus `events`."""
        with self._spans_lock:
            mine = [s for s in self._spans if s.end_unix_nano <= until_ns]
            self._spans = [s for s in self._spans if s.end_unix_nano > until_ns]
        trace: list[dict[str, Any]] = [span_event(s, s.run.rank, s.thread_id) for s in mine]
        trace.extend({k: json_safe(v) for k, v in e.items()} for e in events)
        path = self.directory / f"timeline_step_{step}.json"
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
            os.replace(tmp, path)  # a reader never sees half a file
        except OSError as err:
            self._log.error("write", "timeline dump: cannot write %s (%s); logged at most once a minute", path, err)

