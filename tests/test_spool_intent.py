"""The intent record written before a backend's append (`otel_train.ship.append_intent`): what is cut back after a
kill between the append and its record, and that nothing is cut when the record is stale or torn (a repeat at
worst, never a loss). The real kill, of real processes, is in `tests/faults/test_kill_between_write_and_record.py`
and `tests/sink/test_restart.py`; here the state a kill leaves is made by hand."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from otel_train.backend import RowExporter, Window
from otel_train.config.exporter_options import ExporterOptions
from otel_train.ship.append_intent import INTENT_OFFSET, AppendIntent
from otel_train.ship.delivery import Delivery
from otel_train.ship.framing import encode_window
from otel_train.ship.spool import Spool
from otel_train.vocab.rows import HistogramRow, MetricRow
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("run", "run")


def _window(step: int) -> bytes:
    return encode_window(RUN, [("loss", step, 0.0, 1), ("acc", step, 0.0, 1)])[0]


class _Lines(RowExporter):
    """Appends one line per row to one file, reporting the append first; `fail_after` rows, it raises (a write
    that fails half way: a full disk)."""

    name = "lines"
    kill_safe_writes = True
    max_attempts = 0  # a failed window waits for the next write
    isolate_rows = False
    backoff_s = (0.0,)

    def __init__(self, path: Path) -> None:
        super().__init__(ExporterOptions(directory=path.parent))
        self.path = path
        self.fail_after: int | None = None

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        self.mark_appending([(self.path, self.path.stat().st_size if self.path.exists() else 0)])
        with open(self.path, "a") as f:
            for i, r in enumerate(rows):
                if self.fail_after is not None and i >= self.fail_after:
                    raise OSError("disk full")
                f.write(f"{r.step}\n")
                f.flush()
                self.mark_written([r])


def _steps(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().splitlines()]


def _deliver(spool_dir: Path, out: Path, seqs: Sequence[int], *, fail: int | None = None) -> _Lines:
    backend = _Lines(out)
    delivery = Delivery({"lines": backend}, Spool(spool_dir))
    for seq in seqs:
        backend.fail_after = fail if seq == seqs[-1] and fail is not None else None
        delivery.submit(seq, seq, _window(seq))
        _settle(delivery, seq)
    _end_keeping_the_spool(delivery)
    return backend


def _end_keeping_the_spool(delivery: Delivery) -> None:
    """Flush and shut the backends down, but leave the spool's segments as a killed process would."""
    assert delivery.flush(time.monotonic() + 10)
    delivery.stop()
    deadline = time.monotonic() + 10
    while delivery.still_running() and time.monotonic() < deadline:
        time.sleep(0.005)


def _settle(delivery: Delivery, seq: int) -> None:
    deadline = time.monotonic() + 10
    while delivery.pending and time.monotonic() < deadline:
        time.sleep(0.005)


def _as_if_killed_before_recording(spool_dir: Path, written: int) -> None:
    """The state a kill right after the append of the windows after `written` leaves: neither their `written.*`
    record nor a flush's cursor."""
    spool = Spool(spool_dir)
    spool.advance("lines", written)
    (spool_dir / "cursors.json").write_text(f'{{"lines": {written}}}')
    spool.close()


def test_the_unrecorded_write_is_cut_back_and_delivered_once(tmp_path: Path) -> None:
    spool_dir, out = tmp_path / "spool", tmp_path / "lines.txt"
    _deliver(spool_dir, out, [1, 2, 3])
    assert _steps(out) == [1, 1, 2, 2, 3, 3]
    mark, files = AppendIntent(spool_dir / "written.lines", INTENT_OFFSET).read() or (None, {})
    assert mark == 2 and files == {str(out): 8}  # window 3 was about to be appended after window 2, at byte 8
    _as_if_killed_before_recording(spool_dir, 2)
    spool = Spool(spool_dir)
    assert spool.cut_unrecorded_appends("lines") == 4 and _steps(out) == [1, 1, 2, 2]
    assert spool.cut_unrecorded_appends("lines") == 0  # applied once
    spool.close()
    _deliver(spool_dir, out, [])  # a restarted process resumes after window 2
    assert _steps(out) == [1, 1, 2, 2, 3, 3]


