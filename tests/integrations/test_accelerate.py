"""Hugging Face Accelerate: a real `Accelerator` loop on the CPU logging through `OtelTrainTracker`;
values read back with TensorBoard's reader at the steps given to `accelerator.log`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate", reason="the Accelerate integration test needs `pip install 'otel-train[accelerate]'`")

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from backendkit import approx_points
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata

import otel_train as ot
from otel_train.integrations.accelerate import OtelTrainTracker


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_EXPORTERS", "tensorboard")
    return tmp_path / "runs"


def _accumulator(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _hparams(acc: EventAccumulator) -> Any:
    return metadata.parse_session_start_info_plugin_data(
        acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]).hparams


def _points(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    """Every point of `tag` as (step, value), in file order: a step written twice shows twice."""
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _train(accelerator: Accelerator, steps: int) -> list[tuple[int, float]]:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4 * steps, 4, generator=g), torch.randn(4 * steps, 1, generator=g))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=4))
    expected: list[tuple[int, float]] = []
    for i, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"train/loss": loss.detach(), "train/lr": 0.1, "phase": "warmup"}, step=i)
        expected.append((i, loss.item()))  # the test's own read, after logging
    return expected


def test_accelerator_log_and_config_reach_tensorboard(runs: Path) -> None:
    accelerator = Accelerator(cpu=True, log_with=OtelTrainTracker(run_name="acc"))
    accelerator.init_trackers("proj", config={"lr": 0.1, "optimizer": "sgd"})
    tracker = accelerator.get_tracker("otel_train", unwrap=False)
    assert isinstance(tracker, OtelTrainTracker)
    session = tracker.tracker
    expected = _train(accelerator, steps=5)
    accelerator.end_training()
    assert session.closed  # the tracker started otel-train, so end_training() shut it down

    acc = _accumulator(runs / "acc")
    assert _points(acc, "train/loss") == approx_points(expected)
    assert _points(acc, "train/lr") == approx_points([(i, 0.1) for i in range(5)])
    assert "phase" not in acc.Tags()["scalars"]  # a string: skipped, not an error
    hparams = _hparams(acc)
    assert hparams["lr"].number_value == pytest.approx(0.1)
    assert hparams["optimizer"].string_value == "sgd"


def test_a_user_session_gets_the_config_and_outlives_end_training(runs: Path) -> None:
    session = ot.init(run_name="mine")
    accelerator = Accelerator(cpu=True, log_with=OtelTrainTracker())
    accelerator.init_trackers("proj", config={"seed": 7})
    _train(accelerator, steps=2)
    accelerator.end_training()
    assert ot._session is session and not session.closed
    ot.shutdown()
    acc = _accumulator(runs / "mine")
    assert [step for step, _ in _points(acc, "train/loss")] == [0, 1]
    assert _hparams(acc)["seed"].number_value == 7


@pytest.mark.parametrize("main_process_only", [True, False])
def test_main_process_only_on_a_non_main_process(
    runs: Path, monkeypatch: pytest.MonkeyPatch, main_process_only: bool
) -> None:
    state = PartialState()
    monkeypatch.setitem(state._shared_state, "process_index", 1)  # as process 1 of a job sees itself
    monkeypatch.setattr(PartialState, "use_distributed", property(lambda self: True))  # a 2-process job
    tracker = OtelTrainTracker(run_name="r1", main_process_only=main_process_only)
    tracker.start()
    tracker.log({"train/loss": torch.tensor(0.5)}, step=0)
    if main_process_only:
        assert ot._session is None  # nothing ran on this process
    else:
        assert ot._session.run.rank == 1  # Accelerate's process index is the rank
        assert ot._session.export_metrics is False  # OTEL_TRAIN_RANKS=0 (default): rank 1 does not export
    tracker.finish()


def test_dicts_named_as_accelerates_tensorboard_tracker_nan_kept_strings_counted(
        runs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Beside Accelerate's own TensorBoard tracker in one run: a dict value (its `add_scalars`: run
    `<key>_<entry>`, tag `<key>`) is `<key>/<entry>` here, at the same steps with the same values; NaN and inf
    stay; a string is left out, counted and warned about once."""
    accelerator = Accelerator(cpu=True, log_with=["tensorboard", OtelTrainTracker(run_name="both")],
                              project_dir=str(tmp_path / "acc"))
    accelerator.init_trackers("proj")
    tracker = accelerator.get_tracker("otel_train", unwrap=False)
    losses = [1.0, float("nan"), float("inf")]
    with caplog.at_level("WARNING", logger="otel_train.integrations"):
        for i, loss in enumerate(losses):
            accelerator.log({"loss": {"train": loss, "val": 2.0 * i}, "lr": 0.1, "phase": "warmup"}, step=i)
    assert tracker.tracker.settings.project == "proj"  # init_trackers' project name
    accelerator.end_training()
    ours = _accumulator(runs / "both")
    for entry in ("train", "val"):
        theirs = _accumulator(tmp_path / "acc" / "proj" / f"loss_{entry}").Scalars("loss")
        mine = ours.Scalars(f"loss/{entry}")
        assert [(e.step, repr(e.value)) for e in mine] == [(e.step, repr(e.value)) for e in theirs]
    assert [(e.step, repr(e.value)) for e in ours.Scalars("loss/train")] == [(0, "1.0"), (1, "nan"), (2, "inf")]
    assert "phase" not in ours.Tags()["scalars"]
    assert tracker.left_out == 3
    assert len([r for r in caplog.records if "'phase'" in r.getMessage()]) == 1
