"""The one line otel-train writes at shutdown on rank 0 (silenced by `OTEL_TRAIN_QUIET=1`).

It says what reached the backends and what did not, so a run that lost data does not look like one
that did not: ``otel-train: 12,000 points in 200 windows to tensorboard, chrome_trace; 0 dropped;
run folder otel-train-runs/demo``. Every value that did not reach a backend is in it, by cause: what was
dropped before any backend saw it (a full buffer or queue, with its unit), and per backend the rows it did not
write (a bad step or value, a row the backend refused, a window given up after its retries, a full queue,
a step it cannot store). Rows a routing rule (`OTEL_TRAIN_<BACKEND>_*`) keeps from a backend are not a loss
and not counted. The counts come from whoever delivers the windows (the step-aligned reader, the exporter
process); this module gathers, formats and writes them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from otel_train._internal.values import REFUSAL_CAUSES, REFUSED_PREFIX, RefusalCounts
from otel_train.vocab.rows import LOSS_CAUSES

if TYPE_CHECKING:
    from otel_train.collect.reader import StepAlignedMetricReader
    from otel_train.config.settings import Settings
    from otel_train.ship.export_process import ExportProcess
    from otel_train.vocab.run_identity import RunInfo

__all__ = ["summary_line", "write_session_summary", "write_summary"]

_logger = logging.getLogger("otel_train")

#: How a backend's loss causes (`RowExporter.rows_lost`, delivery's ``queue_full``) read in the line.
_CAUSES = {**LOSS_CAUSES, "queue_full": "queue full"}


def _unit(words: str, n: int) -> str:
    """`words` (a plural unit first: ``values not a number``) for `n` of them."""
    unit, space, rest = words.partition(" ")
    return f"{unit[:-1]}{space}{rest}" if n == 1 and unit.endswith("s") else words


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def summary_line(points: int, windows: int, backends: Sequence[str], dropped: int,
                 failures: Mapping[str, int], run_folder: str | None = None, *,
                 steps_backwards: Mapping[str, int] | None = None, steps_order_dropped: Mapping[str, int] | None = None,
                 spool_failed_appends: int = 0, dropped_by: Mapping[str, int] | None = None,
                 rows_lost: Mapping[str, Mapping[str, int]] | None = None,
                 refusals: Mapping[str, int] | None = None, verify: str | None = None) -> str:
    """Format the shutdown summary.

    Args:
        points: Metric points handed to the backends.
        windows: Export windows collected.
        backends: Backend names, in configuration order.
        dropped: Records, spans and windows dropped to keep memory bounded, together.
        failures: Backend name -> failed writes (only non-zero ones are shown).
        run_folder: Where the local backends wrote, if any.
        steps_backwards: Backend name -> rows whose step went backwards (only non-zero ones are shown).
        steps_order_dropped: Backend name -> rows not written because of their step (shown with the above).
        spool_failed_appends: Windows the spool could not write ahead (disk full); shown when non-zero.
        dropped_by: What makes up `dropped`: its cause with its unit (``values over the log buffer``) -> count.
        rows_lost: Backend name -> cause (`otel_train.backend.LOSS_CAUSES`, ``queue_full``) -> rows
            that backend did not write.
        refusals: Cause (`otel_train._internal.values.REFUSAL_CAUSES`) -> what was refused at the call.
        verify: The verdict of `otel-train verify` at the end of the job (`OTEL_TRAIN_VERIFY`), a clause of its own.

    Example:
        >>> summary_line(1200, 4, ["tensorboard", "wandb"], 0, {"wandb": 3}, "runs/demo")
        'otel-train: 1,200 points in 4 windows to tensorboard, wandb; 0 dropped; wandb: 3 failures; run folder runs/demo'
        >>> summary_line(10, 2, ["wandb"], 0, {}, steps_backwards={"wandb": 2}, steps_order_dropped={"wandb": 1},
        ...              spool_failed_appends=3)
        'otel-train: 10 points in 2 windows to wandb; 0 dropped; wandb: 2 rows with a step going backwards, 1 not written; 3 windows not written ahead to the spool (disk full?)'
        >>> summary_line(10, 2, ["jsonl", "wandb"], 3, {}, dropped_by={"values over the log buffer": 3},
        ...              rows_lost={"wandb": {"bad_value": 2, "refused": 1}})
        'otel-train: 10 points in 2 windows to jsonl, wandb; 3 dropped (3 values over the log buffer); wandb: 3 rows not written (2 bad value, 1 refused by the backend)'
        >>> summary_line(10, 2, ["jsonl"], 0, {}, refusals={"not_a_number": 2, "bad_key": 1})
        'otel-train: 10 points in 2 windows to jsonl; 0 dropped; refused at the call: 2 values not a number, 1 value with a key that is not a non-empty string'
    """
    causes = ", ".join(f"{n:,} {cause}" for cause, n in (dropped_by or {}).items() if n)
    parts = [f"otel-train: {points:,} points in {windows:,} windows to {', '.join(backends) or 'no backend'}",
             f"{dropped:,} dropped" + (f" ({causes})" if causes else "")]
    parts += [f"{name}: {n:,} failure{'s' if n != 1 else ''}" for name, n in failures.items() if n]
    for name, lost in (rows_lost or {}).items():
        total = sum(lost.values())
        if total:
            why = ", ".join(f"{n:,} {_CAUSES.get(cause, cause)}" for cause, n in lost.items() if n)
            parts.append(f"{name}: {_plural(total, 'row')} not written ({why})")
    refused = ", ".join(f"{n:,} {_unit(REFUSAL_CAUSES.get(cause, cause), n)}" for cause, n in (refusals or {}).items()
                        if n)
    if refused:
        parts.append(f"refused at the call: {refused}")
    backwards, order_dropped = steps_backwards or {}, steps_order_dropped or {}
    for name in dict.fromkeys([*backwards, *order_dropped]):
        went, gone = backwards.get(name, 0), order_dropped.get(name, 0)
        if went or gone:
            parts.append(f"{name}: {went:,} row{'s' if went != 1 else ''} with a step going backwards, "
                         f"{gone:,} not written")
    if spool_failed_appends:
        parts.append(f"{spool_failed_appends:,} window{'s' if spool_failed_appends != 1 else ''} not written ahead "
                     "to the spool (disk full?)")
    if verify:
        parts.append(verify)
    if run_folder:
        parts.append(f"run folder {run_folder}")
    return "; ".join(parts)


def write_summary(line: str, quiet: bool = False) -> None:
    """Write `line` to stderr unless `quiet`.

    Straight to stderr, not through `logging`: an unconfigured `logging` shows only warnings, and
    this line is a report the user asked for by running, not a warning.
    """
    if quiet:
        return
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr closed or gone at interpreter exit
        pass


class SummarySource(Protocol):
    """What the line is gathered from (`otel_train.session.runtime.Session` is one): the reader's counts, the backends
    in this process, the exporter process's last progress report, and the run."""

    settings: Settings
    run: RunInfo
    exporters: list[Any]
    refusals: RefusalCounts
    verify_verdict: str | None

    @property
    def unexported(self) -> Mapping[str, int]:
        """What was never exported because the session's start failed ("records", "spans"); empty otherwise."""

    @property
    def reader(self) -> StepAlignedMetricReader | None: ...

    @property
    def export_process(self) -> ExportProcess | None: ...


