"""One run of the sink: its backends, fed by `otel_train.ship.delivery.Delivery` (on the pool's threads),
its spool, and what it has seen (steps per rank, series, points); `otel_train.sink.runs.router` holds the runs."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train.ship.spool import backend_file
from otel_train.sink.decode.requests import Decoded
from otel_train.sink.runs.aggregate import Aggregator
from otel_train.sink.runs.pool import BackendPool
from otel_train.sink.runs.reorder import ReorderHold
from otel_train.sink.runs.state import JOURNAL_FILE, SNAPSHOT_FILE, RunState
from otel_train.sink.runs.temporality import SeriesLedger
from otel_train.vocab.run_identity import RunInfo

if TYPE_CHECKING:
    from otel_train.backend import RowExporter

__all__ = ["RunFeed", "released_file", "spool_folder"]

_NO_RUN = RunInfo(run_id="", run_name="")  # a spooled window's rows carry their own runs
_STATE_FILES = frozenset({SNAPSHOT_FILE, JOURNAL_FILE})
_logger = logging.getLogger(__name__)


class RunFeed:
    """One training run: its backends (fed by `Delivery`, on the pool's threads) and what it has seen."""

    def __init__(self, run_id: str, exporters: list[RowExporter], converter: SeriesLedger,
                 aggregator: Aggregator | None, queue_windows: int, on_error: Callable[[], None],
                 spool_path: Path | None = None, pool: BackendPool | None = None) -> None:
        from otel_train.ship.delivery import Delivery  # lazy: it pulls in the framing of the exporter process
        from otel_train.ship.spool import Spool

        self.run_id = run_id
        self.run_name = run_id
        self.world_size = 1
        self.exporters = exporters
        self.converter = converter
        self.aggregator = aggregator
        self.lock = threading.Lock()
        #: Set (under `lock`, or before the router hands the run out again) once the run is being closed: a
        #: request that finds it set is refused with a retry-after, never written into a closing spool.
        self.closing = False
        self.last_seen = time.monotonic()
        self.last_step: dict[int, int] = {}
        self.series: set[str] = set()
        self.points = 0
        self.spans = 0
        self.write_errors = 0
        self._on_error = on_error
        self._queue_windows = queue_windows
        self.spool = Spool(spool_path) if spool_path is not None else None
        self._seq = self.spool.last_seq if self.spool is not None else 0
        self.state = RunState(spool_path) if spool_path is not None else None
        if self.state is not None and converter.persistent:
            self._restore()
        self._sizes: deque[tuple[int, int]] = deque()  # (seq, bytes) of spooled windows not yet handed over
        self.held_bytes = 0
        # Without a spool a full queue pushes back on the sender (UNAVAILABLE / 503), whose retry re-sends.
        self.spool_path = spool_path
        named = _named(exporters)
        # Backends behind a reorder hold: with a spool, delivery flushes them every second while they hold rows
        # (held rows keep its cursor back); without one, the sink's housekeeping asks for that flush.
        self.holds = [e for e in exporters if isinstance(e, ReorderHold)]
        for name, exporter in named.items():
            if isinstance(exporter, ReorderHold):
                if spool_path is not None:  # what it wrote is never written again after a restart
                    exporter.remember_released(spool_path / released_file(name))
                else:
                    exporter.on_due = self._flush_soon
        self.delivery = Delivery(named, self.spool, queue_windows, self._error,
                                 thread_name=f"otel-train-sink[{run_id}]", pool=pool)

    def _restore(self) -> None:
        """The ledger as the run's spool folder holds it (the state a closed, killed or restarted sink left),
        written back whole so that the journal starts empty."""
        assert self.state is not None
        snapshot, records = self.state.read(self._seq)
        if snapshot is None and not records and not self.state.journal_path.exists():
            return  # a new run
        try:
            self.converter.load(snapshot, records)
            self.converter.loaded()
        except Exception as err:  # a state file of another version, or damaged: never a run that cannot open
            _logger.warning("run %r: its series state in %s cannot be read (%s); it starts afresh, so points it "
                            "already wrote may be written again", self.run_id, self.state.folder, err)
            self.converter = SeriesLedger(persistent=True)
        self.save_state()

    def save_state(self) -> bool:
        """Write the ledger whole (covering the spool's windows so far); whether it was written."""
        if self.state is None or not self.converter.persistent:
            return True
        try:
            self.state.write(self._seq, self.converter.dump())
            return True
        except (OSError, TypeError) as err:
            _logger.warning("run %r: cannot write its series state in %s (%s); after a restart, points it already "
                            "wrote may be written again", self.run_id, self.state.folder, err)
            return False

    def close_state(self) -> None:
        """Close the series state's journal (the run is closed: nothing is appended to it any more)."""
        if self.state is not None:
            self.state.close()

    def forget_spool(self) -> None:
        """Every backend holds everything: remove the spool's segments and records, keep the series state (written
        first as covering no window: the next spool starts from seq 1)."""
        assert self.spool_path is not None
        self._seq = 0
        if not self.save_state():
            return  # the journal's seqs still refer to this spool: keep it
        try:
            entries = list(self.spool_path.iterdir())
        except OSError:
            return
        for entry in entries:
            if entry.name in _STATE_FILES:
                continue
            try:
                if entry.is_dir():
                    import shutil

                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
            except OSError:
                pass

    def _error(self, _backend: str) -> None:
        self.write_errors += 1
        self._on_error()

    def release(self) -> int:
        """Forget the spooled windows every backend has been handed; returns the bytes released."""
        if self.spool is None:
            return 0
        handed = self._seq - self.delivery.pending
        freed = 0
        while self._sizes and self._sizes[0][0] <= handed:
            freed += self._sizes.popleft()[1]
        self.held_bytes -= freed
        return freed

    def behind(self, budget_bytes: int) -> str | None:
        """Why this run cannot take a request now (None: it can). Changes nothing but the release of bytes."""
        if self.spool is not None:
            if self.held_bytes >= budget_bytes:
                return f"holds {self.held_bytes:,} bytes its backends have not taken (budget {budget_bytes:,})"
            return None
        if not self.delivery.has_room():
            return f"{self.delivery.pending} requests queued for its backends (queue {self._queue_windows})"
        return None

    def put(self, item: Decoded) -> int:
        """Queue one request's rows for every backend (under self.lock, after `behind` said yes): written
        ahead to the spool if there is one, with the ledger's changes since `SeriesLedger.begin` (committed once
        both are written). Returns the bytes spooled.

        Raises:
            OSError: the spool or the ledger's journal could not be written: nothing of the request was taken
                (the ledger's changes are undone) and it must be refused.
        """
        from otel_train.backend import Window

        steps = [r.step for r in item.metrics] + [h.step for h in item.histograms]
        max_step = max(steps, default=-1)
        window = Window(item.metrics, item.histograms, item.spans, item.logs)
        if self.spool is None:
            # Cannot fail: room was checked under this lock and only the backends' threads take from the queues.
            self.delivery.submit_window(window, max_step, 0.0)
            return 0
        from otel_train.ship.framing import encode_window

        payload, _ = encode_window(_NO_RUN, (), item.metrics, item.histograms, item.spans, item.logs)
        seq = self._seq + 1
        ledger, state = self.converter, self.state
        assert state is not None
        mark = -1
        try:
            if ledger.persistent:
                mark = state.append(seq, ledger.changes())
            if not self.spool.append(seq, max_step, payload):
                raise OSError(f"cannot write the spool {self.spool.path} (disk full?)")
        except OSError:
            if mark >= 0:
                state.cut(mark)
            ledger.rollback()
            raise
        ledger.commit()
        self._seq = seq
        self.delivery.submit(seq, max_step, payload, window)  # already spooled: queued for the backends
        self._sizes.append((seq, len(payload)))
        self.held_bytes += len(payload)
        if ledger.persistent and state.due():
            self.save_state()
        return len(payload)

    def backlogged(self) -> bool:
        return self.delivery.backlogged()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued request is written and every backend flushed, held rows included."""
        deadline = time.monotonic() + timeout_s
        ok = self.delivery.flush(deadline)
        if self.holds:
            # Every request is handed over now: whichever flush runs next releases all of it (a flush of the
            # hold asked before a request was handed over could leave that request's rows held).
            for hold in self.holds:
                hold.drain_at_next_flush()
            ok = self.delivery.flush(deadline) and ok
        return ok

    def _flush_soon(self) -> None:
        """Ask every backend for a flush, without waiting (releases a hold's due rows)."""
        self.delivery.flush(time.monotonic())

    @property
    def pending(self) -> int:
        return self.delivery.pending

    @property
    def written(self) -> int:
        return self.delivery.rows_written

    def stop(self, timeout_s: float) -> bool:
        """Finish the queues, then flush and close the backends; whether every backend holds everything."""
        return self.delivery.close(time.monotonic() + timeout_s)

    def summary(self) -> dict[str, Any]:
        backends = self.delivery.backend_stats()
        return {
            "run_id": self.run_id,
            "run_name": self.run_name,
            "world_size": self.world_size,
            "ranks": {str(r): {"last_step": s} for r, s in sorted(self.last_step.items())},
            # the run's highest step, kept with its state: also what the sink saw before a restart
            "last_step": _step_or_none(max(self.last_step.values(), default=-1), self.converter.current_step),
            "series": len(self.series),
            "points": self.points,
            "spans": self.spans,
            "written": self.written,
            "failed": max((int(b["rows_failed"]) for b in backends.values()), default=0),
            "queued": self.pending,
            # per backend: rows it took, rows of writes that failed, requests not yet handed to it
            "backends": {name.removesuffix(" (sink)"): {"written": int(b["rows_written"]),
                                                         "failed": int(b["rows_failed"]), "pending": int(b["backlog"])}
                         for name, b in backends.items()},
            "write_errors": self.write_errors,
            "held_bytes": self.held_bytes,
            "reorder_held": sum(h.held for h in self.holds),
            "redelivered_skipped": sum(h.redelivered for h in self.holds),
            "collisions": self.converter.collisions,
            "collided_series": list(self.converter.collided),
            "late_points": self.converter.late_points,
            "late_delta_points": self.converter.late_delta_points,
            "stale_totals": self.converter.stale_totals,
            "nan_points": self.converter.nan_points,
            "window_skipped": self.converter.window_skipped,
            "retries_skipped": self.converter.retries_skipped,
            "idle_s": round(time.monotonic() - self.last_seen, 1),
            "aggregates_pending": self.aggregator.pending_steps if self.aggregator else 0,
        }


def _step_or_none(*steps: int) -> int | None:
    top = max(steps)
    return top if top >= 0 else None


def spool_folder(run_id: str) -> str:
    """The folder of a run's spool: readable, and one per run id (two ids never share a spool).

    Example:
        >>> spool_folder("team/a"), spool_folder("team_a")
        ('team_a-65f838a2fbff', 'team_a-112cd0cb52ee')
    """
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)[:64].lstrip(".") or "run"
    return f"{readable}-{hashlib.sha256(run_id.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"


def released_file(backend: str) -> str:
    """The file in a run's spool folder where a held backend records the steps it holds (`ReleasedSteps`).

    Example:
        >>> released_file("tensorboard (sink)")
        'released.tensorboard__sink_'
    """
    return backend_file("released", backend)


def _named(exporters: list[RowExporter]) -> dict[str, RowExporter]:
    """Backend name -> exporter; a name given twice gets a numeric suffix. Names end in `` (sink)``: the
    spool keeps a file per backend named after it, which must not look like a backend's own file
    (``written.jsonl`` would be read as a JSONL log by whoever globs the output folder)."""
    out: dict[str, RowExporter] = {}
    for exporter in exporters:
        name = base = str(getattr(exporter, "name", type(exporter).__name__)) + " (sink)"
        n = 1
        while name in out:
            n += 1
            name = f"{base}#{n}"
        out[name] = exporter
    return out
