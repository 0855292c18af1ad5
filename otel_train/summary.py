"""The one line otel-train writes at shutdown on rank 0 (silenced by `OTEL_TRAIN_QUIET=1`).

It says what reached the backends and what did not, so a run that lost data does not look like one
that did not: ``otel-train: 12,000 points in 200 windows to tensorboard, chrome_trace; 0 dropped;
run folder otel-train-runs/demo``. The counts come from whoever delivers the windows (today the
step-aligned reader); this module only formats and writes them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

__all__ = ["summary_line", "write_summary"]


def summary_line(points: int, windows: int, backends: Sequence[str], dropped: int,
                 failures: Mapping[str, int], run_folder: str | None = None) -> str:
    """Format the shutdown summary.

    Args:
        points: Metric points handed to the backends.
        windows: Export windows collected.
        backends: Backend names, in configuration order.
        dropped: Records, spans and windows dropped to keep memory bounded, together.
        failures: Backend name -> failed writes (only non-zero ones are shown).
        run_folder: Where the local backends wrote, if any.

    Example:
        >>> summary_line(1200, 4, ["tensorboard", "wandb"], 0, {"wandb": 3}, "runs/demo")
        'otel-train: 1,200 points in 4 windows to tensorboard, wandb; 0 dropped; wandb: 3 failures; run folder runs/demo'
    """
    parts = [f"otel-train: {points:,} points in {windows:,} windows to {', '.join(backends) or 'no backend'}",
             f"{dropped:,} dropped"]
    parts += [f"{name}: {n:,} failure{'s' if n != 1 else ''}" for name, n in failures.items() if n]
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
