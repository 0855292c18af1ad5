"""The sink's share of file descriptors: how many runs and connections fit the process's `RLIMIT_NOFILE`, and
whether one more run fits now.

Every open run holds files: its spool (a segment, a record of what each backend holds, and its series state's
journal: 3) and one file per backend and rank (TensorBoard's event file, the Chrome trace, a JSONL file, ...).
Measured with a one-point request per run, before the journal was kept open: 4 descriptors per run for the
default ``tensorboard,chrome_trace`` with one rank, 5 with two ranks, 6 and 8 with ``jsonl`` added; the
journal adds one to each. A run's files are opened as its data arrives, so a limit counted in runs
alone cannot know how many a run will need; the sink therefore

* derives its default open-run limit from the descriptor limit (`default_max_open_runs`: `FDS_PER_RUN` per run,
  after `reserve_fds` and the connection cap), and its default connection cap (`default_max_connections`);
* before it opens a run, counts the descriptors in use (`FdBudget.refusal`): with fewer than `ROOM_PER_RUN`
  left above the reserve it closes idle runs and refuses the request retryably (UNAVAILABLE / 503 with a
  retry-after), so the listeners, `/health` and the open runs' own files always find a descriptor.

`raise_soft_limit` lifts the soft limit to the hard one (the CLI does this for its own process: the soft
limit is often 1024 while the hard one allows far more).
"""

from __future__ import annotations

import math
import os
import resource
import time

__all__ = ["FDS_PER_RUN", "ROOM_PER_RUN", "FdBudget", "default_max_connections", "default_max_open_runs",
           "fd_limit", "fds_in_use", "raise_soft_limit", "reserve_fds"]

#: Descriptors an open run is planned with (the measurements above, with room for a second rank and backend).
FDS_PER_RUN = 6
#: Descriptors that must be free above the reserve before a run is opened (a run of several ranks and backends).
ROOM_PER_RUN = 16
#: The defaults' upper bounds: with descriptors to spare, memory and threads set the limit, not files.
MAX_OPEN_RUNS_CAP = 1000
MAX_CONNECTIONS_CAP = 1024
_FD_DIR = "/proc/self/fd"
#: Seconds a count of the descriptors in use is trusted for (with `ROOM_PER_RUN` added per run opened since).
_COUNT_TRUSTED_S = 0.5


def fd_limit() -> int:
    """The process's soft `RLIMIT_NOFILE` (a large number when unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_soft_limit() -> int:
    """Lift the soft descriptor limit to the hard one (at most 2**20); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # not allowed here: the soft limit stays, and the defaults below follow it
    return fd_limit()


def reserve_fds(limit: int) -> int:
    """Descriptors kept free for the listeners, `/health`, accepting connections and the open runs' next files.

    Example:
        >>> reserve_fds(1024), reserve_fds(65536)
        (128, 4160)
    """
    return 64 + limit // 16


def default_max_connections(limit: int) -> int:
    """The default cap on open HTTP connections: a quarter of the descriptors, at most `MAX_CONNECTIONS_CAP`.

    Example:
        >>> default_max_connections(1024), default_max_connections(65536)
        (256, 1024)
    """
    return max(16, min(MAX_CONNECTIONS_CAP, limit // 4))


def default_max_open_runs(limit: int, max_connections: int) -> int:
    """The default open-run limit: what is left after the reserve and the connections, `FDS_PER_RUN` each.

    Example:
        >>> default_max_open_runs(1024, 256), default_max_open_runs(65536, 1024)
        (106, 1000)
    """
    free = limit - reserve_fds(limit) - max_connections
    return max(4, min(MAX_OPEN_RUNS_CAP, free // FDS_PER_RUN))


def fds_in_use() -> int | None:
    """Descriptors this process has open (None where the system does not say: then only the static limit
    applies)."""
    try:
        return len(os.listdir(_FD_DIR))
    except OSError:
        return None


class FdBudget:
    """Whether the process has descriptors for one more run, counted when a run is about to open.

    Args:
        limit: The descriptor limit (default: the soft `RLIMIT_NOFILE` now).
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = fd_limit() if limit is None else limit
        self.reserve = reserve_fds(self.limit)
        self.refused = 0
        # The last count and what has opened since: far from the limit, a run opens without listing /proc.
        self._counted = -1
        self._counted_at = 0.0
        self._opened_since = 0

    def runs_to_close(self, in_use: int | None) -> int:
        """How many idle runs to close so that a run can open (0: it can)."""
        if in_use is None:
            return 0
        over = in_use + ROOM_PER_RUN - (self.limit - self.reserve)
        # A few more than needed: the next new runs then find room while these close in the background.
        return 0 if over <= 0 else math.ceil(over / FDS_PER_RUN) + 8

    def refusal(self) -> tuple[str, int] | None:
        """(why a run cannot open now, how many idle runs to close), or None when it can (callers serialize)."""
        now = time.monotonic()
        if self._counted >= 0 and now - self._counted_at < _COUNT_TRUSTED_S:
            estimate = self._counted + (self._opened_since + 1) * ROOM_PER_RUN
            if not self.runs_to_close(estimate):
                self._opened_since += 1
                return None
        in_use = fds_in_use()
        self._counted, self._counted_at, self._opened_since = (in_use if in_use is not None else -1), now, 1
        close = self.runs_to_close(in_use)
        if not close:
            return None
        self.refused += 1
        why = (f"{in_use:,} of {self.limit:,} file descriptors in use ({self.reserve:,} kept for the listeners and "
               "open runs); closing idle runs, retry shortly")
        return why, close
