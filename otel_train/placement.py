"""Where this process runs in its job: rank, local rank, world size and the run id, read from the launcher's
environment (torchrun, SLURM, `accelerate launch`, Lightning's DDP launcher, ...) without communication; and a
session started by `init()` before the framework said where this process runs, restarted in the framework's place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from otel_train import config as cfg
from otel_train.errors import ConfigError

if TYPE_CHECKING:
    from otel_train.runtime import DisabledSession, Session

__all__ = ["adopt_placement", "resolve_run_id"]

_logger = logging.getLogger("otel_train")


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not an integer; the launcher should set a whole number") from None


def _env_rank(env: Mapping[str, str]) -> int:
    """The global rank: ``RANK``; without it, local rank i of the first node is rank i (Lightning's DDP launcher
    re-runs the script for ranks 1..n-1 with ``LOCAL_RANK``, ``NODE_RANK`` and ``WORLD_SIZE`` but no ``RANK``:
    an `init()` at the top must not take rank 0's place); else 0."""
    if env.get("RANK", "").strip():
        return _env_int(env, "RANK", 0)
    local = _env_int(env, "LOCAL_RANK", 0)
    first_node = _env_int(env, "NODE_RANK", _env_int(env, "GROUP_RANK", 0)) == 0
    return local if first_node and 0 < local < _env_int(env, "WORLD_SIZE", 1) else 0


def resolve_run_id(settings: cfg.Settings, env: Mapping[str, str]) -> str:
    """The run id, equal on every rank of one job without communication.

    Explicit `OTEL_TRAIN_RUN_ID`, else the launcher's job id, else (several ranks) a hash of the
    rendezvous address, else (one process) a fresh time-based id.
    """
    if settings.run_id:
        return settings.run_id
    for var in cfg.JOB_ID_VARIABLES:
        value = env.get(var, "").strip()
        if value and value.lower() != "none":
            return value
    world = _env_int(env, "WORLD_SIZE", 1)
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if world > 1 and addr and port:
        launcher = _launcher_identity(env, world)
        if launcher is None:
            _logger.warning("no OTEL_TRAIN_RUN_ID or launcher job id, and the ranks span hosts: deriving the run id "
                            "from MASTER_ADDR:MASTER_PORT; set OTEL_TRAIN_RUN_ID to keep runs of reused ports apart")
            launcher = ""
        return "job-" + hashlib.sha256(f"{addr}:{port}:{world}:{launcher}".encode()).hexdigest()[:12]
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def _launcher_identity(env: Mapping[str, str], world: int) -> str | None:
    """``pid:start time`` of the process that started this job's ranks, when they all run on this host: equal
    on every rank of one job, different for the next job even on the same rendezvous port (`accelerate
    launch` always uses 29500). None when the ranks may span hosts or the start time cannot be read.

    The launcher is the `multiprocessing` parent (``mp.spawn``), else the parent process when the launcher
    put the rank in this process's initial environment (torchrun and `accelerate launch` start every rank,
    Lightning's DDP launcher starts ranks 1..n-1 from rank 0), else this process (Lightning's rank 0, which
    starts the others itself).
    """
    import multiprocessing

    parent = multiprocessing.parent_process()
    local_world = env.get("LOCAL_WORLD_SIZE", "").strip()
    one_host = (parent is not None or local_world == str(world)
                or env.get("MASTER_ADDR", "").strip().lower() in _LOOPBACK)
    if not one_host:
        return None
    if parent is not None and parent.pid:
        pid = parent.pid
    elif _in_initial_environment(("RANK", "LOCAL_RANK")):
        pid = os.getppid()
    else:
        pid = os.getpid()
    start = _process_start(pid)
    return None if start is None else f"{pid}:{start}"


def _in_initial_environment(names: tuple[str, ...]) -> bool:
    """Whether one of `names` was in the environment this process was started with (Linux ``/proc``)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            keys = {entry.split(b"=", 1)[0] for entry in f.read().split(b"\0")}
    except OSError:
        return False
    return any(name.encode() in keys for name in names)


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux ``/proc``): with the pid, a process
    identity that a reused pid does not repeat. None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[19].decode()  # field 22, counted after "pid (comm)"
    except (OSError, ValueError, IndexError):
        return None


def adopt_placement(session: Session, rank: int | None, local_rank: int | None,
                    world_size: int | None) -> Session | DisabledSession | None:
    """A new session in the framework's place (rank, local rank, world size), when `session` (started by the
    user's `init()` before the framework said where this process runs) disagrees and has exported nothing.

    Lightning's DDP launcher re-runs the script without ``RANK``: an `init()` at the top makes rank 1 believe
    it is rank 0 of a run of its own. Adopting shuts that session down and starts one with the same settings
    at the framework's rank (so the run id is the job's, see `resolve_run_id`). Returns None (and warns once,
    loudly) when it cannot: data was already exported, or the session has exporter instances, which cannot
    be rebuilt. Returns `session` itself when the places agree.
    """
    from otel_train.backend_setup import split_backends
    from otel_train.runtime import start

    run = session.run
    wanted = {"rank": rank, "local_rank": local_rank, "world_size": world_size}
    differs = {k: v for k, v in wanted.items() if v is not None and int(v) != getattr(run, k)}
    if not differs:
        return session
    have = ", ".join(f"{k}={getattr(run, k)}" for k in differs)
    want = ", ".join(f"{k}={v}" for k, v in differs.items())
    instances = len(session.exporters) > len(split_backends(session.settings)[0])
    if session.reader.windows or instances:
        _logger.error("otel-train: the framework says this process is %s, but the running session (started by "
                      "init() before the framework's launcher set the rank) is %s and %s; its data is labelled "
                      "with the wrong rank and run. Call otel_train.init() after the framework has started its "
                      "processes (e.g. in the LightningModule's setup), or let the integration start it",
                      want, have, "has exported data already" if session.reader.windows else
                      "has exporter instances that cannot be rebuilt")
        return None
    _logger.info("otel-train: adopting the framework's place (%s instead of %s): the session started by "
                 "init() restarts before anything was exported", want, have)
    settings = session.settings
    session.settings = dataclasses.replace(settings, quiet=True)  # no summary naming a run that never was
    session.shutdown()
    if not session.reader.windows:  # nothing went out at shutdown either: no folder of a run that never was
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
