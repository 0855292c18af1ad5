"""`otel-train verify RUN_DIR`: read every local backend of a run back and compare it with the run's record.

The record (`otel_train.ship.logged_record`, ``<run folder>/verify/``) holds every window the delivery engine
handed the backends. For each rank and backend, each series is compared as lists of (step, value)
(`otel_train.verify.compare`): expected, present, missing, duplicated, wrong value, unexpected step; rows a
routing rule keeps from a backend are "skipped by rule"; rows the delivery counted as not written (a bad
value, a row the backend refused, a window given up, a step it cannot store) and values refused at the call
(`Session.refusals`) are reported with their cause. A backend passes when every value it should hold is
there once, or its missing values are accounted for by such counts. A backend that cannot be read back here
is "not checked", never "pass"; past the record's cap, "not checked past step S".

API (for tools, and for `otel-train replay`, which re-delivers what is missing)::

    report = otel_train.verify.check(Path("otel-train-runs/demo"))
    report.ok                         # every checked backend holds every value once, or it is accounted for
    for b in report.backends:         # one BackendReport per (rank, backend)
        b.rank, b.backend, b.status   # "pass", "fail" or "not checked"
        b.missing_points()            # [(series as the backend names it, step), ...]
    report.missing(rank, backend)     # the same, looked up
    report.to_json()                  # what `otel-train verify --json` prints
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from otel_train.verify.compare import SeriesResult

__all__ = ["BackendReport", "VerifyReport", "check", "format_report"]

_SHOWN_PER_SERIES = 5  # problems listed per series in the text report


@dataclasses.dataclass
class BackendReport:
    """One backend of one rank."""

    rank: int
    backend: str
    status: str  # "pass", "fail", "not checked"
    reason: str = ""
    where: str = ""
    expected: int = 0
    present: int = 0
    missing: int = 0
    duplicated: int = 0
    wrong_value: int = 0
    unexpected: int = 0
    skipped_by_rule: int = 0
    spans_expected: int = 0
    spans_missing: int = 0
    spans_duplicated: int = 0
    #: Rows the delivery counted as not written, by cause (they account for missing rows).
    lost: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The record stopped after this step (its cap, a disk that stayed full): nothing later is checked.
    not_checked_past: int | None = None
    #: Why it stopped there.
    not_checked_why: str = ""
    #: Whether its scalars were compared (the Chrome trace's counter events carry no step: only its spans are).
    scalars_checked: bool = True
    #: Series with a problem.
    series: list[SeriesResult] = dataclasses.field(default_factory=list)
    #: Span names with a problem: name -> (missing steps, duplicated steps).
    span_problems: dict[str, tuple[list[Any], list[Any]]] = dataclasses.field(default_factory=dict)

    def missing_points(self) -> list[tuple[str, int]]:
        """(series, step) of every missing value, as the backend names the series."""
        return [(s.series, step) for s in self.series for step in s.missing]


@dataclasses.dataclass
class VerifyReport:
    run_dir: Path
    backends: list[BackendReport] = dataclasses.field(default_factory=list)
    #: Values refused at the call (never logged), by cause, summed over ranks.
    refusals: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Why nothing could be checked (no record), else "".
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and all(b.status != "fail" for b in self.backends)

    @property
    def exit_code(self) -> int:
        """0: every checked backend passes; 1: a backend fails; 2: nothing could be checked (no record)."""
        return 2 if self.problem else (0 if self.ok else 1)

    def missing(self, rank: int, backend: str) -> list[tuple[str, int]]:
        return [p for b in self.backends if b.rank == rank and b.backend == backend for p in b.missing_points()]

    def verdict(self) -> str:
        """One clause for the summary line: ``verify: pass (3 backends; 1 not checked)``."""
        if self.problem:
            return f"verify: {self.problem}"
        failed = [f"{b.backend}" + (f" rank {b.rank}" if b.rank else "") for b in self.backends if b.status == "fail"]
        unchecked = sum(b.status == "not checked" for b in self.backends)
        checked = len(self.backends) - unchecked
        extra = f"; {unchecked} not checked" if unchecked else ""
        if failed:
            return f"verify: FAIL in {', '.join(failed)} (`otel-train verify {self.run_dir}`){extra}"
        stops = [b.not_checked_past for b in self.backends if b.not_checked_past is not None]
        until = f" up to step {min(stops)}, not past it" if stops else ""  # the record stopped there (cap, disk)
        return f"verify: pass{until} ({checked} backend{'s' if checked != 1 else ''}{extra})"

    def to_json(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "ok": self.ok, "problem": self.problem, "refusals": self.refusals,
                "backends": [dataclasses.asdict(b) for b in self.backends]}


def check(run_dir: Path, ranks: list[int] | None = None) -> VerifyReport:
    """Compare every local backend of the run in `run_dir` with the run's record (`ranks`: only those)."""
    from otel_train.verify.expected import load

    run_dir = Path(run_dir)
    report = VerifyReport(run_dir)
    plans = load(run_dir, ranks)
    sessions = _session_ranks(run_dir, ranks)
    if not plans and not sessions:
        report.problem = (f"no record of what was logged under {run_dir / 'verify'} (the run logged nothing, or "
                          "kept no record: OTEL_TRAIN_VERIFY=off; or this is not a run folder)")
        return report
    for rank in sorted(set(plans) | sessions):  # a rank that refused values but handed its backends nothing
        for cause, n in _session_refusals(run_dir, rank).items():
            report.refusals[cause] = report.refusals.get(cause, 0) + n
    for rank, plan in sorted(plans.items()):
        for backend in plan.backends.values():
            report.backends.append(_check_backend(plan, backend))
    return report


