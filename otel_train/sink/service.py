"""The `Sink`: OTLP receivers + router + backends, with a status line and clean shutdown."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from otel_train._internal.ratelimit import LogOnce
from otel_train.config import SinkSettings
from otel_train.records import ExporterOptions
from otel_train.sink.compat import CompatAPI
from otel_train.sink.decode import (
    DecodeCache,
    DecodeError,
    decode_metrics,
    decode_traces,
    parse_metrics,
    parse_traces,
)
from otel_train.sink.grpc_server import token_matches
from otel_train.sink.router import ExporterFactory, Router

__all__ = ["Sink", "exporter_factory"]

_logger = logging.getLogger(__name__)


def exporter_factory(names: Sequence[str], options: ExporterOptions) -> ExporterFactory:
    """Validate exporter names now (unknown name or missing package -> `ConfigError`); build per run later."""
    from otel_train.registry import check_available, get_spec, load_class

    specs = [get_spec(n) for n in names]
    for spec in specs:
        check_available(spec)
    if "otlp" in names:
        from otel_train.errors import ConfigError

        raise ConfigError("OTEL_TRAIN_EXPORTERS: `otlp` is not allowed in the sink (it would loop back); "
                          "use backends such as tensorboard, chrome_trace, wandb")
    classes = [(spec.name, load_class(spec)) for spec in specs]
    for _, cls in classes:
        cls.preload()

    def make() -> list[Any]:
        out = []
        for name, cls in classes:
            try:
                out.append(cls(options))
            except Exception:
                _logger.exception("cannot build exporter `%s`; this run is written without it", name)
        return out

    return make


class Sink:
    """A running sink. `start()` binds both receivers; `stop()` flushes every run and closes.

    Args:
        settings: Ports, token, limits, aggregates, TLS (see `SinkSettings`).
        make_exporters: Builds the backends of one run (see `exporter_factory`).
    """

    def __init__(self, settings: SinkSettings, make_exporters: ExporterFactory) -> None:
        self.settings = settings
        self.token = settings.token
        self.router = Router(make_exporters, settings.aggregate, settings.aggregate_timeout_s, settings.idle_s)
        self.compat = CompatAPI(self.router)
        self._runs = DecodeCache()
        self._grpc: Any = None
        self._http: Any = None
        self._http_thread: threading.Thread | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.rejected: dict[str, int] = {}
        self.unattributed = 0
        self.unattributed_runs: set[str] = set()
        self.unsupported: dict[str, int] = {}
        self._log = LogOnce(_logger, interval_s=60.0)
        self._stop = threading.Event()
        self._housekeeper: threading.Thread | None = None
        self._stopped = False
        self._started_at = time.monotonic()
        self._lock = threading.Lock()

    # -- request entry points (called by both receivers) ---------------------------------------
    def token_ok(self, header: str) -> bool:
        return self.token is None or token_matches(self.token, header)

    def count_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def ingest(self, signal: str, body: bytes, content_type: str | None, encoding: str | None) -> int:
        """Decode a whole request into rows, then hand them to the router. Returns rows taken.

        Raises:
            DecodeError: malformed payload (nothing of it is written).
            OverflowError: the decompressed body exceeds `max_body_bytes`.
            Overloaded: a run's backends are behind; the client should retry.
        """
        limit = self.settings.max_body_bytes
        if signal == "metrics":
            request = parse_metrics(body, content_type, encoding, limit)
            decoded = decode_metrics(request, self._runs)
        elif signal == "traces":
            request = parse_traces(body, content_type, encoding, limit)
            decoded = decode_traces(request, self._runs)
        else:
            raise DecodeError(f"unknown signal {signal!r}")
        n = decoded.points + len(decoded.spans)
        for run_id, count in decoded.unattributed.items():
            self.unattributed += count
            self.unattributed_runs.add(run_id)
            self._log.warning(f"unattributed:{run_id}",
                              "received %s data without the `train.run.id` resource attribute, written under the "
                              "run %r (fallback: service.instance.id, then service.name@host.name, then "
                              "service.name); set `train.run.id` (OTEL_RESOURCE_ATTRIBUTES) to choose the run "
                              "(logged at most once a minute per run)", signal, run_id)
        for kind, count in decoded.unsupported.items():
            with self._lock:
                first = kind not in self.unsupported
                self.unsupported[kind] = self.unsupported.get(kind, 0) + count
            if first:
                _logger.warning("received %s metric(s) of OTLP type `%s`, which the sink cannot write; they are "
                                "counted in /health `unsupported` (warned once per type)", count, kind)
        if n:
            self.router.ingest(decoded)
        return n

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if not self._stopped else "stopping",
            "uptime_s": round(time.monotonic() - self._started_at, 1),
            "runs_open": self.router.runs_open,
            "points": self.router.points_in,
            "spans": self.router.spans_in,
            "errors": self.router.errors,
            "rejected": dict(self.rejected),
            "unattributed_resources": self.unattributed,
            "unsupported": dict(self.unsupported),
        }

    def runs(self) -> dict[str, Any]:
        """The `/runs` document; runs named by a fallback (no `train.run.id`) say ``"unattributed": true``."""
        doc = self.router.summary()
        for run in doc["runs"]:
            run["unattributed"] = run["run_id"] in self.unattributed_runs
        return doc

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Sink:
        """Bind the gRPC and HTTP receivers (port 0 picks a free port) and start housekeeping."""
        from otel_train.sink.grpc_server import start_grpc
        from otel_train.sink.http_server import start_http

        s = self.settings
        cert = Path(s.tls_cert).read_bytes() if s.tls_cert else None
        key = Path(s.tls_key).read_bytes() if s.tls_key else None
        self._grpc, self.grpc_port = start_grpc(self, s.grpc, s.max_body_bytes, cert, key)
        try:
            self._http, self._http_thread, self.http_port = start_http(
                self, s.http, str(s.tls_cert) if s.tls_cert else None, str(s.tls_key) if s.tls_key else None)
        except OSError:
            self._grpc.stop(0)
            raise
        self._housekeeper = threading.Thread(target=self._housekeep, name="otel-train-sink-housekeeping",
                                             daemon=True)
        self._housekeeper.start()
        _logger.info("otel-train sink listening: OTLP/gRPC %s, OTLP/HTTP %s%s", self._addr(s.grpc, self.grpc_port),
                     self._addr(s.http, self.http_port), " (token required)" if self.token else "")
        return self

    @staticmethod
    def _addr(address: str, port: int) -> str:
        return f"{address.rpartition(':')[0]}:{port}"

    def _housekeep(self) -> None:
        tick_s = max(0.05, min(1.0, self.settings.idle_s / 4, self.settings.aggregate_timeout_s / 4))
        last_status = time.monotonic()
        last_points = self.router.points_in
        while not self._stop.wait(tick_s):
            try:
                self.router.tick()
                self.compat.tick()
            except Exception:
                _logger.exception("sink housekeeping failed")
            now = time.monotonic()
            if now - last_status >= self.settings.status_interval_s:
                rate = (self.router.points_in - last_points) / (now - last_status)
                last_status, last_points = now, self.router.points_in
                _logger.info("%s", self.status_line(rate))

    def status_line(self, points_per_s: float) -> str:
        r = self.router
        rejected = sum(self.rejected.values())
        return (f"sink: {points_per_s:,.0f} points/s, {r.runs_open} run(s) open, {r.points_in:,} points and "
                f"{r.spans_in:,} spans received, {r.errors} write error(s), {rejected} request(s) rejected")

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Write everything received so far (compat buffers excepted) and flush every backend."""
        return self.router.flush(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop receiving, write pending aggregates and compat buffers, close every backend. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._stop.set()
        if self._grpc is not None:
            self._grpc.stop(min(5.0, timeout_s))
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._housekeeper is not None:
            self._housekeeper.join(5.0)
        self.compat.close()
        self.router.close(timeout_s)
        _logger.info("%s; stopped", self.status_line(0.0))

    def __enter__(self) -> Sink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
