"""Command line of the sink: `otel-train sink` / `python -m otel_train.sink`.

`add_arguments(parser)` and `main(args) -> int` let the top-level CLI mount it as a subcommand.
Every flag also reads its environment variable; a flag wins over the variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from otel_train.sink.service import Sink

__all__ = ["DESCRIPTION", "add_arguments", "main"]

DESCRIPTION = """\
Receive OTLP metrics and spans (from a collector or directly from training processes) and write
each training run (grouped by the resource attribute train.run.id, all ranks) to the configured
backends, the same ones and the same layout as in-process export.

Endpoints: OTLP/gRPC on --grpc; on --http: POST /v1/metrics and /v1/traces (protobuf or JSON),
GET /health, GET /runs, and the old Metrics Service API under /metrics/.
Stops cleanly (flushing every run) on SIGTERM or Ctrl-C.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sink's flags to `parser`."""
    parser.add_argument("--grpc", metavar="HOST:PORT",
                        help="OTLP/gRPC bind address [env OTEL_TRAIN_SINK_GRPC; default 127.0.0.1:4317]")
    parser.add_argument("--http", metavar="HOST:PORT",
                        help="OTLP/HTTP + API bind address [env OTEL_TRAIN_SINK_HTTP; default 127.0.0.1:4318]")
    parser.add_argument("--exporters", metavar="LIST",
                        help="comma list of backends [env OTEL_TRAIN_EXPORTERS; default tensorboard,chrome_trace]")
    parser.add_argument("--dir", metavar="DIR",
                        help="directory local backends write under [env OTEL_TRAIN_DIR; default ./otel-train-runs]")
    parser.add_argument("--project", metavar="NAME",
                        help="project for W&B/ClearML/MLflow/Trackio [env OTEL_TRAIN_PROJECT; default otel-train]")
    parser.add_argument("--token", metavar="TOKEN", help=argparse.SUPPRESS)  # refused: argv is visible in `ps`
    parser.add_argument("--token-file", metavar="FILE", dest="token_file",
                        help="require `authorization: Bearer TOKEN` on every request, TOKEN read from FILE "
                             "[env OTEL_TRAIN_SINK_TOKEN_FILE, or the token itself in OTEL_TRAIN_SINK_TOKEN]")
    parser.add_argument("--aggregate", metavar="LIST",
                        help="cross-rank aggregates from mean,min,max written as NAME/mean ... "
                             "[env OTEL_TRAIN_SINK_AGGREGATE; default none]")
    parser.add_argument("--aggregate-timeout-s", metavar="S", dest="aggregate_timeout_s",
                        help="write a step's aggregate after S seconds even if ranks are missing "
                             "[env OTEL_TRAIN_SINK_AGGREGATE_TIMEOUT_S; default 30]")
    parser.add_argument("--idle-s", metavar="S", dest="idle_s",
                        help="close a run's backends after S seconds without data "
                             "[env OTEL_TRAIN_SINK_IDLE_S; default 300]")
    parser.add_argument("--max-body-bytes", metavar="N", dest="max_body_bytes",
                        help="largest request accepted [env OTEL_TRAIN_SINK_MAX_BODY_BYTES; default 16 MiB]")
    parser.add_argument("--status-interval-s", metavar="S", dest="status_interval_s",
                        help="seconds between status log lines [env OTEL_TRAIN_SINK_STATUS_INTERVAL_S; default 10]")
    parser.add_argument("--body-timeout-s", metavar="S", dest="body_timeout_s",
                        help="seconds a request body may take to arrive, else 408 "
                             "[env OTEL_TRAIN_SINK_BODY_TIMEOUT_S; default 30]")
    parser.add_argument("--max-connections", metavar="N", dest="max_connections",
                        help="open HTTP connections at most; at the cap a new one closes the oldest that has not "
                             "sent a whole (authorized) request or is idle [env OTEL_TRAIN_SINK_MAX_CONNECTIONS; "
                             "default: a quarter of the file-descriptor limit, at most 1024]")
    parser.add_argument("--header-timeout-s", metavar="S", dest="header_timeout_s",
                        help="seconds a new HTTP connection may take to send its request headers, else it is "
                             "closed [env OTEL_TRAIN_SINK_HEADER_TIMEOUT_S; default 10]")
    parser.add_argument("--shutdown-timeout-s", metavar="S", dest="shutdown_timeout_s",
                        help="seconds spent writing on SIGTERM before exiting anyway (the rest stays in the spool "
                             "for the next start) [env OTEL_TRAIN_SINK_SHUTDOWN_TIMEOUT_S; default 10]")
    parser.add_argument("--tls-cert", metavar="FILE", dest="tls_cert",
                        help="PEM certificate: serve both protocols over TLS (needs --tls-key)")
    parser.add_argument("--tls-key", metavar="FILE", dest="tls_key", help="PEM private key of --tls-cert")
    parser.add_argument("--spool-dir", metavar="DIR", dest="spool_dir",
                        help="where each run's requests are held while its backends are behind "
                             "[env OTEL_TRAIN_SINK_SPOOL_DIR; default <dir>/.sink-spool]")
    parser.add_argument("--spool-run-mb", metavar="MB", dest="spool_run_mb",
                        help="MiB one run may hold before its requests are refused (0: no spool, refuse when "
                             "--queue-windows requests are queued) [env OTEL_TRAIN_SINK_SPOOL_RUN_MB; default 1024]")
    parser.add_argument("--spool-total-mb", metavar="MB", dest="spool_total_mb",
                        help="MiB all runs together may hold [env OTEL_TRAIN_SINK_SPOOL_TOTAL_MB; default 8192]")
    parser.add_argument("--queue-windows", metavar="N", dest="queue_windows",
                        help="requests held in memory per run and backend [env OTEL_TRAIN_SINK_QUEUE_WINDOWS; "
                             "default 256]")
    parser.add_argument("--retry-after-s", metavar="S", dest="retry_after_s",
                        help="wait a refused sender is told (Retry-After / RetryInfo) "
                             "[env OTEL_TRAIN_SINK_RETRY_AFTER_S; default 1]")
    parser.add_argument("--backend-threads", metavar="N", dest="backend_threads",
                        help="threads per backend kind, shared by every run [env OTEL_TRAIN_SINK_BACKEND_THREADS; "
                             "default 4]")
    parser.add_argument("--max-open-runs", metavar="N", dest="max_open_runs",
                        help="runs whose backends and files are open at once (least recently used idle ones are "
                             "closed, reopened on demand) [env OTEL_TRAIN_SINK_MAX_OPEN_RUNS; default: what the "
                             "file-descriptor limit allows, 6 per run, at most 1000]")
    parser.add_argument("--reorder-s", metavar="S", dest="reorder_s",
                        help="hold a run's points S seconds for TensorBoard and W&B, so that points a collector "
                             "delivers late by less are written in step order, not skipped (0: no hold) "
                             "[env OTEL_TRAIN_SINK_REORDER_S; default 5]")
    parser.add_argument("--log-level", metavar="LEVEL", default="INFO", dest="log_level",
                        help="logging level on stderr (DEBUG, INFO, WARNING) [default INFO]")


