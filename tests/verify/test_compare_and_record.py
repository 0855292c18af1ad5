"""The parts of verify that need no backend: comparing lists of (step, value), and the record's file format
(a torn tail, the cap, a pid's file reopened, a full disk, a deleted run folder)."""

from __future__ import annotations

import errno
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from otel_train.backend import Window
from otel_train.ship.logged_record import LoggedRecord, read_entries, record_files
from otel_train.verify.compare import compare, same_value
from otel_train.verify.expected import load
from otel_train.vocab.rows import MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("r", "r")


def test_each_kind_of_difference_is_named_with_its_steps() -> None:
    logged = [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)]
    held = [(0, 1.0), (1, 2.0), (1, 2.0), (2, 3.5), (9, 1.0)]
    r = compare("loss", 0, logged, held)
    assert (r.expected, r.present) == (4, 5)
    assert r.missing == [3]
    assert r.duplicated == [1]
    assert r.wrong_value == [(2, 3.0, 3.5)]
    assert r.unexpected_step == [9]
    assert not r.ok


def test_a_value_logged_twice_at_one_step_is_expected_twice() -> None:
    assert compare("x", 0, [(5, 1.0), (5, 2.0)], [(5, 2.0), (5, 1.0)]).ok
    r = compare("x", 0, [(5, 1.0), (5, 2.0)], [(5, 1.0)])
    assert r.missing == [5] and not r.duplicated


def test_float32_backends_compare_at_their_precision() -> None:
    v = 0.1 + 1e-12  # not a float32
    stored = float(__import__("numpy").float32(v))
    assert same_value(v, stored, float32=True)
    assert not same_value(v, stored, float32=False)
    assert not same_value(v, v, float32=True)  # a float32 backend holds no float64 value
    assert not same_value(0.1, 0.2, float32=True)
    assert same_value(math.nan, math.nan) and same_value(math.inf, math.inf)
    assert not same_value(math.inf, -math.inf) and not same_value(1.0, math.nan)


def _window(steps: range, tag: str = "loss") -> Window:
    return Window([MetricRow(RUN, s, tag, tag, float(s), "gauge", 0) for s in steps],
                  spans=[SpanRow(RUN, "step", 1, s + 1, None, 0, 0, 0, "", s, {}) for s in steps])


def _record(run_dir: Path, cap: int = 1 << 20) -> LoggedRecord:
    return LoggedRecord(run_dir, 0, cap, {"run_id": "r", "run_name": "r", "backends": {"jsonl": {"kind": "jsonl"}}})


def test_the_record_reads_back_as_logged(tmp_path: Path) -> None:
    record = _record(tmp_path)
    record.add(_window(range(3)))
    record.add(Window([MetricRow(RUN, s, "loss", "loss", 9.0, "gauge", 0) for s in (7, 5)]))  # not consecutive
    record.note_losses({"jsonl": {"refused": 2}}, {"jsonl": 1})
    record.close()
    plan = load(tmp_path)[0]
    backend = plan.backends["jsonl"]
    (points,) = backend.expected.points.values()
    assert points == [(0, 0.0), (1, 1.0), (2, 2.0), (7, 9.0), (5, 9.0)]
    assert backend.expected.spans == {"step": [0, 1, 2]}
    assert backend.lost == {"refused": 2, "step_order": 1}
    assert plan.stopped_at is None


def test_a_torn_tail_is_cut_when_the_file_is_reopened(tmp_path: Path) -> None:
    record = _record(tmp_path)
    record.add(_window(range(2)))
    record.close()
    (path,) = record_files(tmp_path)
    whole = path.stat().st_size
    with open(path, "ab") as f:  # a process killed mid-entry
        f.write(b"\x40\x00\x00\x00partial")
    assert [e["k"] for e in read_entries(path)] == ["h", "f", "w", "c"]  # the reader stops before it
    again = _record(tmp_path)  # the same pid: the same file, continued after its last whole entry
    assert again.path == path and path.stat().st_size > whole
    again.add(_window(range(2, 4)))
    again.close()
    assert [e["k"] for e in read_entries(path)] == ["h", "f", "w", "c", "h", "f", "w", "c"]
    (points,) = load(tmp_path)[0].backends["jsonl"].expected.points.values()
    assert [s for s, _ in points] == [0, 1, 2, 3]


