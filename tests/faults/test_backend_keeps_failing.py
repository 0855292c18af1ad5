"""A backend that fails for a long time loses nothing: given up is a state, not a delete.

Its windows stay in the spool (the cursor before them, the segments kept) until that backend holds them; the
live delivery retries with a growing backoff, and `otel-train replay` retries what the run left, exiting non-zero
and naming the backend and the spool folder while anything is missing.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest
import readback
from faultkit import SERIES, value

import otel_train as ot
from otel_train.cli import main as cli_main
from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.jsonl import jsonl_path
from otel_train.ship.backend_start import StartingBackend
from otel_train.ship.delivery import Delivery
from otel_train.ship.framing import encode_window
from otel_train.ship.spool import Spool, try_lock
from otel_train.testing import InMemoryRowExporter
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("run", "run")
WINDOWS = 12


class Flaky(InMemoryRowExporter):
    """Fails its first `fail_times` writes (fault injection), with a short backoff so the test is quick."""

    name = "mem"
    max_attempts = 2
    backoff_s = (0.01, 0.02)


def _submit_all(delivery: Delivery) -> None:
    for seq in range(1, WINDOWS + 1):
        payload, step = encode_window(RUN, [("loss", seq, float(seq), 1_000 + seq)])
        delivery.submit(seq, step, payload)


def _steps(exporter: InMemoryRowExporter) -> list[int]:
    return [r.step for r in exporter.metrics]


def test_a_backend_failing_many_times_then_recovering_gets_every_window_once(tmp_path: Path) -> None:
    flaky = Flaky(fail_times=20)  # ten times the tries after which a window used to be dropped
    delivery = Delivery({"mem": flaky}, Spool(tmp_path))
    _submit_all(delivery)
    deadline = time.monotonic() + 60
    while _steps(flaky) != list(range(1, WINDOWS + 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert delivery.close(time.monotonic() + 10)
    assert _steps(flaky) == list(range(1, WINDOWS + 1))  # every window, once, in order
    assert flaky.dropped_windows == 0 and not delivery.rows_lost()
    assert Spool(tmp_path).cursor("mem") == WINDOWS


def _delivery(exporter: Flaky, spool: Spool, starting: bool) -> Delivery:
    """Delivery to the backend itself, or to a `StartingBackend` that builds it on its own thread once delivery
    holds it, as in the exporter process."""
    if not starting:
        return Delivery({"mem": exporter}, spool)
    held = StartingBackend("mem", lambda options: exporter, ExporterOptions(), spooled=True)
    delivery = Delivery({"mem": held}, spool)
    held.start()
    return delivery


@pytest.mark.parametrize("starting", [False, True], ids=["built", "starting"])
def test_a_backend_that_never_recovers_keeps_its_windows_in_the_spool_for_replay(tmp_path: Path,
                                                                                 starting: bool) -> None:
    down = Flaky(fail_times=10**9)
    delivery = _delivery(down, Spool(tmp_path), starting)
    _submit_all(delivery)
    time.sleep(0.5)  # many tries past `max_attempts`
    assert not delivery.close(time.monotonic() + 5)
    assert down.dropped_windows == 0 and not delivery.rows_lost()
    spool = Spool(tmp_path)
    assert spool.cursor("mem") == 0 and [seq for seq, _, _ in spool.read(0)] == list(range(1, WINDOWS + 1))

    up = Flaky()  # the backend is back: a later delivery (replay) gets every window once
    again = Delivery({"mem": up}, spool)
    assert again.close(time.monotonic() + 10)
    assert _steps(up) == list(range(1, WINDOWS + 1))


def _wait_unlocked(rank_dir: Path, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        fd = try_lock(rank_dir)
        if fd is not None:
            os.close(fd)
            return
        time.sleep(0.05)
    raise AssertionError(f"{rank_dir} still locked after {within_s} s")


@pytest.mark.timeout(300)
def test_jsonl_failing_through_the_run_is_completed_by_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_DRAIN_TIMEOUT_S", "12")  # long enough for more tries than `max_attempts`
    run, steps = "down", 30
    blocked = jsonl_path(tmp_path, run, 0)
    blocked.mkdir(parents=True)  # a directory where JSONL's file goes: every write fails (IsADirectoryError)
    ot.init(exporters=["jsonl", "tensorboard"], dir=tmp_path, run_id=run, run_name=run, export_interval_s=0.05,
            shutdown_timeout_s=1.0)
    for s in ot.steps(range(steps)):
        ot.log({tag: value(tag, s) for tag in SERIES})
        time.sleep(0.01)
    ot.shutdown()
    rank_dir = tmp_path / run / "spool" / "rank0"
    _wait_unlocked(rank_dir, 60)  # the exporter process retried until its drain deadline, then exited

    capsys.readouterr()
    assert cli_main(["replay", str(tmp_path / run), "--stall", "3"]) == 1  # JSONL still cannot be written
    out = capsys.readouterr().out
    assert "`jsonl`" in out and str(rank_dir) in out, out

    blocked.rmdir()  # the fault ends
    assert cli_main(["replay", str(tmp_path / run)]) == 0
    points = [(p.name, p.step, p.value) for p in readback.jsonl(blocked) if p.name in SERIES]
    assert Counter(points).most_common(1)[0][1] == 1
    assert sorted(points) == sorted((tag, s, value(tag, s)) for s in range(steps) for tag in SERIES)
    assert cli_main(["replay", str(tmp_path / run)]) == 0  # the second replay adds nothing
    assert len([p for p in readback.jsonl(blocked) if p.name in SERIES]) == len(points)


@pytest.mark.timeout(300)
def test_replay_with_a_record_hands_a_backend_only_what_verify_finds_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.backend import Window
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.exporters.jsonl import JsonlExporter
    from otel_train.vocab.rows import MetricRow

    monkeypatch.setenv("OTEL_TRAIN_DRAIN_TIMEOUT_S", "2")
    monkeypatch.setenv("OTEL_TRAIN_VERIFY", "record")
    # The exporter process's own series are recorded but not spooled (added as each window is handed out): no
    # replay can bring them back, so they are left out here.
    monkeypatch.setenv("OTEL_TRAIN_SELF_METRICS", "0")
    run, steps, half = "verified", 30, 15
    blocked = jsonl_path(tmp_path, run, 0)
    blocked.mkdir(parents=True)  # JSONL fails through the run: the spool keeps every window for it
    ot.init(exporters=["jsonl", "tensorboard"], dir=tmp_path, run_id=run, run_name=run,
                      export_interval_s=0.05, shutdown_timeout_s=1.0)
    for s in ot.steps(range(steps)):
        ot.log({tag: value(tag, s) for tag in SERIES})
        time.sleep(0.01)
    ot.shutdown()
    _wait_unlocked(tmp_path / run / "spool" / "rank0", 60)
    blocked.rmdir()
    # JSONL holds the first half already although its cursor says nothing (as after a kill between its write and
    # the record of it): written by the real JSONL backend, as the run's rows.
    run_info = RunInfo(run, run)
    with JsonlExporter(ExporterOptions(directory=tmp_path)) as jsonl:
        jsonl.export_window(Window([MetricRow(run_info, s, tag, tag, value(tag, s), "gauge", 1, {})
                                    for s in range(half) for tag in SERIES]))
    assert cli_main(["replay", str(tmp_path / run)]) == 0
    points = [(p.name, p.step, p.value) for p in readback.jsonl(blocked) if p.name in SERIES]
    assert max(Counter(points).values()) == 1, [p for p, n in Counter(points).items() if n > 1][:5]
    assert sorted(points) == sorted((tag, s, value(tag, s)) for s in range(steps) for tag in SERIES)
    assert cli_main(["verify", str(tmp_path / run)]) == 0
