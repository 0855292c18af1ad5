"""Storage faults in every file backend (TensorBoard, JSONL, the Chrome trace plain and gzip): a full disk cuts a
failed append back and writes it whole once there is space; a run folder deleted during the run is said once and
written again. Read back as lists with each backend's own reader, so a row written twice or torn fails the test.
"""

from __future__ import annotations

import errno
import gzip
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import readback

from otel_train.backend import RowExporter, Window
from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.chrome_trace import ChromeTraceExporter
from otel_train.exporters.jsonl import JsonlExporter
from otel_train.exporters.tensorboard import TensorBoardExporter
from otel_train.ship import file_append
from otel_train.vocab.rows import MetricRow
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("r", "disk")
BACKENDS = ["tensorboard", "jsonl", "chrome_trace", "chrome_trace_gzip"]


def _backend(name: str, directory: Path) -> RowExporter:
    if name == "tensorboard":
        return TensorBoardExporter(ExporterOptions(directory=directory))
    if name == "jsonl":
        return JsonlExporter(ExporterOptions(directory=directory))
    return ChromeTraceExporter(ExporterOptions(directory=directory, trace_gzip=name.endswith("gzip")))


def _window(steps: range) -> Window:
    # Several series per step, so a window is large enough to be cut in the middle of a record.
    return Window([MetricRow(RUN, s, f"s{i}", f"s{i}", float(s * 10 + i), "gauge", 1_000_000 * (s + 1))
                   for s in steps for i in range(8)])


def _want(steps: range) -> list[tuple[str, float]]:
    return sorted((f"s{i}", float(s * 10 + i)) for s in steps for i in range(8))


def _held(name: str, run_dir: Path) -> list[tuple[str, float]]:
    """(series, value) of every point the backend holds, with its own reader; the trace must be valid JSON."""
    if name == "tensorboard":
        return sorted((p.name, p.value) for p in readback.tensorboard(run_dir))
    if name == "jsonl":
        return sorted((p.name, p.value) for p in readback.jsonl(run_dir / "rank0.jsonl"))
    points = []
    for path in sorted((run_dir / "trace").iterdir()):
        raw = path.read_bytes()
        events = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)  # strict: closed cleanly
        points += [(e["name"], e["args"]["value"]) for e in events if e.get("ph") == "C"]
    return sorted(points)


def _full_disk(on: Callable[[], bool]) -> Callable[[int, Any], int]:
    """`os.write` as on a full disk while `on()`: a short write (half), then ENOSPC."""
    def write(fd: int, data: Any) -> int:
        if not on():
            return os.write(fd, data)
        if len(data) > 64:
            return os.write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write


@pytest.mark.parametrize("name", BACKENDS)
def test_a_full_disk_leaves_no_torn_record_and_every_row_lands_once_when_space_returns(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = {"on": False}
    monkeypatch.setattr(file_append, "_write", _full_disk(lambda: full["on"]))
    backend = _backend(name, tmp_path)
    with backend:
        assert backend.export_window(_window(range(3)))
        sizes = {p: p.stat().st_size for p in (tmp_path / "disk").rglob("*") if p.is_file()}
        full["on"] = True
        assert not backend.export_window(_window(range(3, 6)))
        assert not backend.force_flush()  # tried again: still full
        # Cut back at once: each file as it was before the failed window (no torn record mid-file).
        assert {p: p.stat().st_size for p in sizes} == sizes
        assert backend.rows_lost == {} and backend.unwritten_windows == 1  # kept for a retry, nothing refused
        full["on"] = False
        assert backend.force_flush()  # the kept window, whole, without waiting for the backoff
        assert backend.export_window(_window(range(6, 9)))
    assert _held(name, tmp_path / "disk") == _want(range(9))
    assert backend.rows_lost == {}


@pytest.mark.parametrize("name", BACKENDS)
def test_a_disk_never_freed_counts_what_was_not_written(name: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    full = {"on": False}
    monkeypatch.setattr(file_append, "_write", _full_disk(lambda: full["on"]))
    backend = _backend(name, tmp_path)
    assert backend.export_window(_window(range(2)))
    full["on"] = True
    for start in range(2, 12, 2):
        backend.export_window(_window(range(start, start + 2)))
    backend.shutdown()
    full["on"] = False
    if name.startswith("chrome_trace"):  # the closing `]` could not be written either: readers take the rest
        from otel_train.trace_merge import load_trace

        (path,) = (tmp_path / "disk" / "trace").iterdir()
        held = sorted((e["name"], e["args"]["value"]) for e in load_trace(path) if e.get("ph") == "C")
    else:
        held = _held(name, tmp_path / "disk")
    assert held == _want(range(2))
    assert backend.rows_lost == {"disk_full": 10 * 8}  # 5 windows of 2 steps x 8 series, counted exactly


@pytest.mark.parametrize("name", BACKENDS)
def test_a_deleted_run_folder_is_said_once_and_written_again(name: str, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    file_append._warned.clear()
    caplog.set_level(logging.WARNING)
    with _backend(name, tmp_path) as backend:
        assert backend.export_window(_window(range(3)))
        shutil.rmtree(tmp_path / "disk")  # the user's `rm -rf` of the run folder
        assert backend.export_window(_window(range(3, 6)))
        assert backend.export_window(_window(range(6, 9)))
    said = [r.getMessage() for r in caplog.records if "was deleted while the run wrote to it" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "disk") in said[0], said
    assert getattr(backend, "files_recreated", None) == 1
    assert _held(name, tmp_path / "disk") == _want(range(3, 9))  # what was deleted is gone; nothing after it


def test_a_preemption_mark_after_the_run_folder_was_deleted_lands_in_a_new_file(tmp_path: Path) -> None:
    file_append._warned.clear()
    with JsonlExporter(ExporterOptions(directory=tmp_path)) as backend:
        assert backend.export_window(_window(range(3)))
        shutil.rmtree(tmp_path / "disk")
        backend.mark_preempted("SIGTERM")
    records = [json.loads(line) for line in (tmp_path / "disk" / "rank0.jsonl").read_text().splitlines()]
    assert [(r["type"], r.get("signal")) for r in records] == [("preempted", "SIGTERM")]