def _fail(message: str) -> int:
    sys.stderr.write(f"otel-train sink: error: {message}\n")
    return 2


def main(args: argparse.Namespace) -> int:
    """Run the sink until SIGTERM/SIGINT. Returns the exit code (2: bad setting, 1: cannot bind)."""
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.config.settings import load_settings
    from otel_train.errors import ConfigError
    from otel_train.sink.settings import load_sink_settings

    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        return _fail(f"--log-level: {args.log_level!r} is not allowed; use DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(stream=sys.stderr, level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.token is not None:
        return _fail("--token: a token on the command line is visible to every user of this machine (`ps`); "
                     "set OTEL_TRAIN_SINK_TOKEN or give --token-file FILE")
    try:
        settings = load_sink_settings(
            grpc=args.grpc, http=args.http, token_file=args.token_file, aggregate=args.aggregate,
            idle_s=args.idle_s, aggregate_timeout_s=args.aggregate_timeout_s, max_body_bytes=args.max_body_bytes,
            status_interval_s=args.status_interval_s, tls_cert=args.tls_cert, tls_key=args.tls_key,
            body_timeout_s=args.body_timeout_s, max_connections=args.max_connections,
            spool_dir=args.spool_dir, spool_run_mb=args.spool_run_mb, spool_total_mb=args.spool_total_mb,
            queue_windows=args.queue_windows, retry_after_s=args.retry_after_s,
            backend_threads=args.backend_threads, max_open_runs=args.max_open_runs, reorder_s=args.reorder_s,
            header_timeout_s=args.header_timeout_s, shutdown_timeout_s=args.shutdown_timeout_s)
        if (settings.tls_cert is None) != (settings.tls_key is None):
            raise ConfigError("--tls-cert/--tls-key: give both (a PEM certificate and its key) or neither")
        for flag, path in (("--tls-cert", settings.tls_cert), ("--tls-key", settings.tls_key)):
            if path is not None and not path.is_file():
                raise ConfigError(f"{flag}: {str(path)!r} is not a readable file")
        run_settings = load_settings(exporters=args.exporters, dir=args.dir, project=args.project)
        if not run_settings.exporters:
            raise ConfigError("OTEL_TRAIN_EXPORTERS: empty; give at least one backend, e.g. tensorboard")
        # Every rank arrives at the sink, so every rank's metrics are written.
        # OTEL_TRAIN_<BACKEND>_* route the sink's backends too; hyperparameters come with each run.
        options = ExporterOptions.from_settings(run_settings, ranks="all", with_hparams=False)
        if settings.spool_dir is None:
            settings = dataclasses.replace(settings, spool_dir=Path(run_settings.dir) / ".sink-spool")
        from otel_train.sink.service import Sink, exporter_factory

        factory = exporter_factory(run_settings.exporters, options)
    except ConfigError as err:
        return _fail(str(err))

    from otel_train.sink.fd_limits import raise_soft_limit

    raise_soft_limit()  # our own process: the limits the sink derives follow the hard descriptor limit
    sink = Sink(settings, factory, options.directory)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    # Before the listeners start: a SIGTERM as soon as /health answers must stop the sink cleanly too.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        sink.start()
    except OSError as err:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.stderr.write(f"otel-train sink: error: {err}\n")
        return 1
    logging.getLogger("otel_train.sink").info(
        "writing %s under %s", ",".join(run_settings.exporters), run_settings.dir)
    from otel_train._internal.gc_tuning import tune_for_row_churn

    tune_for_row_churn()  # our own process: fewer cycle collections (see that module)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop_within(sink, settings.shutdown_timeout_s)
    return 0


def _stop_within(sink: Sink, timeout_s: float) -> None:
    """Stop the sink, writing what it holds for at most `timeout_s` (and a moment to close); a backend that hangs
    past that does not keep the process: it exits, and what was not written stays in the runs' spools, which the
    next start writes."""
    done = threading.Event()

    def stop() -> None:
        try:
            sink.stop(timeout_s)
        finally:
            done.set()

    threading.Thread(target=stop, name="otel-train-sink-stop", daemon=True).start()
    if done.wait(timeout_s + 2.0):
        return
    logging.getLogger("otel_train.sink").warning(
        "still writing after the shutdown timeout of %g s (a backend hangs); exiting now: what was not written "
        "stays in the spool (%s) and is written by the next start (OTEL_TRAIN_SINK_SHUTDOWN_TIMEOUT_S)", timeout_s,
        sink.settings.spool_dir)
    logging.shutdown()
    os._exit(0)  # the hung write's thread cannot be stopped; the interpreter's exit would wait for it
