"""A session started by `init()` before the framework said where this process runs (rank, local rank, world
size), restarted in the framework's place while it has exported nothing (`otel_train.session.adopt`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from otel_train.session.backend_setup import split_backends
from otel_train.session.runtime import DisabledSession, Session, start

__all__ = ["adopt_placement"]

_logger = logging.getLogger("otel_train")


def adopt_placement(session: Session, rank: int | None, local_rank: int | None,
                    world_size: int | None) -> Session | DisabledSession | None:
    """A new session in the framework's place (rank, local rank, world size), when `session` (started by the
    user's `init()` before the framework said where this process runs) disagrees and has exported nothing.

    Lightning's DDP launcher re-runs the script without ``RANK``: an `init()` at the top makes rank 1 believe
    it is rank 0 of a run of its own. Adopting shuts that session down and starts one with the same settings
    at the framework's rank (so the run id is the job's, see `otel_train.session.placement.resolve_run_id`). Returns None (and warns once,
    loudly) when it cannot: data was already exported, or the session has exporter instances, which cannot
    be rebuilt. Returns `session` itself when the places agree.
    """
    run = session.run
    wanted = {"rank": rank, "local_rank": local_rank, "world_size": world_size}
    differs = {k: v for k, v in wanted.items() if v is not None and int(v) != getattr(run, k)}
    if not differs:
        return session
    have = ", ".join(f"{k}={getattr(run, k)}" for k in differs)
    want = ", ".join(f"{k}={v}" for k, v in differs.items())
    instances = len(session.exporters) > len(split_backends(session.settings)[0])
    reader = session.reader  # None where the session's start failed: it exported nothing
    exported = bool(reader is not None and reader.windows)
    if exported or instances:
        _logger.error("otel-train: the framework says this process is %s, but the running session (started by "
                      "init() before the framework's launcher set the rank) is %s and %s; its data is labelled "
                      "with the wrong rank and run. Call otel_train.init() after the framework has started its "
                      "processes (e.g. in the LightningModule's setup), or let the integration start it",
                      want, have, "has exported data already" if exported else
                      "has exporter instances that cannot be rebuilt")
        return None
    _logger.info("otel-train: adopting the framework's place (%s instead of %s): the session started by "
                 "init() restarts before anything was exported", want, have)
    settings = session.settings
    session.settings = dataclasses.replace(settings, quiet=True)  # no summary naming a run that never was
    session.shutdown()
    if reader is None or not reader.windows:  # nothing went out at shutdown either: no folder of a run that never was
        if session.hang_watchdog is not None:
            session.hang_watchdog.remove_file()
        _remove_unused_run_folder(session.run_claim.path)
    else:  # what was logged before the framework said where this process runs went out at the shutdown
        _logger.warning("otel-train: values logged before the framework set the rank are in run %r (rank %d), "
                        "not in the job's run", session.run.run_id, session.run.rank)
    env = dict(os.environ)
    env.update({k.upper(): str(int(v)) for k, v in wanted.items() if v is not None})
    return start(settings, env=env)


#: What a session that exported nothing leaves in its rank's spool folder (written at `init()`).
_UNUSED_SPOOL_FILES = frozenset({"writer.lock", "exporters.json", "exporter.log"})


def _remove_unused_run_folder(spool: Path, wait_s: float = 5.0) -> None:
    """Remove the rank's spool folder of a session that exported nothing, and its run folder if nothing else
    is in it. Only once this process holds the folder's claim (the session's exporter process has exited) and
    only when it holds nothing but what `init()` wrote (an empty exporter log: a non-empty one is kept)."""
    from otel_train.ship.spool import LOCK_FILE, try_lock

    deadline = time.monotonic() + wait_s
    try:
        fd = try_lock(spool)
        while fd is None and time.monotonic() < deadline:
            time.sleep(0.05)
            fd = try_lock(spool)
    except OSError:
        return
    if fd is None:
        _logger.debug("otel-train: %s is still held; the unused run folder stays", spool)
        return
    try:
        files = {p.name: p for p in spool.iterdir()}
        log = files.get("exporter.log")
        if not set(files) <= _UNUSED_SPOOL_FILES or (log is not None and log.stat().st_size):
            return
        for name, path in files.items():
            if name != LOCK_FILE:
                path.unlink()
        files[LOCK_FILE].unlink()  # last, still locked: a contender that opened it first retries on a new file
    except OSError:
        return
    finally:
        os.close(fd)
    for folder in (spool, spool.parent, spool.parent.parent):  # rank<N>/, spool/, the run folder: if empty
        try:
            folder.rmdir()
        except OSError:
            return