def test_a_failed_write_is_cut_back_with_the_write_that_retried_it(tmp_path: Path) -> None:
    spool_dir, out = tmp_path / "spool", tmp_path / "lines.txt"
    backend = _Lines(out)
    delivery = Delivery({"lines": backend}, Spool(spool_dir))
    delivery.submit(1, 1, _window(1))
    _settle(delivery, 1)
    backend.fail_after = 1
    delivery.submit(2, 2, _window(2))  # its first row lands, then the write fails: the rest waits for a retry
    _settle(delivery, 2)
    assert _steps(out) == [1, 1, 2]
    backend.fail_after = None
    _end_keeping_the_spool(delivery)  # its flush retries the rest of window 2
    assert _steps(out) == [1, 1, 2, 2]
    # The intent of the retrying write kept the size from before the failed one (nothing was recorded between)
    mark, files = AppendIntent(spool_dir / "written.lines", INTENT_OFFSET).read() or (None, {})
    assert mark == 1 and files == {str(out): 4}
    _as_if_killed_before_recording(spool_dir, 1)
    spool = Spool(spool_dir)
    assert spool.cut_unrecorded_appends("lines") == 4  # the failed write's partial append goes too
    spool.close()
    _deliver(spool_dir, out, [3])
    assert _steps(out) == [1, 1, 2, 2, 3, 3]


