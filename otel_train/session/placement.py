"""Where this process runs in its job: rank, local rank, world size and the run id, read from the launcher's
environment (torchrun, SLURM, `accelerate launch`, Lightning's DDP launcher, ...) without communication.
(A session restarted in the framework's place: `otel_train.session.adopt`.)
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from collections.abc import Mapping

from otel_train.config import settings as cfg
from otel_train.errors import ConfigError

__all__ = ["resolve_run_id"]

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
