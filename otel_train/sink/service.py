"""The `Sink`: OTLP receivers + router + backends, with a status line and clean shutdown."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from otel_train.config.exporter_options import ExporterOptions
from otel_train.sink.receive.ingest import SinkCore
from otel_train.sink.runs.router import ExporterFactory
from otel_train.sink.settings import SinkSettings

__all__ = ["Sink", "exporter_factory", "is_loopback"]

_logger = logging.getLogger(__name__)


def is_loopback(address: str) -> bool:
    """Whether a ``HOST:PORT`` bind address is reachable only from this machine.

    Example:
        >>> is_loopback("127.0.0.1:4317"), is_loopback("[::1]:4318"), is_loopback("0.0.0.0:4317")
        (True, True, False)
    """
    import ipaddress

    host = address.rpartition(":")[0].strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name (or an empty host: every interface)


def exporter_factory(names: Sequence[str], options: ExporterOptions) -> ExporterFactory:
    """Validate exporter names now (unknown name or missing package -> `ConfigError`); build per run later."""
    from otel_train.config.registry import check_available, get_spec, load_class

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


class Sink(SinkCore):
    """A running sink. `start()` binds both receivers; `stop()` flushes every run and closes.

    Args:
        settings: Ports, token, limits, aggregates, TLS (see `SinkSettings`).
        make_exporters: Builds the backends of one run (see `exporter_factory`).
        directory: Where the local backends write (keeps runs of one name apart, see `SinkCore`).
    """

    def __init__(self, settings: SinkSettings, make_exporters: ExporterFactory,
                 directory: Path | None = None) -> None:
        super().__init__(settings, make_exporters, directory)
        self._loop: Any = None
        self._grpc: Any = None
        self._http: Any = None
        self.grpc_port = 0
        self.http_port = 0
        self._stop = threading.Event()
        self._housekeeper: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Sink:
        """Bind the gRPC and HTTP receivers (port 0 picks a free port) and start housekeeping."""
        from otel_train.sink.receive.event_loop import LoopThread
        from otel_train.sink.receive.grpc_server import start_grpc
        from otel_train.sink.receive.http_server import start_http

        s = self.settings
        if s.spool_dir is not None and s.spool_run_mb > 0:
            # What a killed sink left in runs' spools goes out now, not when (if ever) each run sends again. Made
            # before the receivers answer: `/health` must never say a replay is done before it has begun.
            from otel_train.sink.runs.spool_replay import SpoolReplay

            self.spool_replay = SpoolReplay(self.router, s.spool_dir, self._stop,
                                            workers=min(2, max(1, self.router.max_open_runs // 4)))
        cert = Path(s.tls_cert).read_bytes() if s.tls_cert else None
        key = Path(s.tls_key).read_bytes() if s.tls_key else None
        self._loop = LoopThread()  # both receivers on one event loop
        try:
            self._grpc, self.grpc_port = start_grpc(self, self._loop, s.grpc, s.max_body_bytes, cert, key)
            self._http, self.http_port = start_http(
                self, self._loop, s.http, str(s.tls_cert) if s.tls_cert else None,
                str(s.tls_key) if s.tls_key else None)
        except BaseException:
            if self._grpc is not None:
                self._grpc.stop(0)
            self._loop.close()
            raise
        self._housekeeper = threading.Thread(target=self._housekeep, name="otel-train-sink-housekeeping",
                                             daemon=True)
        self._housekeeper.start()
        if self.spool_replay is not None:
            self.spool_replay.start()
        _logger.info("otel-train sink listening: OTLP/gRPC %s, OTLP/HTTP %s%s", self._addr(s.grpc, self.grpc_port),
                     self._addr(s.http, self.http_port), " (token required)" if self.token else "")
        _logger.info("at most %d run(s) open (%s) and %d HTTP connection(s) (%s); file-descriptor limit %d",
                     self.router.max_open_runs, "set" if s.max_open_runs else "derived", self.max_connections,
                     "set" if s.max_connections else "derived", self.fds.limit)
        exposed = [a for a in (s.grpc, s.http) if not is_loopback(a)]
        if exposed and not self.token:
            _logger.warning("the sink listens on %s beyond this machine without a token: anyone who reaches it can "
                            "write runs; set OTEL_TRAIN_SINK_TOKEN (or OTEL_TRAIN_SINK_TOKEN_FILE)", ", ".join(exposed))
        return self

    @staticmethod
    def _addr(address: str, port: int) -> str:
        return f"{address.rpartition(':')[0]}:{port}"

    def _housekeep(self) -> None:
        from otel_train.sink.memory import TRIM_EVERY_S, trim

        tick_s = max(0.05, min(1.0, self.settings.idle_s / 4, self.settings.aggregate_timeout_s / 4))
        last_status = last_trim = time.monotonic()
        last_points = self.router.points_in
        trimmed_at_closed = closed_last_tick = 0
        trim_again_at = math.inf
        while not self._stop.wait(tick_s):
            try:
                self.router.tick()
                self.compat.tick()
                self.release_due_holds()
                self.hangs.tick()
            except Exception:
                _logger.exception("sink housekeeping failed")
            now = time.monotonic()
            closed = self.router.runs_closed
            # Closed runs' memory back to the system (`otel_train.sink.memory`): once a wave of closes has ended,
            # every TRIM_EVERY_S while one goes on, and once more a moment after (a closed run's backend may wait
            # for its last timed turn on the pool for up to a second).
            if closed != trimmed_at_closed and now - last_trim >= 1.0 and (
                    closed == closed_last_tick or now - last_trim >= TRIM_EVERY_S):
                trimmed_at_closed, last_trim, trim_again_at = closed, now, now + 2.0
                trim()
            elif now >= trim_again_at:
                last_trim, trim_again_at = now, math.inf
                trim()
            closed_last_tick = closed
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
        """Stop receiving, write pending aggregates and compat buffers, close every backend (waiting about
        `timeout_s` for them; what they have not taken by then stays in the runs' spools). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._stop.set()
        if self._grpc is not None:
            self._grpc.stop(min(5.0, timeout_s))
        if self._http is not None:
            self._http.stop()
        if self._loop is not None:
            self._loop.close()
        self.close_threads()
        if self._housekeeper is not None:
            self._housekeeper.join(5.0)
        self.compat.close()
        self.router.close(timeout_s)
        self._report_unwritten(timeout_s)
        _logger.info("%s; stopped", self.status_line(0.0))

    def _report_unwritten(self, timeout_s: float) -> None:
        """Say which runs' backends did not take everything before the shutdown timeout: their spool stays."""
        spool_dir = self.settings.spool_dir
        if spool_dir is None or self.settings.spool_run_mb <= 0:
            return
        from otel_train.sink.runs.spool_replay import unfinished_spools

        try:
            # What the next start will write (a closed run keeps its folder, with its series state, and is not).
            left = sorted(folder.name for _, folder in unfinished_spools(spool_dir))
        except OSError:
            return
        if left:
            _logger.warning("%d run(s) not fully written within the shutdown timeout of %g s (e.g. %s): what was not "
                            "written stays in the spool (%s) and is written by the next start", len(left), timeout_s,
                            ", ".join(left[:3]), spool_dir)

    def __enter__(self) -> Sink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
