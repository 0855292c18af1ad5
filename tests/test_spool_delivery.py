"""The spool (torn tails, cursors, segment removal) and delivery (per-backend cursors, stalls, failures)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from otel_train.config.exporter_options import ExporterOptions
from otel_train.ship import spool as spool_mod
from otel_train.ship.delivery import Delivery
from otel_train.ship.framing import decode_window, encode_window
from otel_train.ship.spool import Spool, last_seq
from otel_train.testing import InMemoryRowExporter
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("run", "run")


def window(step: int) -> bytes:
    return encode_window(RUN, [("train/loss", step, float(step), 1_000 + step)])[0]


def test_encoded_window_round_trip() -> None:
    payload, max_step = encode_window(RUN, [("a", 3, 0.5, 7), ("b", 4, 1.5, 8)])
    w = decode_window(payload)
    assert max_step == 4
    assert [(r.run, r.tag, r.step, r.value, r.kind, r.time_unix_nano) for r in w.metrics] == [
        (RUN, "a", 3, 0.5, "gauge", 7), (RUN, "b", 4, 1.5, "gauge", 8)]


def test_torn_tail_resends_and_cursors_survive(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    for seq in range(1, 4):
        assert sp.append(seq, seq, window(seq))
    assert not sp.append(2, 2, window(2))  # a resend after a restart is skipped
    sp.acknowledge("tb", 2)
    sp.close()
    (seg,) = sp.segments()
    seg.write_bytes(seg.read_bytes()[:-5])  # the writer was killed mid-record
    again = Spool(tmp_path)
    assert [seq for seq, _, _ in again.read(0)] == [1, 2]
    assert again.last_seq == 2 and again.cursor("tb") == 2
    assert [decode_window(p).metrics[0].step for _, _, p in again.read(1)] == [2]


def test_segments_roll_and_go_once_every_backend_acknowledged(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_mod, "_SEGMENT_BYTES", 1)  # one record per segment
    sp = Spool(tmp_path)
    sp.backends = ["a", "b"]  # as `Delivery` sets them
    for seq in range(1, 6):
        sp.append(seq, seq, window(seq))
    assert len(sp.segments()) == 5
    sp.acknowledge("a", 5)
    sp.acknowledge("b", 3)
    sp.remove_acknowledged()
    assert [int(s.stem) for s in sp.segments()] == [4, 5]
    sp.acknowledge("b", 5)
    sp.close()
    sp.remove_acknowledged()
    assert sp.segments() == []
    assert Spool(tmp_path).last_seq == 5  # seqs continue after what was acknowledged, not from 1


def _steps(exporter: InMemoryRowExporter) -> list[int]:
    return [r.step for r in exporter.metrics]


class Stalled(InMemoryRowExporter):
    """Holds every metrics write until `gate` is set (a backend far behind the loop)."""

    def __init__(self, options: ExporterOptions, gate: threading.Event) -> None:
        super().__init__(options)
        self.gate = gate

    def write_metrics(self, rows: Any, histograms: Any) -> None:
        self.gate.wait(30)
        super().write_metrics(rows, histograms)


def test_a_stalled_backend_reads_back_from_the_spool_and_a_failing_one_retries(tmp_path: Path) -> None:
    gate = threading.Event()
    options = ExporterOptions(tmp_path)
    fast, stalled = InMemoryRowExporter(options), Stalled(options, gate)
    flaky = InMemoryRowExporter(options, fail_times=1)
    delivery = Delivery({"fast": fast, "stalled": stalled, "flaky": flaky}, Spool(tmp_path / "spool"),
                        queue_windows=2)
    for step in range(40):
        delivery.submit(step + 1, step, window(step))
    deadline = time.monotonic() + 30
    assert not delivery.flush(time.monotonic() + 0.5)  # `stalled` holds it up; the others are done
    assert _steps(fast) == list(range(40))
    progress = delivery.progress()
    assert progress.delivered["fast"] == 40 and progress.behind()["stalled"] > 0
    gate.set()
    assert delivery.close(deadline)
    assert _steps(stalled) == list(range(40))  # every window once, in order, though most came from disk
    assert _steps(flaky) == list(range(40)) and flaky.failures >= 1
    assert Spool(tmp_path / "spool").cursors == {"fast": 40, "stalled": 40, "flaky": 40}


def test_a_new_delivery_resumes_each_backend_after_its_cursor(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    for step in range(10):
        sp.append(step + 1, step, window(step))
    sp.acknowledge("tb", 10)
    sp.acknowledge("wandb", 4)
    sp.close()
    tb, wandb = InMemoryRowExporter(), InMemoryRowExporter()
    assert Delivery({"tb": tb, "wandb": wandb}, Spool(tmp_path)).close(time.monotonic() + 30)
    assert _steps(tb) == [] and _steps(wandb) == list(range(4, 10))
    again = InMemoryRowExporter()
    assert Delivery({"wandb": again}, Spool(tmp_path)).close(time.monotonic() + 30)
    assert _steps(again) == []  # replay is idempotent


def test_segments_go_while_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_mod, "_SEGMENT_BYTES", 1)
    exporter = InMemoryRowExporter()
    delivery = Delivery({"mem": exporter}, Spool(tmp_path))
    for step in range(20):
        delivery.submit(step + 1, step, window(step))
    assert delivery.flush(time.monotonic() + 30)
    assert [int(s.stem) for s in Spool(tmp_path).segments()] == [20]  # only the open segment is left
    delivery.close(time.monotonic() + 30)


def test_without_a_spool_a_full_queue_pushes_back_and_nothing_accepted_is_lost() -> None:
    """The sink's mode: `submit_window` waits for room, and says False (queueing nothing) if a
    backend's queue stays full; once the backend moves, every accepted window is written once."""
    release = threading.Event()

    class Stuck(InMemoryRowExporter):
        def write_metrics(self, rows: Any, histograms: Any) -> None:
            release.wait(30)
            super().write_metrics(rows, histograms)

    stuck, quick = Stuck(), InMemoryRowExporter()
    d = Delivery({"stuck": stuck, "quick": quick}, None, queue_windows=2)
    accepted = []
    for step in range(6):
        if d.submit_window(decode_window(window(step)), step, 0.2):
            accepted.append(step)
        if step == 0:
            while d.backlogged():  # until the first window is in the backends' hands, not their queues
                time.sleep(0.005)
    assert accepted == [0, 1, 2]  # one in the backend, two queued
    assert d.backlogged()
    release.set()
    assert d.flush(time.monotonic() + 30)
    assert _steps(stuck) == _steps(quick) == [0, 1, 2]
    assert d.rows_written == 3 and d.pending == 0
    assert d.close(time.monotonic() + 30)