def write_session_summary(session: SummarySource) -> None:
    """Gather what `session` delivered and lost (its reader, its in-process backends, its exporter process's last
    progress report) and write the line; never raises."""
    from otel_train.vocab.run_paths import run_folder

    try:
        reader = session.reader
        if reader is None:  # the start failed: nothing went out, and what was logged is counted as such
            _write_unstarted(session)
            return
        stats = reader.stats()
        names = [str(getattr(ex, "name", type(ex).__name__)) for ex in session.exporters]
        failures, dropped = dict(stats["failures"]), stats["dropped"]
        in_process = [ex for ex in session.exporters if hasattr(ex, "step_order")]
        backwards = {ex.name: ex.step_order.backwards for ex in in_process}
        order_dropped = {ex.name: ex.step_order.dropped + int(getattr(ex, "steps_dropped", 0)) for ex in in_process}
        spool_failed = 0
        points = int(stats["points"])
        dropped_by = {"values over the log buffer": int(getattr(reader.log_buffer, "dropped", 0)),
                      "spans over the span buffer": int(getattr(reader.span_buffer, "dropped", 0)),
                      "windows over an export queue": int(stats["dropped"]) - int(reader.log_buffer.dropped)
                      - int(reader.span_buffer.dropped)}
        for what, n in reader.unexported.items():
            dropped_by[f"{what} left unexported at shutdown's deadline"] = int(n)
            dropped += int(n)
        lost = {ex.name: {k: v for k, v in ex.rows_lost.items() if v}
                for ex in in_process if getattr(ex, "rows_lost", None)}
        for name, causes in dict(stats.get("rows_lost") or {}).items():  # delivery's causes beside the backends'
            lost.setdefault(name, {}).update(causes)
        if session.export_process is not None:  # the exporter process's backends: its last progress report
            names += list(session.export_process.names)
            progress = session.export_process.last_progress
            points += session.export_process.points_added  # the phase timings it made
            failures.update(progress.failures)
            dropped += session.export_process.dropped + sum(progress.dropped.values())
            backwards.update(progress.steps_backwards)
            order_dropped.update(progress.steps_order_dropped)
            spool_failed = progress.spool_failed_appends
            lost.update(progress.rows_lost)
            dropped_by["windows the exporter process could not take or its backends dropped"] = (
                session.export_process.dropped + sum(progress.dropped.values()))
            children = {cause: n for cause, n in (getattr(progress, "children_lost", None) or {}).items()
                        if not cause.startswith(REFUSED_PREFIX)}  # child processes' values; refusals: below
            dropped_by.update(children)
            dropped += sum(children.values())
        write_summary(summary_line(points, stats["windows"], names, dropped,
                                   failures, str(run_folder(session.settings.dir, session.run.run_name)),
                                   steps_backwards=backwards, steps_order_dropped=order_dropped,
                                   spool_failed_appends=spool_failed, dropped_by=dropped_by, rows_lost=lost,
                                   refusals=session.refusals.snapshot(), verify=session.verify_verdict))
    except Exception:
        _logger.debug("no shutdown summary", exc_info=True)


def _write_unstarted(session: SummarySource) -> None:
    """The line of a session whose start failed: no points, and what was logged counted as not exported."""
    from otel_train.vocab.run_paths import run_folder

    left = {f"{what} of a session whose start failed": n for what, n in session.unexported.items()}
    from otel_train.session.backend_setup import split_backends

    names = [str(getattr(ex, "name", type(ex).__name__)) for ex in session.exporters]
    names += split_backends(session.settings)[1]  # those the exporter process would have run
    write_summary(summary_line(0, 0, names, sum(left.values()), {},
                               str(run_folder(session.settings.dir, session.run.run_name)), dropped_by=left,
                               refusals=session.refusals.snapshot(), verify=session.verify_verdict))
