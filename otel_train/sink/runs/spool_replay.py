"""At start, the sink delivers what an earlier sink process left in its runs' spools.

A sink killed (or crashed) with windows its backends had not made durable keeps them in each run's spool, and a
run's spool is read again when the run is opened. A run that sends again after the restart is opened by its
request; one whose job ended while the sink was down never would be. So at start a background thread lists the
spool folders holding windows some backend has not acknowledged and opens each such run like a request would:
delivery hands the spooled windows over, the run is flushed and, if no request reached it meanwhile, closed
(which removes its spool's segments once every backend holds everything, keeping the run's series state,
`otel_train.sink.runs.state`); then the next. It never blocks the receivers, at
most `workers` runs are open for it at once, and it waits (like a refused request) while the sink has
`--max-open-runs` runs open. A run that sends meanwhile is the same run: its requests go to the run the replay
opened, and it is left open (closed later when idle, as any run).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from otel_train.sink.runs.feed import spool_folder

if TYPE_CHECKING:
    from collections.abc import Sequence

    from otel_train.sink.runs.router import Router
    from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow

__all__ = ["SpoolReplay", "unfinished_spools"]

_logger = logging.getLogger(__name__)
_FLUSH_S = 300.0  # how long one run's spooled windows may take to deliver before it is closed anyway
_READ_TRIES = 16  # spooled windows looked at to find a run id (a window always has rows; this is a bound)


def unfinished_spools(spool_dir: Path) -> list[tuple[str, Path]]:
    """(run id, folder) of every run spool under `spool_dir` holding windows a backend has not acknowledged,
    oldest folder first. A folder this sink cannot read a run id from is left alone (warned)."""
    if not spool_dir.is_dir():
        return []
    found = []
    folders = sorted((p for p in spool_dir.iterdir() if p.is_dir() and any(p.glob("*.seg"))),
                     key=lambda p: _mtime(p))
    for folder in folders:
        try:
            run_id = _unacknowledged_run(folder)
        except Exception as err:  # one unreadable folder must not stop the others
            _logger.warning("cannot read the spool %s (%s); its windows are not replayed", folder, err)
            continue
        if run_id is not None:
            found.append((run_id, folder))
    return found


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _unacknowledged_run(folder: Path) -> str | None:
    """The run id of `folder`'s spool if some window in it is past a backend's acknowledged cursor, else None.

    Kill-safe backends (JSONL) record their writes apart from the acknowledged cursors: counting only the
    latter may open a run that has nothing left to write (it is closed at once), never miss one."""
    from otel_train.ship.framing import decode_window
    from otel_train.ship.spool import Spool

    spool = Spool(folder)
    floor = min(spool.cursors.values(), default=0)
    for tries, (_seq, _step, payload) in enumerate(spool.read(floor)):
        if tries >= _READ_TRIES:
            break
        window = decode_window(payload)
        rows: Sequence[MetricRow | HistogramRow | SpanRow | LogRow] = (window.metrics or window.histograms or window.spans
                                                                       or window.logs)
        if not rows:
            continue
        run_id = str(rows[0].run.run_id)
        if spool_folder(run_id) != folder.name:
            _logger.warning("the spool %s holds windows of run %r, which this sink keeps in %s; left alone", folder,
                            run_id, spool_folder(run_id))
            return None
        return run_id
    return None


class SpoolReplay:
    """The background delivery of unfinished spools at start (module docstring).

    Args:
        router: The sink's router (opens and closes runs).
        spool_dir: The sink's spool folder.
        stop: Set when the sink stops: no run is opened after it.
        workers: Runs replayed at once.
    """

    def __init__(self, router: Router, spool_dir: Path, stop: threading.Event, workers: int = 2) -> None:
        self._router = router
        self._spool_dir = spool_dir
        self._stop = stop
        self._workers = max(1, workers)
        self._lock = threading.Lock()
        #: Runs found with unacknowledged windows; replayed so far; left (still being replayed or waiting).
        self.found = 0
        self.replayed = 0
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SpoolReplay:
        self._thread = threading.Thread(target=self._run, name="otel-train-sink-replay", daemon=True)
        self._thread.start()
        return self

    def stats(self) -> dict[str, int | bool]:
        """`/health`'s ``spool_replay``: runs found at start, replayed, still to replay, and whether it is done
        (until then ``runs_left`` counts only the runs found so far: the spool folder may still be being read)."""
        with self._lock:
            return {"runs_found": self.found, "runs_replayed": self.replayed,
                    "runs_left": self.found - self.replayed, "done": self.done.is_set()}

    def _run(self) -> None:
        try:
            spools = unfinished_spools(self._spool_dir)
            with self._lock:
                self.found = len(spools)
            if spools:
                _logger.info("delivering what %d run(s) left in their spools before this sink started", len(spools))
                with ThreadPoolExecutor(self._workers, thread_name_prefix="otel-train-sink-replay") as pool:
                    list(pool.map(self._replay, [run_id for run_id, _ in spools]))
        except Exception:
            _logger.exception("replaying the runs' spools failed")
        finally:
            self.done.set()

    def _replay(self, run_id: str) -> None:
        from otel_train.sink.runs.router import Overloaded

        try:
            while True:
                if self._stop.is_set():
                    return
                try:
                    state = self._router.open_run(run_id)
                    break
                except Overloaded as err:  # every open run is busy, or the run is being closed: wait, retry
                    self._stop.wait(err.retry_after_s)
            opened = state.last_seen
            state.flush(_FLUSH_S)
            if not self._stop.is_set():
                self._router.close_if_idle(state, opened, "its spool was delivered after a restart")
            with self._lock:
                self.replayed += 1
        except Exception:
            _logger.exception("run %r: delivering its spool failed", run_id)

    def wait(self, timeout_s: float) -> bool:
        """Wait until every run found was replayed (tests, tools)."""
        return self.done.wait(timeout_s)