class _Busy(InMemoryRowExporter):
    """A backend whose writes wait until `release` is set (busy: windows queue up behind it)."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self._release = release

    def write_metrics(self, rows: Any, histograms: Any) -> None:
        self._release.wait(30)
        super().write_metrics(rows, histograms)


@pytest.mark.parametrize("merges", [True, False], ids=["merged", "one_per_call"])
def test_in_process_a_busy_backend_gets_the_waiting_windows_and_loses_none(merges: bool) -> None:
    """The training process's mode (`put`, never waiting): while a backend is busy its windows merge into
    its last queued one instead of being dropped; once it moves it writes every step once, in order. A backend
    with `merges_windows = False` (the sink's reorder hold, which tells a sender starting over by its windows)
    gets them one per call instead."""
    release = threading.Event()
    busy = _Busy(release)
    busy.merges_windows = merges
    d = Delivery({"busy": busy}, None, queue_windows=2 if merges else 64)
    for step in range(50):
        d.put(decode_window(window(step)), step)
    release.set()
    assert d.flush(time.monotonic() + 30)
    assert [(r.step, r.value) for r in busy.metrics] == [(s, float(s)) for s in range(50)]
    exports = d.backend_stats()["busy"]["exports"]
    assert exports <= 3 if merges else exports == 50  # merged: the first window, then the merged rest
    assert d.backend_stats()["busy"]["dropped"] == 0
    assert d.close(time.monotonic() + 30)


def test_without_a_spool_a_failed_write_is_reported_and_a_failed_flush_answers_false() -> None:
    errors: list[str] = []
    bad = InMemoryRowExporter()
    d = Delivery({"bad": bad}, None, on_error=errors.append)
    bad.fail_times = 10**6  # every write fails, and so does every flush (the failed rows are pending)
    assert d.submit_window(decode_window(window(0)), 0, 1.0)
    assert not d.flush(time.monotonic() + 600)  # answers once the flush was tried, not at the deadline
    assert errors and set(errors) == {"bad"}
    bad.fail_times = 0
    d.close(time.monotonic() + 30)


class _LaggingStore(InMemoryRowExporter):
    """A backend whose store holds steps only up to `held` (W&B's service writing its file later)."""

    name = "lagging"

    def __init__(self) -> None:
        super().__init__()
        self.held: int | None = -1

    def durable_step(self) -> int | None:
        return self.held


def test_a_cursor_claims_only_what_the_backend_store_holds(tmp_path: Path) -> None:
    store = _LaggingStore()
    store.held = 4  # before any window: a flush the backend thread makes on its own sees the same store
    d = Delivery({"lagging": store}, Spool(tmp_path))
    for seq in range(1, 11):
        d.submit(seq, seq - 1, window(seq - 1))
    assert d.flush(time.monotonic() + 30)  # the backend has it all; its store does not yet
    # Never more than the store holds (windows 1-5, steps 0-4). Windows that queued up are written together,
    # and the cursor moves over whole writes only, so it may claim less (the spool keeps the rest): 0 when all
    # ten went in one write, 5 when they went one by one.
    claimed, claimed_step = d.progress().delivered["lagging"], d.progress().delivered_step["lagging"]
    assert claimed <= 5 and claimed_step <= 4
    assert Spool(tmp_path).cursor("lagging") == claimed
    store.held = None  # its store holds everything (W&B: after finish)
    assert d.close(time.monotonic() + 30)
    assert Spool(tmp_path).cursor("lagging") == 10


def test_a_child_window_goes_right_after_the_window_it_followed(tmp_path: Path) -> None:
    mem = InMemoryRowExporter()
    d = Delivery({"mem": mem}, Spool(tmp_path))
    d.submit(1, 0, window(0))
    child = decode_window(encode_window(RUN, [("data/item", 0, 7.0, 5)])[0])
    d.submit_side(child)
    d.submit(2, 1, window(1))
    assert d.close(time.monotonic() + 30)
    assert [(r.tag, r.step) for r in mem.metrics] == [("train/loss", 0), ("data/item", 0), ("train/loss", 1)]


def test_progress_has_the_rows_each_backend_did_not_write(tmp_path: Path) -> None:
    class Picky(InMemoryRowExporter):
        def row_problem(self, row: Any) -> str | None:
            return "refused" if row.step == 1 else super().row_problem(row)

    d = Delivery({"picky": Picky(), "mem": InMemoryRowExporter()}, Spool(tmp_path))
    for seq in range(1, 4):
        d.submit(seq, seq - 1, window(seq - 1))
    assert d.flush(time.monotonic() + 30)
    assert d.progress().rows_lost == {"picky": {"refused": 1}}
    d.close(time.monotonic() + 30)


def test_sync_says_durable_only_when_every_window_was_written_ahead(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    sp = Spool(tmp_path)
    assert sp.append(1, 1, window(1)) and sp.sync()
    real_roll = sp._roll

    def full_disk(seq: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sp, "_roll", full_disk)
    sp._file = None  # the next append opens a segment: the disk is full
    assert not sp.append(2, 2, window(2))
    assert not sp.sync()  # window 2 is in memory only: not durable, whatever fsync says
    monkeypatch.setattr(sp, "_roll", real_roll)
    sp.close()


def test_a_kept_window_is_retried_with_a_backoff_growing_to_minutes() -> None:
    from otel_train.backend import Window
    from otel_train.ship.window_writer import MAX_BACKOFF_S
    from otel_train.vocab.rows import MetricRow

    down = InMemoryRowExporter(fail_times=10**9)
    writer = down.window_writer
    writer.keep_failed = True  # as delivery sets it when a spool holds the windows
    writer.pending.append(Window([MetricRow(RUN, 1, "loss", "loss", 1.0, "gauge", 0, {})]))
    waits = []
    for _ in range(14):  # past `max_attempts` (8)
        assert not writer.drain(force=True)
        waits.append(round(writer.retry_in_s()))
    assert down.dropped_windows == 0 and len(writer.pending) == 1 and not down.metrics
    assert waits == sorted(waits) and waits[8] > 100 and waits[-1] == MAX_BACKOFF_S


def test_last_seq_reads_what_opening_the_spool_finds_without_writing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer numbers windows from `last_seq` before its exporter process opens the spool: both must agree,
    and reading must neither create nor change a file."""
    assert last_seq(tmp_path / "none") == 0 and not (tmp_path / "none").exists()
    monkeypatch.setattr(spool_mod, "_SEGMENT_BYTES", 1)  # one record per segment
    sp = Spool(tmp_path)
    sp.backends = ["a"]
    for seq in range(1, 5):
        sp.append(seq, seq, window(seq))
    sp._roll(5)  # a segment opened, then the writer killed before its first record
    sp.close()
    assert last_seq(tmp_path) == Spool(tmp_path).last_seq == 4
    (seg4,) = [s for s in sp.segments() if int(s.stem) == 4]
    seg4.write_bytes(seg4.read_bytes()[:-5])  # window 4 torn
    assert last_seq(tmp_path) == Spool(tmp_path).last_seq == 3
    sp = Spool(tmp_path)
    sp.backends = ["a"]
    sp.acknowledge("a", 3)  # every segment read: gone
    sp.close()
    sp.remove_acknowledged()
    sp.advance("b", 7)  # a kill-safe writer recorded more than the segments hold
    sp.close()
    files = {p: p.read_bytes() for p in tmp_path.iterdir()}
    assert last_seq(tmp_path) == Spool(tmp_path).last_seq == 7
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_windows_the_spool_could_not_hold_reach_a_stalled_backend_from_memory(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while a backend is behind: the windows the spool could not write ahead are its only copy in
    memory, never skipped when the stalled backend reads the rest back from the spool."""
    gate = threading.Event()
    options = ExporterOptions(tmp_path)
    fast, stalled = InMemoryRowExporter(options), Stalled(options, gate)
    sp = Spool(tmp_path / "spool")
    delivery = Delivery({"fast": fast, "stalled": stalled}, sp, queue_windows=2)
    for step in range(10):
        delivery.submit(step + 1, step, window(step))
    real_roll = sp._roll

    def full_disk(seq: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sp, "_roll", full_disk)
    sp._file = None  # the next append opens a segment: the disk is full
    for step in range(10, 20):
        delivery.submit(step + 1, step, window(step))
    monkeypatch.setattr(sp, "_roll", real_roll)  # space again
    for step in range(20, 30):
        delivery.submit(step + 1, step, window(step))
    gate.set()
    assert delivery.close(time.monotonic() + 30)
    assert sp.failed_appends == 10
    assert _steps(stalled) == list(range(30))  # a list: every window once, in order
    assert _steps(fast) == list(range(30))
    assert delivery.rows_lost() == {}


def test_windows_kept_in_memory_that_a_backend_never_takes_are_counted_as_lost_to_a_full_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    down = InMemoryRowExporter(ExporterOptions(tmp_path), fail_times=10**9)
    sp = Spool(tmp_path / "spool")
    monkeypatch.setattr(sp, "_roll", lambda seq: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    delivery = Delivery({"down": down}, sp, queue_windows=2)
    for step in range(5):
        delivery.submit(step + 1, step, window(step))
    assert not delivery.close(time.monotonic() + 3)
    assert delivery.rows_lost() == {"down": {"disk_full": 5}}  # one row per window, none of them silent
