"""The sink's live roll call (`GET /runs/<run id>/hangs`): which ranks of a run are stuck where, on any machine.

Per run and rank the sink keeps two things: the latest `train.hang` log record it received (the hang watchdog's,
`otel_train.hangs.watchdog`; see docs/semantic-conventions.md) and when it last received anything from that rank
(metrics, spans or logs: its heartbeat). `files` shapes them like the ranks' ``hang/rank<N>.json``
(`otel_train.hangs.hang_file`), so `otel_train.hangs.roll_call.take_roll_call` gives the same groups, suspects and
sentence as ``otel-train hangs RUN_DIR``.

Heartbeats come from what the ranks send anyway, so their gap is the export interval (`HEARTBEAT_S`, otel-train's
default ``OTEL_TRAIN_EXPORT_INTERVAL_S``); a stuck rank sends its next record when its wait doubles, so its gap is
at least its last wait. A rank quiet for longer than the roll call's limit (3 gaps + 10 s) while some rank of the
run is stuck has stopped (a dead node) and is named from its last record. The sink is told nothing when a rank
ends, so while no rank is stuck a quiet rank counts as ended. Times are the sink's receive times (one clock for
every machine).

Memory: one record per (run, rank), without the threads' stacks (those stay in the rank's file and the log record
itself); a run is dropped once it has sent nothing for `keep_s` (the sink's ``idle_s``, when the router closes it)
plus its roll call's limit, and at most `max_ranks` (run, rank) entries are kept (the run heard from longest ago
goes first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from otel_train.hangs.roll_call import RollCall, silent_after_s, take_roll_call
from otel_train.vocab import semconv

if TYPE_CHECKING:
    from otel_train.sink.decode.requests import Decoded

__all__ = ["HEARTBEAT_S", "LiveHangs", "hang_record"]

_logger = logging.getLogger(__name__)

HEARTBEAT_S = 30.0
"""The gap expected between two requests of a live rank, in seconds (otel-train's default export interval)."""
LOG_EVERY_S = 60.0
"""The status line of a run with a stuck rank is logged at most this often."""
_MAX_RANKS = 100_000
_MISSING = "never heard from"  # ranks below the world size that sent nothing
_MAX_WORLD = 65_536  # a sender's `train.world_size` above this is taken as this (the roll call lists the missing)

#: The record's field <- the log record's attribute (the inverse of the watchdog's `_log`).
_FIELDS = (("phase", semconv.HANG_PHASE), ("waited_s", semconv.HANG_WAITED), ("limit_s", semconv.HANG_LIMIT),
           ("usual_s", semconv.HANG_USUAL), ("main_frame", semconv.HANG_FRAME),
           ("user_frame", semconv.HANG_USER_FRAME), ("native", semconv.HANG_NATIVE), ("file", semconv.HANG_FILE))


def hang_record(attributes: Mapping[str, Any], step: int | None, time_s: float) -> dict[str, Any] | None:
    """The hang record (the shape of ``latest`` in ``hang/rank<N>.json``) of a log record's attributes; None for a
    record that is no `train.hang` record.

    Args:
        attributes: The log record's attributes (``event.name``, ``train.hang.*``).
        step: The log record's step (``train.step``).
        time_s: When it was recorded (the sink: when it was received), in seconds since the epoch.

    Example:
        >>> rec = hang_record({"event.name": "train.hang", "train.hang.state": "stuck", "train.hang.phase": "data",
        ...                    "train.hang.waited_s": 4.0, "train.hang.frame": "train.py:41 in load_batch",
        ...                    "train.hang.spans": ("train", "data")}, 50, 1000.0)
        >>> rec["state"], rec["step"], rec["phase"], rec["spans"], rec["main_frame"], rec["waited_s"]
        ('stuck', 50, 'data', ['train', 'data'], 'train.py:41 in load_batch', 4.0)
        >>> hang_record({"event.name": "other"}, 1, 1000.0) is None
        True
    """
    if attributes.get("event.name") != semconv.TRAIN_HANG:
        return None
    state = attributes.get(semconv.HANG_STATE)
    if state not in ("stuck", "resumed", "ended"):  # ended: the rank ended while stuck (its last record)
        return None
    record: dict[str, Any] = {"event.name": semconv.TRAIN_HANG, "state": state, "time": time_s, "step": step}
    spans = attributes.get(semconv.HANG_SPANS)
    record["spans"] = [str(s) for s in spans] if isinstance(spans, (list, tuple)) else []
    for field, key in _FIELDS:
        value = attributes.get(key)
        if field.endswith("_s"):
            value = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        record[field] = value
    record["native"] = bool(record["native"])
    return record


class _Rank:
    __slots__ = ("heard", "host", "latest", "step", "world_size")

    def __init__(self, heard: float, host: str, world_size: int) -> None:
        self.heard = heard  # when the sink last received anything from it
        self.host = host
        self.world_size = world_size
        self.step: int | None = None  # the highest step seen
        self.latest: dict[str, Any] | None = None  # its latest `train.hang` record

    def gap_s(self, heartbeat_s: float) -> float:
        """How long this rank may be quiet between two requests: a stuck rank's next record comes when its wait
        doubles."""
        latest = self.latest
        if latest is not None and latest["state"] == "stuck":
            return max(heartbeat_s, float(latest.get("waited_s") or 0.0))
        return heartbeat_s


class _Run:
    __slots__ = ("heard", "logged_at", "ranks", "reported")

    def __init__(self) -> None:
        self.ranks: dict[int, _Rank] = {}
        self.heard = 0.0
        self.reported = False  # its status line said some rank is stuck
        self.logged_at = -float("inf")


class LiveHangs:
    """Per run and rank: the latest `train.hang` record and the heartbeat; the roll call of a run (module docstring).

    Safe from any thread: `take` runs on the receivers' threads, `tick` on the sink's housekeeping thread,
    `document` on the HTTP server's.

    Args:
        heartbeat_s: The gap expected between two requests of a live rank.
        keep_s: A run that has sent nothing for this long plus its roll call's limit is dropped.
        clock: The wall clock (a fake in tests).
        max_ranks: (run, rank) entries kept at most.
    """

    def __init__(self, heartbeat_s: float = HEARTBEAT_S, keep_s: float = 300.0,
                 clock: Callable[[], float] = time.time, max_ranks: int = _MAX_RANKS) -> None:
        self.heartbeat_s = heartbeat_s
        self.keep_s = keep_s
        self._clock = clock
        self._max_ranks = max_ranks
        self._runs: OrderedDict[str, _Run] = OrderedDict()  # heard from longest ago first
        self._entries = 0
        self._lock = threading.Lock()

    def take(self, decoded: Decoded) -> None:
        """One received request: a heartbeat for each of its ranks, and its `train.hang` records."""
        if not decoded.runs and not decoded.logs:
            return
        now = self._clock()
        with self._lock:
            for run, step in decoded.runs.items():
                rank = self._rank(run.run_id, run.rank, run.host, run.world_size, now)
                if step >= 0 and (rank.step is None or step > rank.step):
                    rank.step = step
            for row in decoded.logs:
                record = hang_record(row.attributes, row.step, now)
                said = row.attributes.get(semconv.TRAIN_RANK) if record is not None else None
                number = said if isinstance(said, int) and not isinstance(said, bool) else row.run.rank
                rank = self._rank(row.run.run_id, number, row.run.host, row.run.world_size, now)
                if record is not None:
                    rank.latest = record
                if row.step is not None and (rank.step is None or row.step > rank.step):
                    rank.step = row.step
            while self._entries > self._max_ranks and len(self._runs) > 1:
                _, dropped = self._runs.popitem(last=False)
                self._entries -= len(dropped.ranks)

    def _rank(self, run_id: str, number: int, host: str, world_size: int, now: float) -> _Rank:
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _Run()
        else:
            self._runs.move_to_end(run_id)
        run.heard = now
        rank = run.ranks.get(number)
        if rank is None:
            rank = run.ranks[number] = _Rank(now, host, 0)
            self._entries += 1
        rank.heard = now
        rank.host = host or rank.host
        rank.world_size = min(max(rank.world_size, world_size), _MAX_WORLD)
        return rank

    def files(self, run_id: str) -> dict[int, dict[str, Any]] | None:
        """The run's ranks shaped as their hang files (`take_roll_call`'s input); None for a run not heard from."""
        with self._lock:
            run = self._runs.get(run_id)
            return None if run is None else self._files(run_id, run, self._clock())

    def _files(self, run_id: str, run: _Run, now: float) -> dict[int, dict[str, Any]]:
        some_stuck = any(r.latest is not None and r.latest["state"] == "stuck" for r in run.ranks.values())
        out = {}
        for number, rank in run.ranks.items():
            gap_s = rank.gap_s(self.heartbeat_s)
            state = rank.latest["state"] if rank.latest is not None else "running"
            if not some_stuck and now - rank.heard > silent_after_s(gap_s):
                state = "ended"  # nobody waits for it: it ended, as far as the sink can tell
            out[number] = {"rank": number, "world_size": rank.world_size, "run_id": run_id, "host": rank.host,
                           "state": state, "step": rank.step, "heartbeat_time": rank.heard, "heartbeat_s": gap_s,
                           "latest": rank.latest}
        return out

    def roll_call(self, run_id: str) -> RollCall | None:
        """The run's roll call now; None for a run not heard from (or dropped)."""
        now = self._clock()
        with self._lock:
            run = self._runs.get(run_id)
            files = None if run is None else self._files(run_id, run, now)
        return None if files is None else take_roll_call(files, now, _MISSING)

    def document(self, run_id: str) -> dict[str, Any] | None:
        """`GET /runs/<run id>/hangs`: the roll call as ``otel-train hangs --json`` prints it, with ``run_id`` and
        ``status`` (its one-line sentence); None for a run not heard from."""
        call = self.roll_call(run_id)
        if call is None:
            return None
        return {"run_id": run_id, "status": call.verdict(), **call.to_json()}

    def tick(self) -> None:
        """Housekeeping: log each run's status line while some rank is stuck (at most every `LOG_EVERY_S`), once
        more when none is; drop runs quiet past `keep_s` plus their roll call's limit."""
        now = self._clock()
        due: list[tuple[str, dict[int, dict[str, Any]]]] = []
        with self._lock:
            for run_id, run in list(self._runs.items()):
                longest_s = max((r.gap_s(self.heartbeat_s) for r in run.ranks.values()), default=self.heartbeat_s)
                if now - run.heard > self.keep_s + silent_after_s(longest_s):
                    del self._runs[run_id]
                    self._entries -= len(run.ranks)
                    continue
                stuck = any(r.latest is not None and r.latest["state"] == "stuck" for r in run.ranks.values())
                if stuck or run.reported:
                    due.append((run_id, self._files(run_id, run, now)))
        for run_id, files in due:
            call = take_roll_call(files, now, _MISSING)
            with self._lock:
                kept = self._runs.get(run_id)
                if kept is None:
                    continue
                if call.stuck and now - kept.logged_at >= LOG_EVERY_S:
                    kept.reported, kept.logged_at = True, now
                elif not call.stuck and kept.reported:
                    kept.reported, kept.logged_at = False, -float("inf")
                else:
                    continue
            if call.stuck:
                _logger.warning("run %r: %s (GET /runs/%s/hangs; logged at most once a minute while a rank is "
                                "stuck)", run_id, call.verdict(), run_id)
            else:
                _logger.warning("run %r resumed: %s", run_id, call.verdict())

    def stats(self) -> dict[str, int]:
        """`/health`'s ``hangs``: runs and (run, rank) entries kept, runs with a stuck rank."""
        with self._lock:
            stuck = sum(any(r.latest is not None and r.latest["state"] == "stuck" for r in run.ranks.values())
                        for run in self._runs.values())
            return {"runs": len(self._runs), "ranks": self._entries, "runs_stuck": stuck}