def test_a_stale_record_cuts_nothing(tmp_path: Path) -> None:
    spool_dir, out = tmp_path / "spool", tmp_path / "lines.txt"
    _deliver(spool_dir, out, [1, 2, 3])  # window 3 was recorded (after the intent naming mark 2)
    spool = Spool(spool_dir)
    assert spool.cursor("lines") == 3 and spool.cut_unrecorded_appends("lines") == 0
    assert _steps(out) == [1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("damage", ["torn", "short", "garbage"])
def test_a_torn_record_cuts_nothing(tmp_path: Path, damage: str) -> None:
    spool_dir, out = tmp_path / "spool", tmp_path / "lines.txt"
    _deliver(spool_dir, out, [1, 2, 3])
    _as_if_killed_before_recording(spool_dir, 2)
    record = spool_dir / "written.lines"
    data = record.read_bytes()
    head, intent = data[:INTENT_OFFSET], data[INTENT_OFFSET:]
    intent = {"torn": intent[:-3], "short": intent[:5], "garbage": intent[:8] + b"x" * (len(intent) - 8)}[damage]
    record.write_bytes(head + intent)
    spool = Spool(spool_dir)
    assert spool.cut_unrecorded_appends("lines") == 0
    assert _steps(out) == [1, 1, 2, 2, 3, 3]  # as before intents: the last window may repeat, never be lost


def test_a_file_is_never_extended_and_a_torn_cursor_falls_back_to_the_record(tmp_path: Path) -> None:
    spool_dir, out = tmp_path / "spool", tmp_path / "lines.txt"
    _deliver(spool_dir, out, [1, 2, 3])
    _as_if_killed_before_recording(spool_dir, 2)
    record = spool_dir / "written.lines"
    record.write_bytes(b"\x00" * 12 + record.read_bytes()[12:])  # the 12-byte record torn: only the flush cursor
    (spool_dir / "cursors.json").write_text('{"lines": 1}')
    spool = Spool(spool_dir)
    assert spool.cursor("lines") == 1
    assert spool.cut_unrecorded_appends("lines") == 4
    assert spool.cursor("lines") == 2  # the record says windows up to 2 were written: resume after them
    out.write_text("1\n")  # shorter than recorded (a machine crash lost data): never extended
    intent = AppendIntent(tmp_path / "again")
    intent.write(0, {str(out): 100})
    assert intent.cut_back({str(out): 100}) == 0 and out.read_text() == "1\n"


def test_a_window_that_writes_nothing_cuts_nothing_a_missing_file_is_skipped(tmp_path: Path) -> None:
    intent = AppendIntent(tmp_path / "appending.x")
    assert intent.read() is None
    intent.write(4, {str(tmp_path / "never-created"): 0})
    assert intent.read() == (4, {str(tmp_path / "never-created"): 0})
    assert intent.cut_back({str(tmp_path / "never-created"): 0}) == 0
    intent.clear()
    assert intent.read() is None


def test_an_exporter_without_a_listener_reports_to_nobody(tmp_path: Path) -> None:
    backend = _Lines(tmp_path / "lines.txt")
    assert backend.export_window(Window([MetricRow(RUN, 1, "loss", "loss", 1.0, "gauge", 1)]))
    heard: list[object] = []
    backend.watch_appends(heard.append)
    assert backend.export_window(Window([MetricRow(RUN, 2, "loss", "loss", 1.0, "gauge", 1)]))
    assert heard == [[(str(tmp_path / "lines.txt"), 2)]]


def test_a_backend_cut_back_at_replay_gets_what_was_cut_whatever_verify_said(tmp_path: Path) -> None:
    """Verify, run before replay, finds the killed writer's unrecorded append in the file and says the backend
    holds everything; replay's resume cuts that append back: the backend must then be handed those windows
    again, not nothing (verify's 'pass' no longer holds), and a backend whose files were not cut keeps its
    verdict (it is handed nothing)."""
    from otel_train.ship.replay import _keep
    from otel_train.verify import BackendReport, VerifyReport
    from otel_train.verify.wanted import rows_missing

    spool_dir, out = tmp_path / "rank0", tmp_path / "lines.txt"
    _deliver(spool_dir, out, [1, 2, 3])
    _as_if_killed_before_recording(spool_dir, 2)
    assert _steps(out) == [1, 1, 2, 2, 3, 3]  # what verify reads back: every value once
    passed = rows_missing(VerifyReport(tmp_path, [BackendReport(0, "lines", "pass", expected=6, present=6)]))
    backend = _Lines(out)
    delivery = Delivery({"lines": backend}, Spool(spool_dir), row_filter=_keep(spool_dir.name, passed))
    _end_keeping_the_spool(delivery)
    assert _steps(out) == [1, 1, 2, 2, 3, 3]

    # Behind its cursor but nothing to cut (no intent in force): the verdict holds, window 3 is not handed again.
    _as_if_killed_before_recording(spool_dir, 2)
    AppendIntent(spool_dir / "written.lines", INTENT_OFFSET).clear()
    delivery = Delivery({"lines": _Lines(out)}, Spool(spool_dir), row_filter=_keep(spool_dir.name, passed))
    _end_keeping_the_spool(delivery)
    assert _steps(out) == [1, 1, 2, 2, 3, 3]


def test_the_training_process_taking_over_cuts_back_and_leaves_no_intent_for_replay(tmp_path: Path) -> None:
    """The in-process fallback (the training process taking over after its exporter processes died) builds its
    backends and a delivery over the same spool: it cuts back the killed process's unrecorded TensorBoard write
    and writes it once; once its writes are recorded no intent is left that a later replay would cut."""
    import readback

    from otel_train.ship.backend_start import starting_backends

    def started(options: ExporterOptions) -> dict[str, RowExporter]:
        """The backends as the exporter process and the fallback start them."""
        backends = starting_backends(["tensorboard"], options, spooled=True)
        for backend in backends.values():
            backend.start()
        return dict(backends)

    options = ExporterOptions(directory=tmp_path)
    spool_dir = tmp_path / "spool" / "rank0"
    killed = Delivery(started(options), Spool(spool_dir))
    for seq in (1, 2, 3):
        killed.submit(seq, seq, _window(seq))
        _settle(killed, seq)
    _end_keeping_the_spool(killed)
    spool = Spool(spool_dir)  # killed right after writing window 3: neither its record nor a flush's cursor
    spool.advance("tensorboard", 2)
    (spool_dir / "cursors.json").write_text('{"tensorboard": 2}')
    spool.close()

    def steps() -> list[tuple[str, int]]:
        return sorted((p.name, p.step) for p in readback.tensorboard(tmp_path / "run"))

    assert steps() == sorted((tag, s) for s in (1, 2, 3) for tag in ("acc", "loss"))
    fallback = Delivery(started(options), Spool(spool_dir))
    assert fallback.close(time.monotonic() + 30)
    assert steps() == sorted((tag, s) for s in (1, 2, 3) for tag in ("acc", "loss"))  # window 3 once
    spool = Spool(spool_dir)
    assert spool.cursor("tensorboard") == 3
    assert spool.cut_unrecorded_appends("tensorboard") == 0  # replay later cuts nothing
    assert steps() == sorted((tag, s) for s in (1, 2, 3) for tag in ("acc", "loss"))
