"""A backend that raises, hangs or is slow: training goes on, nothing raises into it, exit is bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from backendkit import wait_exited
from faultkit import SERIES, expected, jsonl_points, value

import otel_train as ot
from otel_train.testing import InMemoryRowExporter
from otel_train.vocab.rows import HistogramRow, MetricRow


class Hanging(InMemoryRowExporter):
    """Blocks forever in its first write (a server that never answers)."""

    name = "hanging"

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        self.entered.set()
        self.release.wait()


class Slow(InMemoryRowExporter):
    name = "slow"

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        time.sleep(0.05)
        super().write_metrics(rows, histograms)


def run_loop(steps: int) -> None:
    for s in ot.steps(range(steps)):
        ot.log({tag: value(tag, s) for tag in SERIES})


@pytest.mark.parametrize("make", [lambda: InMemoryRowExporter(fail_times=1), Hanging, Slow],
                         ids=["raises", "hangs", "slow"])
def test_a_failing_backend_never_costs_the_others_or_the_loop(tmp_path: Path, make: object) -> None:
    bad = make()  # type: ignore[operator]
    session = ot.init(exporters=["jsonl", bad], dir=tmp_path, run_id="f", run_name="f", shutdown_timeout_s=1.0)
    run_loop(30)
    # On a loaded machine the exporter process (JSONL's) may start or deliver after 1 s: what is tested here is the
    # bad in-process backend, so wait for that process to be up before, and done delivering after, the shutdown.
    session.export_process.progress(timeout_s=120)
    done = threading.Event()

    def close() -> None:
        ot.shutdown()
        done.set()

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(60)
    assert done.is_set(), "shutdown hung on a backend that never returns"
    wait_exited(session.export_process.pid)
    # The healthy backend has every step, exactly once, whatever the other one did.
    points = jsonl_points(tmp_path, "f")
    assert sorted(points) == sorted(expected(range(30)))
    if isinstance(bad, Hanging):
        assert bad.entered.is_set()
        bad.release.set()
    else:  # a transient failure is retried (at the latest at shutdown); a slow backend gets merged windows
        got = {(r.tag, r.step, r.value) for r in bad.metrics if r.tag in SERIES}
        assert got == expected(range(30))