def test_past_its_cap_the_record_says_where_it_stopped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    record = _record(tmp_path, cap=1500)
    for start in range(0, 400, 10):
        record.add(_window(range(start, start + 10)))
    record.close()
    (path,) = record_files(tmp_path)
    assert path.stat().st_size <= 1500
    plan = load(tmp_path)[0]
    (points,) = plan.backends["jsonl"].expected.points.values()
    assert plan.stopped_at == points[-1][0] and 0 < plan.stopped_at < 399
    assert sum("OTEL_TRAIN_VERIFY_RECORD_MB" in r.getMessage() for r in caplog.records) == 1


def test_a_record_that_cannot_be_written_stops_without_raising(tmp_path: Path) -> None:
    blocked = tmp_path / "run"
    blocked.mkdir()
    (blocked / "verify").write_text("a file where the folder should be")
    record = _record(blocked)
    record.add(_window(range(3)))  # nothing raised
    assert record.stopped and not record_files(blocked)
    assert os.path.isfile(blocked / "verify")


def test_a_window_recorded_twice_around_a_restart_counts_once(tmp_path: Path) -> None:
    """A spooled window is recorded before it is spooled: a writer killed between the two has it recorded, and the
    next writer (to which the training process sends it again) records it again, with the same seq."""
    first = _record(tmp_path)
    first.add(_window(range(2)), seq=1)
    first.add(_window(range(2, 4)), seq=2)
    first.close()
    again = _record(tmp_path)
    again.add(_window(range(2, 4)), seq=2)
    again.add(_window(range(4, 6)), seq=3)
    again.close()
    (points,) = load(tmp_path)[0].backends["jsonl"].expected.points.values()
    assert [s for s, _ in points] == [0, 1, 2, 3, 4, 5]


def test_values_refused_at_the_call_are_reported_with_their_cause(tmp_path: Path) -> None:
    from otel_train.ship.logged_record import write_session_record
    from otel_train.verify import check, format_report

    _record(tmp_path).close()  # a run whose backends were handed nothing
    write_session_record(tmp_path, 0, {"not_a_number": 3, "bad_key": 1, "none": 0})
    report = check(tmp_path)
    assert report.refusals == {"not_a_number": 3, "bad_key": 1}
    assert report.ok and report.exit_code == 0
    assert "refused at the call (never logged): 3 not_a_number, 1 bad_key" in format_report(report)


