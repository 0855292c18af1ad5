"""The old Metrics Service REST API, served by the sink under ``/metrics/``.

Values are buffered per run, rank and step until ``POST /metrics/report_step`` writes that step
to the run's backends (as the old service did); `close` writes whatever is still buffered.

Run identity: ``run_id``, ``rank``, ``world_size`` and ``run_name`` are read from the request's
top-level fields or from its ``tags`` (top level wins); without them the run id is ``compat``,
rank 0 of 1. Other tags become series attributes (``train/loss{split=val}``). A `metric_name` of
``timeline`` carries Chrome trace events (``ph`` ``X``, or ``B``/``E`` pairs per pid/tid, ``ts``
and ``dur`` in µs) that become spans of the run's trace output.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from otel_train.sink.decode.otlp import MAX_RUN_ID_BYTES
from otel_train.vocab.rows import MetricRow, SpanRow, series_tag
from otel_train.vocab.run_identity import RunInfo

if TYPE_CHECKING:
    from otel_train.sink.decode.run_names import RunNames
    from otel_train.sink.runs.router import Router

__all__ = ["DEFAULT_RUN_ID", "CompatAPI"]

_logger = logging.getLogger(__name__)

DEFAULT_RUN_ID = "compat"
_IDENTITY = ("run_id", "rank", "world_size", "run_name")
_MAX_BUFFERED = 1_000_000
_MAX_HISTORY = 100_000
_MAX_OPEN_EVENTS = 10_000

_Key = tuple[str, int]  # (run_id, rank)


class _BadRequest(ValueError):
    pass


def _ok(**extra: Any) -> tuple[int, dict[str, Any]]:
    return 200, {"status": "success", **extra}


class CompatAPI:
    """Request handlers of the compat API (transport-free: the HTTP server calls `handle`)."""

    def __init__(self, router: Router, names: RunNames | None = None) -> None:
        self._router = router
        self._names = names
        self._lock = threading.Lock()
        self._timeline_lock = threading.Lock()
        self._buffer: dict[_Key, dict[int, list[MetricRow | SpanRow]]] = {}
        self._buffered = 0
        self._history: deque[dict[str, Any]] = deque(maxlen=_MAX_HISTORY)
        self._open: dict[tuple[_Key, Any, Any], list[tuple[dict[str, Any], int]]] = {}
        self._open_count = 0
        self._runs: dict[tuple[str, int, int, str], RunInfo] = {}
        self._trace_ids: dict[str, int] = {}
        self.ignored = 0
        self.dropped = 0

    # -- dispatch --------------------------------------------------------------------------------
    def handle(self, method: str, path: str, query: Mapping[str, list[str]],
               body: bytes | None) -> tuple[int, dict[str, Any]]:
        route = path.rstrip("/").rsplit("/", 1)[-1]
        try:
            doc: dict[str, Any] = {}
            if method == "POST":
                if body:
                    loaded = json.loads(body)
                    if not isinstance(loaded, dict):
                        raise _BadRequest("expected a JSON object")
                    doc = loaded
            else:
                doc = {k: v[-1] for k, v in query.items()}
            handlers = {
                ("POST", "log_metric"): self.log_metric,
                ("POST", "log_metrics_batch"): self.log_metrics_batch,
                ("POST", "report_step"): self.report_step,
                ("POST", "clear_metrics"): self.clear_metrics,
                ("GET", "health"): self.health,
                ("GET", "query_metrics"): self.query_metrics,
            }
            handler = handlers.get((method, route))
            if handler is None:
                return 404, {"status": "error", "message": f"no route {method} {path}"}
            return handler(doc)
        except (_BadRequest, ValueError, TypeError) as err:
            return 400, {"status": "error", "message": str(err)[:300]}
        except Exception as err:  # never crash the server on a compat request
            _logger.exception("compat %s %s failed", method, path)
            return 500, {"status": "error", "message": f"{type(err).__name__}: {err}"}

    # -- identity --------------------------------------------------------------------------------
    def _identity(self, doc: Mapping[str, Any], tags: Mapping[str, Any]) -> RunInfo:
        def pick(key: str) -> Any:
            return doc.get(key) if doc.get(key) is not None else tags.get(key)

        run_id = str(pick("run_id") or DEFAULT_RUN_ID)
        try:
            rank = int(pick("rank") or 0)
            world = max(1, int(pick("world_size") or 1))
        except (TypeError, ValueError):
            raise _BadRequest("`rank` and `world_size` must be integers") from None
        name = str(pick("run_name") or run_id)
        key = (run_id, rank, world, name)
        run = self._runs.get(key)
        if run is None:
            if len(self._runs) > 10_000:
                self._runs.clear()
            if "\x00" in run_id or len(run_id.encode("utf-8", "surrogatepass")) > MAX_RUN_ID_BYTES:
                raise _BadRequest(f"`run_id` {run_id[:60]!r} is not allowed: it holds a NUL or is over "
                                  f"{MAX_RUN_ID_BYTES} bytes")
            if self._names is not None:
                name = self._names.name_for(run_id, name)
            run = self._runs[key] = RunInfo(run_id=run_id, run_name=name, rank=rank, world_size=world,
                                            service_name="otel-train-compat")
        return run

    @staticmethod
    def _step(doc: Mapping[str, Any]) -> int:
        step = doc.get("step")
        if isinstance(step, bool) or step is None:
            raise _BadRequest("`step` (integer) is required")
        try:
            return int(step)
        except (TypeError, ValueError):
            raise _BadRequest(f"`step` {step!r} is not an integer") from None

    @staticmethod
    def _tags(doc: Mapping[str, Any]) -> dict[str, Any]:
        tags = doc.get("tags") or {}
        if not isinstance(tags, dict):
            raise _BadRequest("`tags` must be an object")
        return tags

    # -- recording -------------------------------------------------------------------------------
    def _rows(self, run: RunInfo, step: int, name: Any, value: Any, tags: Mapping[str, Any],
              now_ns: int) -> list[MetricRow | SpanRow]:
        if not isinstance(name, str) or not name:
            raise _BadRequest("`metric_name` must be a non-empty string")
        if name == "timeline":
            with self._timeline_lock:
                return list(self._timeline(run, step, value))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.ignored += 1  # strings, dicts, null (NaN/inf sanitised by old clients): nothing to plot
            return []
        if isinstance(value, float) and not math.isfinite(value):
            self.ignored += 1
            return []
        attrs = {k: v for k, v in tags.items() if k not in _IDENTITY}
        return [MetricRow(run, step, name, series_tag(name, attrs), float(value), "gauge", now_ns, attrs)]

    def _timeline(self, run: RunInfo, step: int, value: Any) -> list[SpanRow]:
        events = value if isinstance(value, list) else [value]
        out: list[SpanRow] = []
        trace_id = self._trace_ids.setdefault(run.run_id, random.getrandbits(128) or 1)
        for ev in events:
            if not isinstance(ev, dict):
                raise _BadRequest("timeline events must be objects")
            ph = ev.get("ph")
            try:
                ts_ns = int(float(ev.get("ts", 0)) * 1000)
                dur_ns = int(float(ev.get("dur", 0)) * 1000)
            except (TypeError, ValueError):
                raise _BadRequest("timeline `ts`/`dur` must be numbers (µs)") from None
            key = ((run.run_id, run.rank), ev.get("pid"), ev.get("tid"))
            if ph == "B":
                if self._open_count >= _MAX_OPEN_EVENTS:
                    self.dropped += 1
                    continue
                stack = self._open.setdefault(key, [])
                stack.append((ev, random.getrandbits(64) or 1))
                self._open_count += 1
            elif ph == "E":
                stack = self._open.get(key) or []
                if not stack:
                    self.ignored += 1  # an end without a begin
                    continue
                begin, span_id = stack.pop()
                self._open_count -= 1
                parent = stack[-1][1] if stack else None
                b_ts = int(float(begin.get("ts", 0)) * 1000)
                args = {**(begin.get("args") or {}), **(ev.get("args") or {})}
                out.append(self._span(run, step, begin, args, trace_id, span_id, parent, b_ts, ts_ns))
            elif ph == "X":
                out.append(self._span(run, step, ev, ev.get("args") or {}, trace_id, random.getrandbits(64) or 1,
                                      None, ts_ns, ts_ns + dur_ns))
            else:
                self.ignored += 1  # counters, instants, metadata: not spans
        return out

    @staticmethod
    def _span(run: RunInfo, step: int, ev: Mapping[str, Any], args: Mapping[str, Any], trace_id: int,
              span_id: int, parent: int | None, start_ns: int, end_ns: int) -> SpanRow:
        attrs: dict[str, Any] = {k: v for k, v in args.items() if isinstance(v, (str, int, float, bool))}
        try:
            span_step = int(args.get("step", step))
        except (TypeError, ValueError):
            span_step = step
        attrs["train.step"] = span_step
        tid = ev.get("tid", 0)
        return SpanRow(run=run, name=str(ev.get("name", "event")), trace_id=trace_id, span_id=span_id,
                       parent_span_id=parent, start_unix_nano=start_ns, end_unix_nano=max(start_ns, end_ns),
                       thread_id=tid if isinstance(tid, int) else 0, thread_name=str(ev.get("tname", "")),
                       step=span_step, attributes=attrs, error=bool(args.get("error", False)))

    def _buffer_rows(self, run: RunInfo, step: int, rows: list[MetricRow | SpanRow],
                     names_values: list[tuple[str, Any, Mapping[str, Any]]]) -> None:
        with self._lock:
            if self._buffered + len(rows) > _MAX_BUFFERED:
                self.dropped += len(rows)
                raise _BadRequest(f"compat buffer full ({_MAX_BUFFERED} values); call report_step")
            self._buffer.setdefault((run.run_id, run.rank), {}).setdefault(step, []).extend(rows)
            self._buffered += len(rows)
            for name, value, tags in names_values:
                self._history.append({"run_id": run.run_id, "rank": run.rank, "step": step, "metric_name": name,
                                      "metric_value": value, "tags": dict(tags), "reported": False})

    def log_metric(self, doc: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        step, tags = self._step(doc), self._tags(doc)
        run = self._identity(doc, tags)
        name, value = doc.get("metric_name"), doc.get("metric_value")
        rows = self._rows(run, step, name, value, tags, time.time_ns())
        self._buffer_rows(run, step, rows, [(str(name), value, tags)])
        return _ok(buffered=len(rows))

    def log_metrics_batch(self, doc: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        step, tags = self._step(doc), self._tags(doc)
        run = self._identity(doc, tags)
        metrics = doc.get("metrics")
        items: list[tuple[Any, Any, dict[str, Any]]] = []
        if isinstance(metrics, dict):  # the old client: {name: value}
            items = [(k, v, tags) for k, v in metrics.items()]
        elif isinstance(metrics, list):  # also accepted: [{metric_name, metric_value, tags}]
            for m in metrics:
                if not isinstance(m, dict):
                    raise _BadRequest("`metrics` list items must be objects")
                items.append((m.get("metric_name"), m.get("metric_value"), {**tags, **(m.get("tags") or {})}))
        else:
            raise _BadRequest("`metrics` must be an object {name: value} or a list")
        now = time.time_ns()
        rows: list[MetricRow | SpanRow] = []
        for name, value, t in items:  # validate all before buffering any
            rows.extend(self._rows(run, step, name, value, t, now))
        self._buffer_rows(run, step, rows, [(str(n), v, t) for n, v, t in items])
        return _ok(buffered=len(rows))

    # -- reporting -------------------------------------------------------------------------------
    def _matching(self, doc: Mapping[str, Any]) -> list[_Key]:
        tags = self._tags(doc)
        run_id = doc.get("run_id") or tags.get("run_id")
        rank = doc.get("rank") if doc.get("rank") is not None else tags.get("rank")
        return [k for k in self._buffer
                if (run_id is None or k[0] == str(run_id)) and (rank is None or k[1] == int(rank))]

    def report_step(self, doc: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Write the buffered values of `step` (of one run when `run_id` is given, else of every run).

        Same rules as OTLP: never waits; when a run's backends are too far behind, the answer is 503 with
        `retry_after_s`, the values stay buffered and the step stays unreported, so the retry writes them once.
        """
        from otel_train.sink.decode.requests import Decoded
        from otel_train.sink.runs.router import Overloaded

        step = self._step(doc)
        metrics: list[MetricRow] = []
        spans: list[SpanRow] = []
        with self._lock:  # taken out only once the router took them
            keys = [k for k in self._matching(doc) if step in self._buffer[k]]
            for key in keys:
                for row in self._buffer[key][step]:
                    (spans if isinstance(row, SpanRow) else metrics).append(row)  # type: ignore[arg-type]
            decoded = Decoded.of_rows(metrics, spans)
            if decoded.metrics or decoded.spans:
                try:
                    self._router.ingest(decoded)
                except Overloaded as err:
                    return 503, {"status": "error", "message": str(err), "retry_after_s": err.retry_after_s}
            for key in keys:
                rows = self._buffer[key].pop(step)
                if not self._buffer[key]:
                    del self._buffer[key]
                self._buffered -= len(rows)
            for h in self._history:
                if h["step"] == step:
                    h["reported"] = True
        return _ok(step=step, metrics=len(decoded.metrics), spans=len(decoded.spans))

    def clear_metrics(self, doc: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        step = doc.get("step")
        cleared = 0
        with self._lock:
            for key in self._matching(doc):
                steps = self._buffer[key]
                for s in [s for s in steps if step is None or s == int(step)]:
                    cleared += len(steps.pop(s))
                if not steps:
                    del self._buffer[key]
            self._buffered -= cleared
            if step is None:
                self._history.clear()
            else:
                kept = [h for h in self._history if h["step"] != int(step)]
                self._history.clear()
                self._history.extend(kept)
        return _ok(cleared=cleared)

    def health(self, doc: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        return 200, {"status": "healthy", "buffered": self._buffered, "runs_open": self._router.runs_open,
                     "ignored": self.ignored, "dropped": self.dropped}

    def query_metrics(self, doc: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Recent values recorded through this API (bounded history), filtered by run_id/rank/step/metric_name."""
        def keep(h: Mapping[str, Any]) -> bool:
            for key in ("run_id", "metric_name"):
                if doc.get(key) is not None and h[key] != str(doc[key]):
                    return False
            for key in ("rank", "step"):
                if doc.get(key) is not None and h[key] != int(doc[key]):
                    return False
            return True

        with self._lock:
            found = [h for h in self._history if keep(h)]
        return _ok(metrics=found, count=len(found), buffered=self._buffered)

    # -- lifecycle -------------------------------------------------------------------------------
    def tick(self) -> None:
        """Nothing time-based yet; kept so the sink's housekeeping treats every part alike."""

    def close(self) -> None:
        """Write every buffered value (the sink is stopping)."""
        from otel_train.sink.decode.requests import Decoded

        metrics: list[MetricRow] = []
        spans: list[SpanRow] = []
        with self._lock:
            for steps in self._buffer.values():
                for rows in steps.values():
                    for row in rows:
                        (spans if isinstance(row, SpanRow) else metrics).append(row)  # type: ignore[arg-type]
            self._buffer.clear()
            self._buffered = 0
        decoded = Decoded.of_rows(metrics, spans)
        if decoded.metrics or decoded.spans:
            try:
                self._router.ingest(decoded)
            except Exception:
                _logger.exception("compat: %d buffered value(s) could not be written at shutdown",
                                  len(decoded.metrics) + len(decoded.spans))
