"""PyTorch Lightning: a real `Trainer.fit` on the CPU; values read back with TensorBoard's reader,
compared with what Lightning's own CSVLogger received; spans read back from the Chrome trace."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the Lightning integration test needs `pip install 'otel-train[lightning]'`")

import lightning.pytorch as pl
import torch
from backendkit import approx_points
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

import otel_train as ot
from otel_train.integrations.lightning import OtelTrainCallback, OtelTrainLogger
from otel_train.trace_merge import load_trace
from otel_train.vocab.semconv import TRAIN_STEP_DURATION, display_name

BATCHES_PER_EPOCH = 8
EPOCHS = 2


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * BATCHES_PER_EPOCH, 4, generator=g), torch.randn(4 * BATCHES_PER_EPOCH, 1, generator=g))
    return DataLoader(data, batch_size=4)


def _trainer(tmp_path: Path, loggers: list[Any], callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=loggers, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        limit_val_batches=2, num_sanity_val_steps=1, **kwargs,
    )


def _scalars(path: Path, tag: str) -> list[tuple[int, float]]:
    """Every point of `tag` as (step, value), in file order: a step written twice shows twice."""
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _steps(points: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in points]


def _hparams(path: Path) -> Any:
    """The run config TensorBoard's HParams plugin holds for the run in `path`."""
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(str(path))
    acc.Reload()
    return metadata.parse_session_start_info_plugin_data(
        acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]).hparams


def _csv_series(csv_logger: CSVLogger, key: str) -> list[tuple[int, float]]:
    """Every (step, value) Lightning handed its CSVLogger for `key`, in the order it wrote them."""
    with open(Path(csv_logger.log_dir) / "metrics.csv") as f:
        return [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]


def _spans(run: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for event in load_trace(run / "trace" / "rank0.trace.json"):
        if event.get("ph") == "X":
            out.setdefault(event["name"], []).append(event)
    return out


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", "lit")
    monkeypatch.setenv("OTEL_TRAIN_EXPORTERS", "tensorboard,chrome_trace")
    return tmp_path / "runs" / "lit"


def test_fit_values_at_lightning_steps_and_spans(tmp_path: Path, env: Path) -> None:
    csv_logger = CSVLogger(str(tmp_path / "csv"))
    trainer = _trainer(tmp_path, [OtelTrainLogger(), csv_logger], [OtelTrainCallback(), ModelCheckpoint()],
                       log_every_n_steps=3)
    trainer.fit(Tiny(), _loader(), _loader())
    session = ot._session
    assert session is not None and not session.closed  # a stage's end flushes; the run stays open for test()
    ot.shutdown()

    # What Lightning handed its loggers (log_every_n_steps=3: steps 2, 5, 8, ...) is what TensorBoard holds.
    expected = _csv_series(csv_logger, "train/loss")
    assert _steps(expected) == [s for s in range(BATCHES_PER_EPOCH * EPOCHS) if (s + 1) % 3 == 0]
    assert _scalars(env, "train/loss") == approx_points(expected)
    assert _scalars(env, "val/loss") == approx_points(_csv_series(csv_logger, "val/loss"))
    assert _scalars(env, "epoch") == approx_points(_csv_series(csv_logger, "epoch"))

    # save_hyperparameters() -> the run config, in TensorBoard's HParams plugin.
    hparams = _hparams(env)
    assert hparams["lr"].number_value == pytest.approx(0.05)
    assert hparams["width"].number_value == 4

    # Batches ran inside otel_train.step(global_step): a step duration at every step.
    assert _steps(_scalars(env, display_name(TRAIN_STEP_DURATION))) == list(range(BATCHES_PER_EPOCH * EPOCHS))

    spans = _spans(env)
    assert [e["args"]["train.step"] for e in spans["train/batch"]] == list(range(BATCHES_PER_EPOCH * EPOCHS))
    assert [e["args"]["epoch"] for e in spans["train/epoch"]] == [0, 1]
    assert len(spans["val/batch"]) == 1 + 2 * EPOCHS  # one sanity-check batch, then 2 per epoch
    assert [e["args"]["train.step"] for e in spans["val/epoch"]] == [0, 8, 16]
    saves = spans["checkpoint/save"]
    assert [e["args"]["train.step"] for e in saves] == [8, 16]
    assert all(Path(e["args"]["path"]).parent == env / "checkpoints" for e in saves)
    assert Path(saves[-1]["args"]["path"]).exists()  # the kept one (save_top_k=1 removes the older)


def test_user_session_gets_the_hyperparameters_and_is_left_running(tmp_path: Path, env: Path) -> None:
    session = ot.init(run_name="mine", exporters="tensorboard")
    trainer = _trainer(tmp_path, [OtelTrainLogger()], [], log_every_n_steps=1, max_steps=3,
                       enable_checkpointing=False)
    trainer.fit(Tiny(lr=0.2), _loader())
    assert ot._session is session and not session.closed
    ot.shutdown()
    run = tmp_path / "runs" / "mine"
    assert _steps(_scalars(run, "train/loss")) == [0, 1, 2]
    assert _hparams(run)["lr"].number_value == pytest.approx(0.2)


@pytest.mark.parametrize(("ranks", "exported"), [("0", False), ("all", True)])
def test_lightning_rank_feeds_the_resource_and_otel_train_ranks_decides(
    env: Path, monkeypatch: pytest.MonkeyPatch, ranks: str, exported: bool
) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    monkeypatch.setenv("OTEL_TRAIN_RANKS", ranks)
    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)  # what a DDP strategy sets on rank 1
    logger = OtelTrainLogger()
    logger.log_metrics({"train/loss": torch.tensor(0.25), "note": "text is skipped"}, step=3)
    session = ot._session
    assert session.run.rank == 1
    assert session.export_metrics is exported
    ot.shutdown()
    if exported:
        assert _scalars(env, "train/loss") == [(3, 0.25)]  # the tensor, converted on the export thread
    else:
        assert not list(env.glob("events.*"))


class Failing(Tiny):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("boom at batch 2")
        return super().training_step(batch, batch_idx)


def test_an_exception_marks_the_open_spans_and_training_code_sees_it_unchanged(tmp_path: Path, env: Path) -> None:
    trainer = _trainer(tmp_path, [OtelTrainLogger()], [OtelTrainCallback()], log_every_n_steps=1,
                       enable_checkpointing=False)
    with pytest.raises(RuntimeError, match="boom at batch 2"):
        trainer.fit(Failing(), _loader())
    ot.shutdown()
    spans = _spans(env)
    batches = spans["train/batch"]
    assert [e["args"]["train.step"] for e in batches] == [0, 1, 2]
    assert "boom at batch 2" in batches[-1]["args"]["error"]
    assert "boom at batch 2" in spans["train/epoch"][0]["args"]["error"]
    assert _steps(_scalars(env, "train/loss")) == [0, 1]