class _Disk:
    """`otel_train.ship.file_append`'s write with a disk that fills and frees (a short write, then ENOSPC)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from otel_train.ship import file_append

        self.full = False
        real = file_append._write

        def write(fd: int, data: bytes) -> int:
            if not self.full:
                return real(fd, data)
            if len(data) > 8:
                return real(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(file_append, "_write", write)


def _steps(run_dir: Path) -> list[int]:
    (points,) = load(run_dir)[0].backends["jsonl"].expected.points.values()
    return [s for s, _ in points]


def test_a_disk_that_fills_then_frees_leaves_a_whole_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = _Disk(monkeypatch)
    record = _record(tmp_path)
    record.add(_window(range(3)))
    disk.full = True
    record.add(_window(range(3, 6)))  # waits in memory; the file says from which step
    plan = load(tmp_path)[0]
    assert (plan.stopped_at, plan.stopped_why) == (2, "the record could not be written: the disk was full")
    assert _steps(tmp_path) == [0, 1, 2]  # no torn entry in the file
    disk.full = False
    record.add(_window(range(6, 9)))
    record.close()
    assert load(tmp_path)[0].stopped_at is None  # everything waiting was written: the mark is lifted
    assert _steps(tmp_path) == list(range(9))


def test_a_disk_full_to_the_end_stops_verify_where_the_record_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    disk = _Disk(monkeypatch)
    record = _record(tmp_path)
    record.add(_window(range(3)))
    disk.full = True
    record.add(_window(range(3, 6)))
    record.close()
    plan = load(tmp_path)[0]
    assert plan.stopped_at == 2 and _steps(tmp_path) == [0, 1, 2]
    assert sum("could not write its last 1 entries" in r.getMessage() for r in caplog.records) == 1


def test_a_deleted_run_folder_gets_a_new_record_from_the_next_window(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    record = _record(tmp_path)
    record.add(_window(range(3)))
    shutil.rmtree(tmp_path / "verify")  # `rm -rf` of the run folder's contents
    record.add(_window(range(3, 6)))
    record.close()
    plan = load(tmp_path)[0]
    assert list(plan.backends) == ["jsonl"] and plan.run_id == "r"  # its header again
    assert _steps(tmp_path) == [3, 4, 5]
    assert sum("was deleted while the run wrote to it" in r.getMessage() for r in caplog.records) == 1


def test_a_backend_still_starting_is_recorded_with_its_routing_rule(tmp_path: Path) -> None:
    """A job killed before a backend came up (its client slow to import) leaves windows recorded under a header
    written before the build: verify still expects the built-in series by the names that backend shows them under
    (TensorBoard: display names), as `otel-train replay` will write them."""
    import threading

    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.config.registry import get_spec, load_class
    from otel_train.ship.backend_start import StartingBackend
    from otel_train.ship.logged_record import open_record
    from otel_train.vocab.semconv import DISPLAY_NAMES

    held = threading.Event()

    def build(options: ExporterOptions) -> Any:
        held.wait(30)  # never up while the windows are recorded
        raise RuntimeError("not built in this test")

    cls = load_class(get_spec("tensorboard"))
    starting = StartingBackend("tensorboard", build, ExporterOptions(directory=str(tmp_path)), cls=cls, spooled=True)
    starting.start()
    record = open_record({"tensorboard": starting}, RUN, tmp_path, 1 << 20)
    assert record is not None
    name = "train.step.duration_s"
    record.add(Window([MetricRow(RUN, s, name, name, 0.5, "gauge", 0) for s in range(3)]), seq=1)
    held.set()  # the job is "killed": no entry after this window
    (key,) = load(record.run_dir)[0].backends["tensorboard"].expected.points
    assert key.tag == DISPLAY_NAMES[name] != name


@pytest.mark.parametrize("env_uri", [None, "sqlite:////elsewhere/mlflow.db"])
def test_a_backend_still_starting_is_recorded_with_its_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            env_uri: str | None) -> None:
    """MLflow still importing its client when the header is written (a job that ends or is killed before): the
    record names the store it will write to, so verify reads that store after `otel-train replay` filled it."""
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.config.registry import get_spec, load_class
    from otel_train.ship.backend_start import StartingBackend
    from otel_train.ship.logged_record import backend_info

    if env_uri is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", env_uri)
    cls = load_class(get_spec("mlflow"))
    starting = StartingBackend("mlflow", lambda options: None, ExporterOptions(directory=str(tmp_path)),  # type: ignore[arg-type,return-value]
                               cls=cls, spooled=True)  # never started: its build never runs
    info = backend_info("mlflow", starting)
    assert info["tracking_uri"] == (env_uri or f"sqlite:///{tmp_path.resolve() / 'mlruns' / 'mlflow.db'}")
    assert info["class"] == cls.__module__ == "otel_train.exporters.mlflow"


def test_a_disk_that_stayed_full_is_named_as_the_cause_and_the_verdict_says_where_checking_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows recorded past what the spool could write ahead, in a run whose disk stayed full: they were counted as
    "killed before written ahead" (nothing was killed), and the verdict said "pass" although the check stopped at
    the step where the record did."""
    from otel_train.ship.spool import rank_spool
    from otel_train.verify import BackendReport, VerifyReport
    from otel_train.verify.expected import DISK_FULL_IN_FLIGHT, KILLED_IN_FLIGHT

    disk = _Disk(monkeypatch)
    record = _record(tmp_path)
    record.add(_window(range(3)), seq=1)
    record.add(_window(range(3, 6)), seq=2)  # recorded, then the spool append failed: the disk is full
    disk.full = True
    record.add(_window(range(6, 9)), seq=3)
    spool = rank_spool(tmp_path, 0)
    spool.mkdir(parents=True)
    (spool / "cursors.json").write_text('{"jsonl": 1}')  # the spool wrote window 1 ahead, no more
    lost = load(tmp_path)[0].backends["jsonl"].lost
    assert lost.get(DISK_FULL_IN_FLIGHT) == 6 and KILLED_IN_FLIGHT not in lost, lost  # windows 2 and 3

    report = VerifyReport(tmp_path, [BackendReport(0, "jsonl", "pass", not_checked_past=5,
                                                   not_checked_why="the record could not be written")])
    assert report.verdict() == "verify: pass up to step 5, not past it (1 backend)"
