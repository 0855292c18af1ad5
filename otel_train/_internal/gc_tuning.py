"""Cycle-collector settings for the processes otel-train owns (the sink, the exporter process).

Both allocate rows at a high rate and our rows form no cycles, yet every ~700 allocations the collector ran
and its full passes walked every module object: about 45 % of a window's decode in the exporter process, and
the sink wrote ~1.3x fewer points/s (bench/sink.py). With the startup objects frozen out of its sight and a
larger young generation that cost mostly goes. Never called in the training process: an embedding program
keeps its own settings.
"""

from __future__ import annotations

import gc

__all__ = ["tune_for_row_churn"]


def tune_for_row_churn() -> None:
    """Collect once, freeze what exists (modules, clients), and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