def _unacknowledged(plan: Any, backend: str) -> int:
    """Windows rank `plan.rank`'s spool wrote ahead that `backend` never acknowledged (0: none, or no spool)."""
    from otel_train.ship.spool import acknowledged_by, rank_spool

    if plan.written_ahead is None:
        return 0
    return max(0, int(plan.written_ahead) - acknowledged_by(rank_spool(plan.run_dir, plan.rank), backend))


def _check_backend(plan: Any, backend: Any) -> BackendReport:
    from otel_train.verify.compare import compare
    from otel_train.verify.stores import read_backend

    out = BackendReport(plan.rank, backend.name, "pass", lost=dict(backend.lost),
                        skipped_by_rule=backend.expected.skipped_by_rule, not_checked_past=plan.stopped_at,
                        not_checked_why=plan.stopped_why)
    try:
        held = read_backend(plan, backend)
    except Exception as err:  # a store that cannot be read is a failure to report, not a crash
        out.status, out.reason = "fail", f"cannot read it back: {type(err).__name__}: {err}"
        return out
    if isinstance(held, str):
        out.status, out.reason = "not checked", held
        behind = _unacknowledged(plan, backend.name)
        if behind:  # its store cannot be read here, but the spool knows it never took these windows
            out.status = "fail"
            out.reason = (f"{held}; but it never acknowledged {behind} window(s) the spool holds: "
                          "`otel-train replay` delivers them")
        return out
    out.where = held.where
    out.scalars_checked = held.points is not None
    stop = plan.stopped_at
    present: dict[str, list[tuple[int, float]]] = {}
    for p in held.points or ():
        if p.step is not None and (stop is None or p.step <= stop):
            present.setdefault(p.name, []).append((int(p.step), float(p.value)))
    expected = backend.expected
    for key, points in (expected.points if held.points is not None else {}).items():
        if stop is not None:
            points = [p for p in points if p[0] <= stop]
        name = held.name_of(key)
        if held.stored is not None:  # as the backend stores them (MLflow's ±inf, ClearML's NaN)
            points = [(step, held.stored(value)) for step, value in points]
        result = compare(name, key.rank, points, present.pop(name, []), held.float32)
        out.expected += result.expected
        out.present += result.present
        out.missing += len(result.missing)
        out.duplicated += len(result.duplicated)
        out.wrong_value += len(result.wrong_value)
        if stop is None:
            out.unexpected += len(result.unexpected_step)
        else:
            result.unexpected_step = []
        if not result.ok:
            out.series.append(result)
    if held.spans is not None:
        _check_spans(out, expected.spans, held.spans, stop)
    accounted = sum(out.lost.values())
    if (out.duplicated or out.wrong_value or out.unexpected or out.spans_duplicated
            or out.missing + out.spans_missing > accounted):
        out.status = "fail"
    return out


