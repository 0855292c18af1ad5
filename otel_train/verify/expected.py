"""What each backend of a run should hold, from the run's record (`otel_train.ship.logged_record`).

Per rank and backend: every recorded scalar as the backend gets it (its routing rule applied again: a row the
rule keeps from it is "skipped by rule", with the rule's display names), less what a declared resume
superseded; the spans likewise; and what the delivering processes counted as not written, by cause.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from otel_train.ship.logged_record import FULL_MARK, read_entries, record_files

__all__ = ["DISK_FULL_IN_FLIGHT", "KILLED_IN_FLIGHT", "BackendPlan", "Expected", "RankPlan", "SeriesKey", "load"]

#: The loss cause of values recorded by a writer killed before its spool held their window.
KILLED_IN_FLIGHT = "killed before written ahead"
#: The same for a writer that was not killed: the disk was full (its record says so), so the spool never held them.
DISK_FULL_IN_FLIGHT = "not written ahead: the disk was full"


@dataclasses.dataclass(frozen=True)
class SeriesKey:
    """One recorded series: its tag as the backend gets it (display names applied), name, rank, attributes."""

    tag: str
    name: str
    rank: int
    attributes: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass
class Expected:
    """One backend's expected points of one rank, as lists in record order."""

    #: series -> [(step, value), ...]
    points: dict[SeriesKey, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    #: span name -> [step, ...]
    spans: dict[str, list[int | None]] = dataclasses.field(default_factory=dict)
    skipped_by_rule: int = 0


@dataclasses.dataclass
class BackendPlan:
    """One backend as the record describes it: its kind, where its store is, what it should hold."""

    name: str
    info: dict[str, Any]
    expected: Expected = dataclasses.field(default_factory=Expected)
    #: Rows not written, by cause (the delivering processes' counts), step-order drops as ``step_order``.
    lost: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def kind(self) -> str:
        return str(self.info.get("kind", self.name))


@dataclasses.dataclass
class RankPlan:
    rank: int
    #: The run folder verify was given (file backends are read there, so a moved run folder checks too).
    run_dir: Path = Path(".")
    run_id: str = ""
    run_name: str = ""
    world_size: int = 1
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    backends: dict[str, BackendPlan] = dataclasses.field(default_factory=dict)
    #: The highest step recorded before the record reached its cap or waited for space for good (None: neither).
    stopped_at: int | None = None
    #: Why it stopped there.
    stopped_why: str = ""
    #: A record file that could not be read to its end (a torn tail is normal; this is a missing header).
    problems: list[str] = dataclasses.field(default_factory=list)
    #: The last window seq the rank's spool wrote ahead (`otel_train.ship.spool.last_seq`; None: no spool folder).
    written_ahead: int | None = None


def load(run_dir: Path, ranks: Iterable[int] | None = None) -> dict[int, RankPlan]:
    """Every rank's plan (or only `ranks`'), from the run folder's record files, oldest writer first."""
    wanted = None if ranks is None else set(ranks)
    writers: list[tuple[float, Path, dict[str, Any]]] = []
    for path in record_files(run_dir):
        entries = read_entries(path)
        header = next(entries, None)
        if header is None or header.get("k") != "h":
            continue
        if wanted is not None and int(header.get("rank", 0)) not in wanted:
            continue
        writers.append((float(header.get("t", 0.0)), path, header))
    plans: dict[int, RankPlan] = {}
    seen: dict[int, set[int]] = {}  # per rank: the spooled windows' seqs already read
    for _, path, header in sorted(writers, key=lambda w: (w[0], w[1].name)):
        rank = int(header.get("rank", 0))
        plan = plans.get(rank)
        if plan is None:
            plan = plans[rank] = RankPlan(rank, run_dir, str(header.get("run_id", "")), str(header.get("run_name", "")),
                                          int(header.get("world_size", 1)), dict(header.get("env", {})),
                                          written_ahead=_written_ahead(run_dir, rank))
        _read_writer(plan, path, header, seen.setdefault(rank, set()))
    return plans


def _read_writer(plan: RankPlan, path: Path, header: dict[str, Any], seen: set[int]) -> None:
    from otel_train.config.routing import RowFilter
    from otel_train.config.settings import Route
    from otel_train.vocab.rows import MetricRow, SpanRow
    from otel_train.vocab.run_identity import RunInfo

    mine: list[BackendPlan] = []
    filters: dict[str, RowFilter | None] = {}
    infos = dict(header.get("backends", {}))
    ended = False  # the writer closed its record (else it was killed, or is still writing)
    for entry in read_entries(path):  # backends that started on their own thread: known once they were up
        if entry.get("k") == "b" and entry.get("name") in infos:
            infos[str(entry["name"])] = dict(entry.get("info") or {})
        ended = ended or entry.get("k") == "c"
    for name, info in infos.items():
        backend = plan.backends.get(name)
        if backend is None:
            backend = plan.backends[name] = BackendPlan(name, dict(info))
        mine.append(backend)
        rule = info.get("route")
        filters[name] = None if rule is None else RowFilter(
            Route(include=tuple(rule["include"]) or None, exclude=tuple(rule["exclude"]) or None,
                  every=int(rule["every"])), rank0_only=bool(rule["rank0_only"]),
            display_names=bool(rule["display_names"]))
    series: dict[int, list[Any]] = {}
    runs: dict[int, RunInfo] = {}
    losses: dict[str, Any] = {}
    waits: dict[int, int] = {}  # the record's waits for space without their end: n -> step
    for entry in read_entries(path):
        kind = entry.get("k")
        if kind in ("f", "F"):
            n, step = FULL_MARK.unpack(entry)
            if kind == "F":
                waits.pop(n, None)
            elif n:
                waits[n] = step
            continue
        if kind == "w":
            for sid, tag, name, rank, row_kind, attrs in entry.get("S", ()):
                series[int(sid)] = [tag, name, int(rank), row_kind, dict(attrs or {})]
            seq = entry.get("q")
            if seq is not None:
                if seq in seen:
                    continue
                seen.add(int(seq))
            rows: list[MetricRow] = []
            spans: list[SpanRow] = []
            for block in entry.get("m", ()):
                sid = int(block[0])
                steps = list(range(block[1], block[1] + block[2])) if len(block) == 4 else list(block[1])
                values = struct.unpack(f"<{len(steps)}d", block[-1])
                tag, name, rank, row_kind, attrs = series[sid]
                run = runs.get(rank) or runs.setdefault(rank, RunInfo(plan.run_id, plan.run_name, rank=rank))
                rows.extend(MetricRow(run, step, name, tag, value, row_kind, 0, attrs)
                            for step, value in zip(steps, values))
            for sid, step, span_id in entry.get("sp", ()):
                name, rank = series[int(sid)][1], series[int(sid)][2]
                run = runs.get(rank) or runs.setdefault(rank, RunInfo(plan.run_id, plan.run_name, rank=rank))
                spans.append(SpanRow(run, name, 0, int(span_id or 0), None, 0, 0, 0, "", step, {}))
            # Recorded right before the spool append by a writer killed before it (the whole job: nobody sent it
            # again): the window died with that process, as one still in the training process's memory would.
            # Its values stay expected; what a backend lacks of them is counted as lost to the kill, not failed.
            in_flight = (seq is not None and not ended and plan.written_ahead is not None
                         and int(seq) > plan.written_ahead)
            for backend in mine:
                added = _expect(backend, filters[backend.name], rows, spans)
                if in_flight:
                    backend.lost[KILLED_IN_FLIGHT] = backend.lost.get(KILLED_IN_FLIGHT, 0) + added
        elif kind == "r":
            for backend in plan.backends.values():
                _supersede(backend.expected, int(entry["rank"]), int(entry["step"]))
        elif kind == "l":
            losses = entry
        elif kind == "x":
            _stop(plan, int(entry.get("step", -1)), "the record reached its cap")
    for step in waits.values():
        _stop(plan, step, "the record could not be written: the disk was full")
    if waits:  # windows past what the spool wrote ahead were lost to the full disk, not to a kill
        for backend in plan.backends.values():
            n = backend.lost.pop(KILLED_IN_FLIGHT, 0)
            if n:
                backend.lost[DISK_FULL_IN_FLIGHT] = backend.lost.get(DISK_FULL_IN_FLIGHT, 0) + n
    for name, causes in dict(losses.get("lost", {})).items():
        if name in plan.backends:
            lost = plan.backends[name].lost
            for cause, n in dict(causes).items():
                lost[cause] = lost.get(cause, 0) + int(n)
    for name, n in dict(losses.get("order", {})).items():
        if name in plan.backends and n:
            lost = plan.backends[name].lost
            lost["step_order"] = lost.get("step_order", 0) + int(n)


def _stop(plan: RankPlan, step: int, why: str) -> None:
    """Nothing past `step` is checked for this rank (the earliest such step wins)."""
    if plan.stopped_at is None or step < plan.stopped_at:
        plan.stopped_at, plan.stopped_why = step, why


def _written_ahead(run_dir: Path, rank: int) -> int | None:
    """The last window seq rank `rank`'s spool wrote ahead (None: the run folder has no spool for it)."""
    from otel_train.ship.spool import last_seq, rank_spool

    folder = rank_spool(run_dir, rank)
    return last_seq(folder) if folder.is_dir() else None


def _expect(backend: BackendPlan, rule: Any, rows: list[Any], spans: list[Any]) -> int:
    """Add what `backend` should hold of `rows` and `spans` (its routing rule applied); how many points and spans."""
    expected = backend.expected
    kept_rows, kept_spans = rows, spans
    if rule is not None:
        kept_rows, _, kept_spans = rule.apply(rows, (), spans)
        expected.skipped_by_rule += len(rows) - len(kept_rows) + len(spans) - len(kept_spans)
    points = expected.points
    for row in kept_rows:
        key = SeriesKey(row.tag, row.name, row.run.rank, tuple(sorted(row.attributes.items())))
        points.setdefault(key, []).append((row.step, row.value))
    for span in kept_spans:
        expected.spans.setdefault(span.name, []).append(span.step)
    return len(kept_rows) + len(kept_spans)


def _supersede(expected: Expected, rank: int, step: int) -> None:
    """A resume of `rank` at `step`: what was expected before at steps >= `step` is superseded."""
    for key, points in expected.points.items():
        if key.rank == rank:
            points[:] = [p for p in points if p[0] < step]
