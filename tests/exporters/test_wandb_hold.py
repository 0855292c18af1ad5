"""WandbExporter keeps what it is given: rows that arrive out of step order (a DataLoader worker logging with
`step=` ahead of the loop) are held and written at their step; W&B's reserved keys are renamed, never dropped;
what W&B cannot keep (a step below one it holds, a second value of a series at one step) is counted in rows.
A real offline W&B run, its `.wandb` file read back as a list of points."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import readback
from backendkit import isolated_wandb_env, row, wandb_files
from reference import Point

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("hold-run", "hold")
HOLD_S = 0.5


def _worker_ahead_then_loop(exporter: Any) -> None:
    """The issue's order: a worker's rows for steps 0-3 reach the backend before the loop's rows of those steps."""
    assert exporter.export_window(Window(metrics=[row(RUN, s, f"data/item{{worker={s % 2}}}", float(s), worker=s % 2)
                                                  for s in range(4)]))
    assert exporter.export_window(Window(metrics=[row(RUN, s, name, v) for s in range(4)
                                                  for name, v in (("train/loss", 1.0 / (s + 1)), ("lr", 0.5))]))


def _run(root: Path, hold_s: float) -> tuple[list[Point], int]:
    from otel_train.exporters.wandb import WandbExporter

    exporter = WandbExporter(ExporterOptions(directory=root, project="otel-wandb-hold"))
    exporter.hold_s = hold_s
    _worker_ahead_then_loop(exporter)
    if hold_s:
        time.sleep(hold_s)  # held long enough: `flush` writes it (as delivery's flush every second does)
        assert exporter.durable_step() == -1  # until then the spool's cursor may not pass step 0
        assert exporter.force_flush()
    # W&B's reserved keys, a user key that looks like a renamed one, and one series given twice at one step.
    assert exporter.export_window(Window(metrics=[
        row(RUN, 4, "_step", 41.0), row(RUN, 4, "_runtime", 42.0), row(RUN, 4, "_timestamp", 43.0),
        row(RUN, 4, "__step", 44.0), row(RUN, 4, "_wandb_x", 45.0), row(RUN, 4, "_x", 46.0),
        row(RUN, 4, "train/loss", 0.25), row(RUN, 4, "train/loss", 0.125),
    ]))
    exporter.shutdown()
    import wandb

    wandb.teardown()  # the service process writes the last records of the run file
    (path,) = wandb_files(root, "hold", "hold-run")
    return readback.wandb(path), exporter.steps_dropped


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Point], int]]:
    root = tmp_path_factory.mktemp("wandb-hold")
    with pytest.MonkeyPatch.context() as mp:
        isolated_wandb_env(mp, root / "home")
        yield _run(root / "runs", HOLD_S)


def test_rows_a_worker_sent_ahead_are_written_at_their_step_with_the_loops(held: tuple[list[Point], int]) -> None:
    points, _ = held
    early = sorted(p for p in points if p.step is not None and p.step < 4)
    assert early == sorted([Point(f"data/item{{worker={s % 2}}}", s, float(s)) for s in range(4)]
                           + [Point("train/loss", s, 1.0 / (s + 1)) for s in range(4)]
                           + [Point("lr", s, 0.5) for s in range(4)])


def test_reserved_keys_are_renamed_and_a_replaced_value_is_counted(held: tuple[list[Point], int]) -> None:
    points, dropped = held
    assert sorted(p for p in points if p.step == 4) == sorted([
        Point("__step", 4, 41.0), Point("__runtime", 4, 42.0), Point("__timestamp", 4, 43.0),
        Point("___step", 4, 44.0), Point("__wandb_x", 4, 45.0), Point("_x", 4, 46.0),
        Point("train/loss", 4, 0.125),  # W&B keeps one value per series and step: the last ...
    ])
    assert dropped == 1  # ... and the one it replaced is counted


def test_without_the_hold_the_rows_below_the_workers_step_are_counted_in_rows(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    isolated_wandb_env(monkeypatch, tmp_path / "home")
    points, dropped = _run(tmp_path / "runs", 0.0)
    early = [p for p in points if p.step is not None and p.step < 4 and not p.name.startswith("data/")]
    assert sorted(early) == [Point("lr", 3, 0.5), Point("train/loss", 3, 0.25)]  # steps 0-2: W&B was at step 3
    assert dropped == 6 + 1  # rows (2 series x 3 steps), not steps; and the replaced value
