"""`otel-train replay`: deliver what a run's spool holds and its backends have not acknowledged."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from otel_train.exporter_options import options_from_json
from otel_train.ship.delivery import Delivery, Progress
from otel_train.ship.export_child import META, OLD_META, build_backends
from otel_train.ship.spool import Spool, holder, try_lock

__all__ = ["replay"]

_logger = logging.getLogger("otel_train")


def replay(run_dir: Path, timeout_s: float = 600.0, stall_s: float = 60.0,
           report_every_s: float = 10.0) -> dict[str, Progress]:
    """Deliver every spooled window a backend has not acknowledged, for each rank under `run_dir`.

    Idempotent: each backend resumes after its durable cursor, so a second replay writes nothing. Every
    `report_every_s` it logs, per rank and backend, how many windows are left; a backend that makes no
    progress for `stall_s` is given up on (its windows stay in the spool for a later replay), so a backend
    that cannot deliver costs `stall_s`, not `timeout_s`. A rank whose folder another process is writing
    (a training or draining exporter process holds its lock) is skipped with a warning.

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
            except (OSError, ValueError, KeyError, TypeError) as err:
                _logger.warning("%s: skipped: %s is unreadable (%s)", rank_dir.name, META, err)
                continue
            delivery = Delivery(build_backends(names, options), Spool(rank_dir))
            results[rank_dir.name] = _replay_rank(rank_dir.name, delivery, timeout_s, stall_s, report_every_s)
        finally:
            os.close(fd)
    return results


def _replay_rank(label: str, delivery: Delivery, timeout_s: float, stall_s: float,
                 report_every_s: float) -> Progress:
    """Wait while some backend still makes progress (see `replay`), saying what is left; then close."""
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
