"""Drop-in client for code written against the old Metrics Service.

Change one import and point it at `otel-train sink` (its HTTP port serves the old API under
``/metrics``)::

    from otel_train.compat import MetricsClient      # was: from ...metrics.client import MetricsClient
    client = MetricsClient("http://127.0.0.1:4318/metrics")
    client.log_metric(step=1, metric_name="train/loss", metric_value=0.5)
    client.report_step(1)

Values are buffered in the client until `report_step` (or sent at once with ``immediate=True``).
The run identity (``run_id``, ``rank``, ``world_size``) is sent as tags: from the constructor, else
from ``OTEL_TRAIN_RUN_ID`` / ``RANK`` / ``WORLD_SIZE``, else the sink's default run ``compat``.
The client never raises into training code: a failed request is counted in `errors`, logged once
per kind, and the call returns ``False`` (or a ``{"status": "error"}`` dict).

Code written against a `tracking_utils`-style module moves with one import too:
`otel_train.compat.tracking_utils` (``init_tracking(args)``, ``log(args, metrics, step_key)``,
``flush_metrics(args, step)``) and `MetricsServiceAdapter` (``log``, ``flush``, ``direct_log``) log into the
otel-train session instead of a service.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

from otel_train._internal.ratelimit import LogOnce
from otel_train.compat._adapter import MetricsServiceAdapter
from otel_train.config.settings import OTEL_TRAIN_RUN_ID
from otel_train.sink.settings import OTEL_TRAIN_SINK_TOKEN

__all__ = ["MetricsClient", "MetricsServiceAdapter"]

_logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:4318/metrics"


def _jsonable(value: Any) -> Any:
    """Non-finite floats -> None; tensors / numpy scalars -> Python numbers (as the old client did)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        try:
            return _jsonable(tolist())
        except Exception:
            return None
    return str(value)


class MetricsClient:
    """Client of the Metrics Service API, served by `otel-train sink`.

    Args:
        service_url: Base URL of the API (``.../metrics``).
        run_id: Run this client's values belong to; default ``OTEL_TRAIN_RUN_ID`` (else the sink's ``compat``).
        rank: This process's rank; default ``RANK`` (else 0).
        world_size: Ranks in the run; default ``WORLD_SIZE`` (else 1).
        token: Bearer token of the sink; default ``OTEL_TRAIN_SINK_TOKEN``.
        timeout_s: Per-request timeout.

    Example:
        >>> client = MetricsClient("http://127.0.0.1:9/metrics", run_id="r1", timeout_s=0.2)
        >>> client.log_metric(step=1, metric_name="train/loss", metric_value=0.5)
        True
        >>> client.get_buffered_metrics_count(step=1)
        1
    """

    def __init__(self, service_url: str = DEFAULT_URL, *, run_id: str | None = None, rank: int | None = None,
                 world_size: int | None = None, token: str | None = None, timeout_s: float = 5.0) -> None:
        self.service_url = service_url.rstrip("/")
        self.timeout_s = timeout_s
        identity: dict[str, Any] = {}
        run_id = run_id or os.environ.get(OTEL_TRAIN_RUN_ID) or None
        if run_id:
            identity["run_id"] = run_id
        for key, given, var in (("rank", rank, "RANK"), ("world_size", world_size, "WORLD_SIZE")):
            raw = given if given is not None else os.environ.get(var)
            try:
                if raw is not None and str(raw).strip():
                    identity[key] = int(raw)
            except ValueError:
                pass
        self._identity = identity
        self._token = token or os.environ.get(OTEL_TRAIN_SINK_TOKEN) or None
        self._buffer: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
        self._lock = threading.Lock()
        self._log = LogOnce(_logger)
        self.errors = 0

    # -- transport -----------------------------------------------------------------------------
    def _request(self, method: str, route: str, doc: dict[str, Any] | None = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        data = json.dumps(doc).encode() if doc is not None else None
        req = urllib.request.Request(f"{self.service_url}/{route}", data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                result: dict[str, Any] = json.loads(resp.read() or b"{}")
                return result
        except urllib.error.HTTPError as err:
            self.errors += 1
            try:
                body = err.read().decode("utf-8", "replace")[:300]
            except Exception:
                body = ""
            self._log.warning(f"http-{route}-{err.code}", "metrics service %s: HTTP %d %s (logged once)",
                              route, err.code, body)
            return {"status": "error", "message": f"HTTP {err.code}: {body}"}
        except Exception as err:  # network down, timeout, bad JSON: never into training code
            self.errors += 1
            self._log.warning("network", "metrics service unreachable at %s (%s: %s); errors are counted, logged once",
                              self.service_url, route, err)
            return {"status": "error", "message": str(err)}

    def _tags(self, tags: dict[str, Any] | None) -> dict[str, Any]:
        return {**self._identity, **(tags or {})}

    # -- the old API -----------------------------------------------------------------------------
    def log_metric(self, step: int, metric_name: str, metric_value: Any, tags: dict[str, Any] | None = None,
                   immediate: bool = False) -> bool:
        """Buffer one value for `step` (``immediate=True``: send it now). A ``timeline`` value is
        a Chrome trace event or a list of them."""
        if immediate:
            doc = {"step": step, "metric_name": metric_name, "metric_value": _jsonable(metric_value),
                   "tags": self._tags(tags)}
            return self._request("POST", "log_metric", doc).get("status") == "success"
        with self._lock:
            self._buffer[step].append({"metric_name": metric_name, "metric_value": metric_value, "tags": tags or {}})
        return True

    def log_metrics_batch(self, step: int, metrics: dict[str, Any], tags: dict[str, Any] | None = None,
                          immediate: bool = False) -> bool:
        """Buffer several values for `step` (``immediate=True``: send them now)."""
        if immediate:
            doc = {"step": step, "metrics": _jsonable(metrics), "tags": self._tags(tags)}
            return self._request("POST", "log_metrics_batch", doc).get("status") == "success"
        with self._lock:
            for name, value in metrics.items():
                self._buffer[step].append({"metric_name": name, "metric_value": value, "tags": tags or {}})
        return True

    def report_step(self, step: int) -> dict[str, Any]:
        """Send the values buffered for `step` and have the sink write that step to its backends."""
        with self._lock:
            items = self._buffer.pop(step, [])
        if items:
            # Unlike the old client, each value keeps its tags (and timeline events are not collapsed).
            batch = [{"metric_name": i["metric_name"], "metric_value": _jsonable(i["metric_value"]),
                      "tags": i["tags"]} for i in items]
            sent = self._request("POST", "log_metrics_batch",
                                 {"step": step, "metrics": batch, "tags": self._tags(None)})
            if sent.get("status") != "success":
                return {"status": "error", "message": f"failed to send metrics batch for step {step}: "
                                                      f"{sent.get('message', '')}"}
        return self._request("POST", "report_step", {"step": step, **self._identity})

    def health_check(self) -> dict[str, Any]:
        """The sink's compat health document, or ``{"status": "error", ...}``."""
        return self._request("GET", "health")

    def clear_buffer(self, step: int | None = None) -> None:
        """Forget buffered values (of `step`, or all)."""
        with self._lock:
            if step is None:
                self._buffer.clear()
            else:
                self._buffer.pop(step, None)

    def get_buffered_metrics_count(self, step: int | None = None) -> int:
        """Values buffered in this client (for `step`, or in total)."""
        with self._lock:
            if step is None:
                return sum(len(v) for v in self._buffer.values())
            return len(self._buffer.get(step, []))
