"""`otel-train replay`: deliver what a run's spool holds and its backends have not acknowledged."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from otel_train.backend import RowExporter, Window
from otel_train.config.exporter_options import ExporterOptions, options_from_json
from otel_train.ship import store_env
from otel_train.ship.backend_host import hosted
from otel_train.ship.backend_start import StartingBackend, starting_backends
from otel_train.ship.delivery import Delivery, Progress
from otel_train.ship.export_child import META, OLD_META
from otel_train.ship.spool import Spool, holder, try_lock
from otel_train.vocab.rows import HistogramRow, MetricRow, SpanRow

__all__ = ["RowWanted", "replay"]

_logger = logging.getLogger("otel_train")

#: Whether replay hands a row to a backend: (rank folder name, backend name, row) -> hand it.
RowWanted = Callable[[str, str, "MetricRow | HistogramRow | SpanRow"], bool]


def replay(run_dir: Path, timeout_s: float = 600.0, stall_s: float = 60.0,
           report_every_s: float = 10.0, *, allow_outside: bool = False,
           wanted: RowWanted | None = None, overrides: Mapping[str, str] | None = None) -> dict[str, Progress]:
    """Deliver every spooled window a backend has not acknowledged, for each rank under `run_dir`.

    Idempotent: each backend resumes after its durable cursor, so a second replay writes nothing. Every
    `report_every_s` it logs, per rank and backend, how many windows are left; a backend that makes no
    progress for `stall_s` once up, or could not start, is given up on (its windows stay in the spool for a later
    replay), so a backend that cannot deliver costs `stall_s`, not `timeout_s`, and never holds up the others.
    A rank's backends start side by side, as in the exporter process. A rank whose folder another process is writing
    (a training or draining exporter process holds its lock) is skipped with a warning.

    The backends are built as the run recorded them at `init()` (`exporters.json`): its directory, and its
    stores' variables (`otel_train.ship.store_env`), not the replaying shell's. A directory other than the one
    holding `run_dir` (a moved or crafted description) is not followed, with a warning: replay writes under
    the folder holding `run_dir`, unless `allow_outside`.

    Args:
        wanted: Which rows each backend is handed (None: every row of the windows it lacks).
        overrides: Store variables to use instead of the recorded ones (`otel-train replay --set`), e.g.
            ``WANDB_MODE=offline`` for a run whose W&B was online and failed; only
            `otel_train.ship.store_env.STORE_VARIABLES`.

    Returns:
        Spool folder name -> progress after the replay.
    """
    results: dict[str, Progress] = {}
    for old in sorted(Path(run_dir).glob(f"spool/*/{OLD_META}")):
        if not (old.parent / META).exists():
            _logger.warning("%s: skipped: its spool was written by an earlier otel-train (%s), which this version "
                            "never unpickles; replay it with the otel-train version that wrote it", old.parent.name,
                            OLD_META)
    for meta_file in sorted(Path(run_dir).glob(f"spool/*/{META}")):
        rank_dir = meta_file.parent
        fd = try_lock(rank_dir)
        if fd is None:
            who = holder(rank_dir)
            _logger.warning("%s: skipped: another process (pid %s on %s, %s) is writing it; replay once it has "
                            "exited", rank_dir.name, who.get("pid", "?"), who.get("host", "?"),
                            who.get("state", "state unknown"))
            continue
        try:
            try:
                meta = json.loads(meta_file.read_text())
                names, options = [str(n) for n in meta["names"]], options_from_json(meta["options"])
                env = {str(k): (None if v is None else str(v)) for k, v in dict(meta.get("env") or {}).items()}
                cwd = Path(str(meta.get("cwd") or os.getcwd()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                _logger.warning("%s: skipped: %s is unreadable (%s)", rank_dir.name, META, err)
                continue
            options = _own_directory(rank_dir.name, Path(run_dir), dataclasses.replace(
                options, directory=cwd / options.directory), allow_outside)
            env = store_env.of_backends({**env, **(overrides or {})}, names)
            if env:
                _logger.info("%s: the backends' stores as the run recorded them: %s", rank_dir.name,
                             ", ".join(f"{k}={v}" for k, v in env.items() if v is not None) or "their defaults")
            with store_env.applied(env, cwd) if "env" in meta or overrides else contextlib.nullcontext():  # earlier: the shell's
                # As in the exporter process: each backend starts on its own (heavy clients in processes of their
                # own), so the replay waits for the slowest start, not the sum; windows wait in the spool.
                backends = starting_backends(names, options, spooled=True, hosted=hosted)
                delivery = Delivery(dict[str, RowExporter](backends), Spool(rank_dir),
                                    row_filter=None if wanted is None else _keep(rank_dir.name, wanted))
                for backend in backends.values():
                    backend.start()
                results[rank_dir.name] = _replay_rank(rank_dir.name, delivery, backends, timeout_s, stall_s,
                                                      report_every_s)
        finally:
            os.close(fd)
    return results


def _own_directory(label: str, run_dir: Path, options: ExporterOptions, allow_outside: bool) -> ExporterOptions:
    """`options` writing under the folder that holds `run_dir`: a description naming another directory (a run
    folder moved since, or a crafted file) is not followed unless `allow_outside`."""
    own = run_dir.resolve().parent
    named = Path(os.path.realpath(options.directory))
    if named == own:
        return options
    if allow_outside:
        _logger.warning("%s: writing to %s as its %s says (--allow-outside), outside the folder %s holding the run",
                        label, named, META, own)
        return options
    _logger.warning("%s: its %s names the directory %s, not the folder %s holding the run: replay writes only "
                    "inside the run's own folder, so it writes there (pass --allow-outside to write to %s)", label,
                    META, named, own, named)
    return dataclasses.replace(options, directory=own)


def _keep(label: str, wanted: RowWanted) -> Callable[[str, Window], Window]:
    def only_wanted(backend: str, window: Window) -> Window:
        return Window([r for r in window.metrics if wanted(label, backend, r)],
                      [h for h in window.histograms if wanted(label, backend, h)],
                      [s for s in window.spans if wanted(label, backend, s)])  # log records: not in the
        # record of what was logged, so a replay driven by it cannot tell which a backend lacks: left out
    return only_wanted


def _replay_rank(label: str, delivery: Delivery, backends: Mapping[str, StartingBackend], timeout_s: float,
                 stall_s: float, report_every_s: float) -> Progress:
    """Wait while some backend still makes progress (see `replay`), saying what is left; then close. A backend
    that could not start (said as it failed) is given up at once."""
    start = time.monotonic()
    deadline = start + timeout_s
    acked: dict[str, int] = {}
    moved_at: dict[str, float] = {}
    given_up: set[str] = set()
    next_report = start + report_every_s
    next_flush = start
    while True:
        now = time.monotonic()
        progress = delivery.progress()
        left = {name: progress.spooled - seq for name, seq in progress.delivered.items() if seq < progress.spooled}
        for name, n_left in left.items():
            if acked.get(name) != progress.delivered[name]:
                acked[name], moved_at[name] = progress.delivered[name], now
            backend = backends.get(name)
            if backend is not None and not backend.wait_started(0):
                moved_at[name] = now  # still starting: not a stall
            elif backend is not None and backend.start_error is not None:
                given_up.add(name)  # said as it failed; its windows stay in the spool
            if name not in given_up and now - moved_at[name] >= stall_s:
                given_up.add(name)
                _logger.warning("%s: giving up on `%s`: no progress for %.0f s (%d failure(s)); its %d window(s) "
                                "left stay in the spool for a later `otel-train replay`", label, name, stall_s,
                                progress.failures.get(name, 0), n_left)
        if not left or set(left) <= given_up or now >= deadline:
            break
        if now >= next_flush:  # as often as delivery flushes a backend on its own (a failing one is retried)
            next_flush = now + 1.0
            if delivery.flush(time.monotonic() + 0.1):
                # Every window handed and flushed: a backend whose store lags (W&B keeps its last step open until
                # `finish`) has the rest once closed, so waiting for its cursor would only run into `stall_s`.
                left = {}
                break
        if now >= next_report:
            next_report = now + report_every_s
            waiting = ", ".join(f"`{name}` {n} window(s) left" for name, n in left.items() if name not in given_up)
            _logger.info("%s: waiting for %s (%.0f s of at most %.0f s)", label, waiting, now - start, timeout_s)
        time.sleep(0.1)
    # Given up (or out of time): closing only shuts the backends down, briefly.
    delivery.close(min(deadline, time.monotonic() + (5.0 if left else timeout_s)))
    progress = delivery.progress()
    if progress.behind():
        _logger.warning("%s: %s", label, progress.summary())
    return progress
