"""The sink's core, shared by both receivers: auth check, ingest entry point, counters, health.

Receivers (`grpc_server`, `http_server`) import this module, never `service`, so data and imports
flow one way: receivers -> core -> decode/router -> backends.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import hmac
import logging
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from otel_train._internal.ratelimit import LogOnce
from otel_train.sink.decode.logs import decode_logs
from otel_train.sink.decode.otlp import parse_logs
from otel_train.sink.decode.requests import (
    DecodeCache,
    Decoded,
    DecodeError,
    decode_metrics,
    parse_metrics,
    parse_traces,
)
from otel_train.sink.decode.run_names import RunNames
from otel_train.sink.decode.traces import decode_traces
from otel_train.sink.fd_limits import FdBudget, default_max_connections, default_max_open_runs, fds_in_use
from otel_train.sink.receive.answer import Taken, refusal_reason, taken
from otel_train.sink.receive.compat import CompatAPI
from otel_train.sink.runs.live_hangs import LiveHangs
from otel_train.sink.runs.reorder import ReorderHold, needs_hold
from otel_train.sink.runs.router import ExporterFactory, Overloaded, Router
from otel_train.sink.settings import SinkSettings

if TYPE_CHECKING:
    from otel_train.backend import RowExporter
    from otel_train.sink.runs.spool_replay import SpoolReplay

__all__ = ["DecodeError", "Overloaded", "SinkCore", "token_matches"]

_logger = logging.getLogger(__name__)

#: HTTP bodies up to this size are decoded on the receivers' event loop (a few ms); larger ones on a thread, so
#: that a legal 16 MiB body (seconds of decoding) never holds up other senders or `/health` (as over gRPC).
INLINE_BYTES = 256 * 1024
#: Threads that decode the larger HTTP bodies.
LARGE_THREADS = 2
#: Requests taken run by run whose taken runs are remembered until the sender's retry takes the rest.
_IN_TURN_REMEMBERED = 256


def token_matches(expected: str, header: str) -> bool:
    """Constant-time check of an ``authorization: Bearer <token>`` value."""
    scheme, _, given = header.strip().partition(" ")
    # A header that is not UTF-8 reaches us with surrogate escapes: compare its bytes, never fail on it.
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                                              expected.encode("utf-8", "surrogateescape"))


class SinkCore:
    """What both receivers share: the token check, the ingest entry point, counters, `/health`, `/runs`.

    `otel_train.sink.service.Sink` adds the receivers and the lifecycle on top; the receivers only
    see this class, so imports run one way: service -> receivers -> core -> decode/router.

    Args:
        settings: Ports, token, limits, aggregates, TLS (see `SinkSettings`).
        make_exporters: Builds the backends of one run (see `exporter_factory`).
        directory: Where the local backends write: a run name held by one run id is given to no
            other there (`otel_train.sink.decode.run_names`); ``None`` remembers that in memory only.
    """

    def __init__(self, settings: SinkSettings, make_exporters: ExporterFactory,
                 directory: Path | None = None) -> None:
        self.settings = settings
        self.token = settings.token
        spool_bytes = settings.spool_run_mb << 20
        self._holds: weakref.WeakSet[ReorderHold] = weakref.WeakSet()  # every run's reorder holds
        self._holds_lock = threading.Lock()
        # Limits left unset follow the file-descriptor limit (`otel_train.sink.fd_limits`).
        self.fds = FdBudget()
        self.max_connections = settings.max_connections or default_max_connections(self.fds.limit)
        max_open_runs = settings.max_open_runs or default_max_open_runs(self.fds.limit, self.max_connections)
        self.router = Router(self._with_holds(make_exporters), settings.aggregate, settings.aggregate_timeout_s,
                             settings.idle_s, settings.queue_windows, settings.spool_dir if spool_bytes else None,
                             spool_bytes, settings.spool_total_mb << 20, settings.retry_after_s,
                             settings.backend_threads, max_open_runs, self.fds)
        self.run_names = RunNames(directory)
        self.compat = CompatAPI(self.router, self.run_names)
        self._runs = DecodeCache(names=self.run_names)
        #: Per run and rank: the latest `train.hang` record and the heartbeat (`GET /runs/<run id>/hangs`).
        self.hangs = LiveHangs(keep_s=settings.idle_s)
        self.rejected: dict[str, int] = {}
        self.unattributed = 0
        self.unattributed_runs: set[str] = set()
        self.unsupported: dict[str, int] = {}
        self.points_refused: dict[str, int] = {}
        #: Per run and backend: rows the spool handed over again after a restart that the backend already held.
        self.redelivered: dict[str, dict[str, int]] = {}
        #: Started by `Sink.start` when there is a spool: delivers what an earlier sink process left in it.
        self.spool_replay: SpoolReplay | None = None
        self._log = LogOnce(_logger, interval_s=60.0)
        self._stopped = False
        self._started_at = time.monotonic()
        self._lock = threading.Lock()
        #: Per request taken run by run (by a digest of its signal and bytes): the runs already taken, and a lock
        #: held while one copy of it is being taken.
        self._taken_in_turn: OrderedDict[bytes, tuple[threading.Lock, set[str]]] = OrderedDict()
        self._large: ThreadPoolExecutor | None = None  # started with the first large HTTP body

    def _with_holds(self, make_exporters: ExporterFactory) -> ExporterFactory:
        """`make_exporters` with a `ReorderHold` in front of each backend that skips late points (TensorBoard,
        W&B); unchanged when `reorder_s` is 0."""
        reorder_s = self.settings.reorder_s
        if reorder_s <= 0:
            return make_exporters

        def make() -> list[RowExporter]:
            out = []
            for exporter in make_exporters():
                if needs_hold(exporter):
                    hold = ReorderHold(exporter, reorder_s)
                    hold.on_redelivered = functools.partial(self._count_redelivered,
                                                            str(getattr(exporter, "name", type(exporter).__name__)))
                    with self._holds_lock:
                        self._holds.add(hold)
                    exporter = cast("RowExporter", hold)
                out.append(exporter)
            return out

        return make

    def _count_redelivered(self, backend: str, run_id: str, rows: int) -> None:
        """Rows a restarted sink's spool handed a backend again that it already held: skipped, counted."""
        with self._lock:
            per_run = self.redelivered.setdefault(run_id, {})
            per_run[backend] = per_run.get(backend, 0) + rows

    def _redelivered_now(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {run: dict(counts) for run, counts in self.redelivered.items()}

    def reorder_holds(self) -> list[ReorderHold]:
        with self._holds_lock:
            return list(self._holds)

    def release_due_holds(self) -> None:
        """Housekeeping: ask the runs whose held points are due, and that nothing else flushes (no spool), to
        flush (the hold releases them on its backend's own thread)."""
        for hold in self.reorder_holds():
            if hold.on_due is not None and hold.held and hold.due():
                hold.on_due()

    # -- request entry points (called by both receivers) ---------------------------------------
    def token_ok(self, header: str) -> bool:
        return self.token is None or token_matches(self.token, header)

    def count_rejected(self, reason: str, detail: str = "") -> None:
        """Count a refused request by reason (shown in `/health`) and log it (once a minute per reason)."""
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            total = self.rejected[reason]
        self._log.warning(f"rejected:{reason}", "refused a request (%s, %d so far)%s%s (logged at most once a "
                          "minute per reason)", reason, total, ": " if detail else "", detail[:300])

    async def ingest_async(self, signal: str, body: bytes, content_type: str | None, encoding: str | None) -> Taken:
        """`ingest` for the receivers' event loop: a body over `INLINE_BYTES` on a thread of its own. It never
        waits: a run whose backends are behind is held in its spool or refused at once (`Overloaded`), so one
        run never holds up another."""
        if len(body) <= INLINE_BYTES:
            return self.ingest(signal, body, content_type, encoding)
        with self._lock:
            if self._large is None:
                self._large = ThreadPoolExecutor(LARGE_THREADS, thread_name_prefix="otel-train-sink-http-large")
            large = self._large
        return await asyncio.get_running_loop().run_in_executor(large, self.ingest, signal, body, content_type,
                                                                encoding)

    def close_threads(self) -> None:
        """End the threads that decode large HTTP bodies (the receivers are stopped first)."""
        with self._lock:
            large, self._large = self._large, None
        if large is not None:
            large.shutdown(wait=False, cancel_futures=True)

    def ingest(self, signal: str, body: bytes, content_type: str | None, encoding: str | None) -> Taken:
        """Decode a whole request into rows, then hand them to the router. Returns the rows taken and what was
        refused alone (for OTLP's partial success).

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
        elif signal == "logs":
            request = parse_logs(body, content_type, encoding, limit)
            decoded = decode_logs(request, self._runs)
        else:
            raise DecodeError(f"unknown signal {signal!r}")
        n = decoded.points + len(decoded.spans) + len(decoded.logs)
        self.hangs.take(decoded)  # the sender is alive, even if its run refuses the request for now
        for run_id, count in decoded.unattributed.items():
            with self._lock:  # `ingest` also runs on the backpressure thread
                self.unattributed += count
                self.unattributed_runs.add(run_id)
            self._log.warning(f"unattributed:{run_id}",
                              "received %s data without the `train.run.id` resource attribute, written under the "
                              "run %r (fallback: service.name-service.instance.id, then service.name@host.name, "
                              "then service.name); set `train.run.id` (OTEL_RESOURCE_ATTRIBUTES) to choose the run "
                              "(logged at most once a minute per run)", signal, run_id)
        for kind, count in decoded.unsupported.items():
            with self._lock:
                first = kind not in self.unsupported
                self.unsupported[kind] = self.unsupported.get(kind, 0) + count
            if first:
                _logger.warning("received %s metric(s) of OTLP type `%s`, which the sink cannot write; they are "
                                "counted in /health `unsupported` (warned once per type)", count, kind)
        if decoded.refused:
            self._count_refused_points(decoded.refused)
        if n:
            try:
                self._route(signal, body, decoded)
            except OSError as err:
                if err.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                # Out of descriptors despite the budget (another process, a run of many ranks): a sender retries
                # this; nothing of the request was taken (a run that cannot open takes nothing).
                raise Overloaded(f"out of file descriptors ({err.strerror}); retry shortly",
                                 self.settings.retry_after_s) from None
        return taken(n, decoded.refused)

    def _route(self, signal: str, body: bytes, decoded: Decoded) -> None:
        """Hand a request to the router: whole (all its runs admitted, or none), or, when it has more runs than
        half the open-run limit (a collector's batch of many runs), run by run in turn.

        Run by run, a run that cannot open now (the limit is full of runs still writing) refuses the request
        retryably after the runs before it were taken; those are remembered by a digest of the request's bytes,
        so the sender's retry of the same bytes takes only the rest: each retry takes at least one more run, and
        none twice.
        """
        ids = {run.run_id for run in decoded.runs}
        if len(ids) <= max(1, self.router.max_open_runs // 2):
            self.router.ingest(decoded)
            return
        key = hashlib.blake2b(body, digest_size=16, person=signal.encode()[:16]).digest()
        with self._lock:
            entry = self._taken_in_turn.pop(key, None) or (threading.Lock(), set())
            self._taken_in_turn[key] = entry
            while len(self._taken_in_turn) > _IN_TURN_REMEMBERED:
                self._taken_in_turn.popitem(last=False)
        busy, taken = entry
        if not busy.acquire(blocking=False):  # a copy of it is being taken right now (a sender's early retry)
            raise Overloaded("the same request is being taken just now; retry shortly", self.settings.retry_after_s)
        try:
            for run_id, part in sorted(decoded.split_by_run().items()):
                if run_id in taken:
                    continue
                self.router.ingest(part)  # Overloaded: the sender retries; the runs taken so far are remembered
                taken.add(run_id)
            with self._lock:
                self._taken_in_turn.pop(key, None)
        finally:
            busy.release()

    def _count_refused_points(self, refused: dict[tuple[str, str], int]) -> None:
        """Points refused alone (the rest of their request is written): counted, each metric named once."""
        for (why, name), count in refused.items():
            with self._lock:
                self.points_refused[why] = self.points_refused.get(why, 0) + count
            if why == "bad_resource":  # `name` is what is wrong with the Resource
                self._log.warning(f"refused:{why}:{name}"[:200], "refused the data of one Resource (%d point(s), "
                                  "span(s) or log record(s)): %s; the other Resources of the request are written "
                                  "(counted in /health `points_refused`; logged once a minute per reason)", count,
                                  name)
                continue
            self._log.warning(f"refused:{why}:{name}"[:200], "refused %d point(s) of %s; the rest of the request is "
                              "written (counted in /health `points_refused`; logged once a minute per metric)", count,
                              refusal_reason(why, name[:200]))

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if not self._stopped else "stopping",
            "uptime_s": round(time.monotonic() - self._started_at, 1),
            "runs_open": self.router.runs_open,
            "max_open_runs": self.router.max_open_runs,
            "file_descriptors": self._fd_health(),
            "points": self.router.points_in,
            "spans": self.router.spans_in,
            "logs": self.router.logs_in,
            "hangs": self.hangs.stats(),
            "delivery": self.router.delivery_totals(),
            "errors": self.router.errors,
            "requests": self.router.requests,
            "held_bytes": self.router.held_bytes,
            "runs_closed": self.router.runs_closed,
            "backend_threads": self.router.pool.stats(),
            "aggregate_rows_dropped": self.router.aggregate_dropped,
            "collisions": self.router.collisions(),
            "late_delta_points": self.router.late_deltas(),
            "steps_order_skipped": self.router.order_skipped(),
            "reorder_held": sum(h.held for h in self.reorder_holds()),
            "redelivered_skipped": self._redelivered_now(),
            "spool_replay": (self.spool_replay.stats() if self.spool_replay is not None
                             else {"runs_found": 0, "runs_replayed": 0, "runs_left": 0, "done": True}),
            "rejected": dict(self.rejected),
            "unattributed_resources": self.unattributed,
            "unsupported": dict(self.unsupported),
            "points_refused": dict(self.points_refused),
        }

    def _fd_health(self) -> dict[str, Any]:
        return {"in_use": fds_in_use(), "limit": self.fds.limit, "reserve": self.fds.reserve,
                "runs_refused": self.fds.refused, "max_connections": self.max_connections}

    def runs(self) -> dict[str, Any]:
        """The `/runs` document; runs named by a fallback (no `train.run.id`) say ``"unattributed": true``."""
        doc = self.router.summary()
        for run in doc["runs"]:
            run["unattributed"] = run["run_id"] in self.unattributed_runs
        return doc

    def run_hangs(self, run_id: str) -> dict[str, Any] | None:
        """The `/runs/<run id>/hangs` document (`otel_train.sink.runs.live_hangs`); None for a run not heard from."""
        return self.hangs.document(run_id)