def _check_spans(out: BackendReport, expected: dict[str, list[int | None]], held: list[Any], stop: int | None) -> None:
    present: dict[str, list[int | None]] = {}
    for span in held:
        if stop is None or span.step is None or span.step <= stop:
            present.setdefault(span.name, []).append(span.step)
    for name, steps in expected.items():
        if stop is not None:
            steps = [s for s in steps if s is None or s <= stop]
        out.spans_expected += len(steps)
        got = list(present.get(name, []))
        missing = []
        for step in steps:
            if step in got:
                got.remove(step)
            else:
                missing.append(step)
        duplicated = [s for s in got if s in steps]
        out.spans_missing += len(missing)
        out.spans_duplicated += len(duplicated)
        if missing or duplicated:
            out.span_problems[name] = (missing, duplicated)


def _session_ranks(run_dir: Path, ranks: list[int] | None) -> set[int]:
    """The ranks whose session wrote its refusals (`otel_train.ship.logged_record.write_session_record`)."""
    from otel_train.ship.logged_record import FOLDER

    found = set()
    for path in (run_dir / FOLDER).glob("rank*.session.json"):
        digits = path.name[len("rank"):].split(".", 1)[0]
        if digits.isdigit() and (ranks is None or int(digits) in ranks):
            found.add(int(digits))
    return found


def _session_refusals(run_dir: Path, rank: int) -> dict[str, int]:
    from otel_train.ship.logged_record import FOLDER, SESSION_FILE

    path = run_dir / FOLDER / SESSION_FILE.format(rank=rank)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): int(v) for k, v in dict(data.get("refusals", {})).items() if v}


def format_report(report: VerifyReport) -> str:
    """The human-readable report: one line per (rank, backend), then the first few problems per series."""
    if report.problem:
        return f"otel-train verify: {report.problem}"
    lines = [f"otel-train verify {report.run_dir}"]
    for b in report.backends:
        head = f"  rank {b.rank} {b.backend}: {b.status.upper() if b.status == 'fail' else b.status}"
        if b.status == "not checked":
            lines.append(f"{head} ({b.reason})")
            continue
        if b.reason:
            lines.append(f"{head} ({b.reason})")
            continue
        counts = [f"{b.expected:,} expected", f"{b.present:,} present"] if b.scalars_checked else [
            "scalars not compared (its counter events carry no step)"]
        counts += [f"{n:,} {what}" for n, what in ((b.missing, "missing"), (b.duplicated, "duplicated"),
                                                   (b.wrong_value, "wrong value"), (b.unexpected, "unexpected step"),
                                                   (b.skipped_by_rule, "skipped by rule")) if n]
        if b.spans_expected:
            counts.append(f"{b.spans_expected:,} spans" + (f" ({b.spans_missing:,} missing)" if b.spans_missing else "")
                          + (f" ({b.spans_duplicated:,} duplicated)" if b.spans_duplicated else ""))
        if b.lost:
            counts.append("not written: " + ", ".join(f"{n:,} {cause}" for cause, n in b.lost.items()))
        if b.not_checked_past is not None:
            counts.append(f"not checked past step {b.not_checked_past} ({b.not_checked_why})")
        lines.append(f"{head}: {', '.join(counts)}")
        for s in b.series[:20]:
            problems = [f"missing at steps {_steps(s.missing)}" if s.missing else "",
                        f"duplicated at steps {_steps(s.duplicated)}" if s.duplicated else "",
                        ("wrong value at " + ", ".join(f"step {st}: {got!r} instead of {want!r}"
                                                       for st, want, got in s.wrong_value[:_SHOWN_PER_SERIES])
                         + (" ..." if len(s.wrong_value) > _SHOWN_PER_SERIES else "")) if s.wrong_value else "",
                        f"unexpected steps {_steps(s.unexpected_step)}" if s.unexpected_step else ""]
            lines.append(f"    `{s.series}`: " + "; ".join(p for p in problems if p))
        if len(b.series) > 20:
            lines.append(f"    ... and {len(b.series) - 20} more series")
        for name, (missing, duplicated) in list(b.span_problems.items())[:5]:
            lines.append(f"    span `{name}`: " + "; ".join(
                p for p in (f"missing at steps {_steps(missing)}" if missing else "",
                            f"duplicated at steps {_steps(duplicated)}" if duplicated else "") if p))
    if report.refusals:
        lines.append("  refused at the call (never logged): "
                     + ", ".join(f"{n:,} {cause}" for cause, n in report.refusals.items()))
    lines.append(f"  {report.verdict()}")
    return "\n".join(lines)


def _steps(steps: list[Any]) -> str:
    shown = ", ".join(str(s) for s in steps[:_SHOWN_PER_SERIES])
    return shown + (f" ... ({len(steps)} in all)" if len(steps) > _SHOWN_PER_SERIES else "")
