"""Runs are cheap: threads do not grow with runs, open files are bounded by an LRU,
a closed run reopens with its totals, and one run's hung backend never holds up the others."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.sink import exporter_factory
from otel_train.sink.decode.requests import DecodeCache, decode_metrics, parse_metrics
from otel_train.sink.runs.router import Overloaded, Router
from otel_train.testing import InMemoryRowExporter, OtlpPoint, metrics_request

# 2,000 runs through an LRU of 64 open runs: ~1,900 runs closed, so a thread or file kept per closed run passes
# the bounds below many times over. What 10,000 runs cost is `bench/sink_runs.py`'s figure, not this test's.
_RUNS = 2_000
_MAX_OPEN = 64


def _request(run_id: str, step: int) -> bytes:
    return metrics_request({"train.run.id": run_id}, [
        OtlpPoint("train/loss", step + 0.5, step=step),
        OtlpPoint("train/tokens", 10, step=step, kind="sum"),  # DELTA: the total runs across reopenings
    ])


def _send(router: Router, cache: DecodeCache, body: bytes) -> None:
    """Ingest one request, retrying when refused, as a sender does (here: while the LRU closes runs)."""
    while True:
        try:
            router.ingest(decode_metrics(parse_metrics(body), cache))
            return
        except Overloaded as err:
            time.sleep(err.retry_after_s / 50)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _series(directory: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """run id -> tag -> [(step, value)] from every JSONL file the sink wrote (a list: a duplicate shows)."""
    from otel_train.exporters.jsonl import read_jsonl

    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for path in sorted(directory.glob("*/rank*.jsonl")):
        for rec in read_jsonl(path):
            if rec["type"] == "metric":
                out.setdefault(rec["run_id"], {}).setdefault(rec["tag"], []).append((rec["step"], rec["value"]))
    return out


def test_thousands_of_runs_on_bounded_threads_and_files(tmp_path: Path) -> None:
    options = ExporterOptions(directory=tmp_path / "runs", ranks="all")
    router = Router(exporter_factory(("jsonl",), options), spool_dir=tmp_path / "spool", backend_threads=2,
                    max_open_runs=_MAX_OPEN)
    router.pool.stall_s = 600.0  # a slow fsync on a loaded machine must not start spares: the fixed pool is tested
    cache = DecodeCache()
    threads0, fds0 = threading.active_count(), _fds()
    most_threads = most_fds = most_open = 0
    reopened = list(range(0, _RUNS, 100))
    try:
        for i in range(_RUNS):
            _send(router, cache, _request(f"run-{i}", 0))
            if i % 50 == 0:
                most_threads = max(most_threads, threading.active_count())
                most_fds = max(most_fds, _fds())
                most_open = max(most_open, router.runs_open)
        for i in reopened:  # long closed by the LRU: reopened, their totals continue
            _send(router, cache, _request(f"run-{i}", 1))
        assert router.runs_opened == _RUNS + len(reopened)
        router.idle_s = 0.0  # every run closes at the next tick once its data is written
        deadline = time.monotonic() + 60
        while (router.runs_open or router.runs_closing) and time.monotonic() < deadline:
            router.tick()
            time.sleep(0.02)
        fds_idle = _fds()
    finally:
        router.close(60)
    fds_after = _fds()
    # 2 pool threads, 4 closers, 1 watchdog; one run's files (JSONL + spool segment and cursor + the ledger's
    # journal, kept open while the run is) are ~4 fds.
    assert most_threads - threads0 <= 7, (threads0, most_threads)
    assert most_open <= _MAX_OPEN
    assert most_fds - fds0 <= _MAX_OPEN * 5, (fds0, most_fds)
    # Every closed run gave its files back, with the router still up (every run closed) and after its close (a
    # file kept by one closed run in 80 would hold 25 here). Peaks sampled while sending vary with how far the
    # closers lag, so they bound the open runs above but cannot tell a leak.
    assert fds_idle - fds0 <= 2 and fds_after - fds0 <= 2, (fds0, fds_idle, fds_after)
    got = _series(tmp_path / "runs")
    assert len(got) == _RUNS
    for i in range(_RUNS):
        steps = (0, 1) if i in reopened else (0,)
        assert got[f"run-{i}"] == {"train/loss": [(s, s + 0.5) for s in steps],
                                   "train/tokens": [(s, 10.0 * (s + 1)) for s in steps]}, i
    # every run closed with all written: no segments or cursors left, only each run's series state
    left = {p.name for folder in (tmp_path / "spool").iterdir() for p in folder.iterdir()}
    assert left <= {"ledger.snapshot", "ledger.journal"}


class _Gated(InMemoryRowExporter):
    """A backend whose writes hang until released (fault injection); same kind (`memory`) as the others."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self._release = release

    def export_window(self, window: Window) -> Any:
        self._release.wait(60)
        return super().export_window(window)


def test_a_hung_backend_of_one_run_never_holds_up_the_others() -> None:
    release = threading.Event()
    made: list[InMemoryRowExporter] = []

    def make() -> list[Any]:
        made.append(_Gated(release) if not made else InMemoryRowExporter())
        return [made[-1]]

    router = Router(make, backend_threads=1)
    cache = DecodeCache()
    try:
        for i in range(20):  # run-0 hangs in its first write: the one thread of the kind is stuck in it
            router.ingest(decode_metrics(parse_metrics(_request(f"run-{i}", 0)), cache))
        others = [router._runs[f"run-{i}"] for i in range(1, 20)]
        assert all([run.flush(30) for run in others])  # a spare thread took the others' turns
        assert [len(m.metrics) for m in made[1:]] == [2] * 19
        assert router.pool.stalled == 1
        assert made[0].metrics == []
        release.set()
        assert router.flush(30)
        assert [(r.step, r.value) for r in made[0].metrics if r.tag == "train/loss"] == [(0, 0.5)]
    finally:
        release.set()
        router.close(30)
