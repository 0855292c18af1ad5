"""PyTorch Lightning, resumed: a real `Trainer.fit` on the CPU checkpoints every 4 steps and runs to step 8 in
one process; a new process resumes with ``fit(ckpt_path=<the checkpoint at step 4>)`` (other data, so other
values) and runs to step 6. TensorBoard (its own reader, purge honoured) and JSONL (`resolve_resumes`) then
show what Lightning handed its loggers in each attempt: the first attempt's steps 0..3, the second
attempt's 4 and 5 (Lightning logs a batch at the `global_step` it starts with), nothing of the first
attempt's 4..7."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the Lightning integration test needs `pip install 'otel-train[lightning]'`")

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

RUN = "lit-resume"
TAGS = ("train/loss", "epoch")


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=4)


def _fit(tmp_path: Path, name: str, max_steps: int, seed: int, ckpt_path: Path | None = None) -> CSVLogger:
    from otel_train.integrations.lightning import OtelTrainCallback, OtelTrainLogger

    csv_logger = CSVLogger(str(tmp_path / f"csv-{name}"), version=0)
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=[OtelTrainLogger(), csv_logger],
        callbacks=[OtelTrainCallback(), ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4,
                                                        save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        log_every_n_steps=1, limit_val_batches=0, num_sanity_val_steps=0,
    )
    trainer.fit(Tiny(), _loader(seed), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return csv_logger


def _csv(csv_logger: CSVLogger) -> dict[str, list[tuple[int, float]]]:
    """tag -> every (step, value) Lightning handed its CSVLogger, in the order written."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(Path(csv_logger.log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for tag in TAGS:
                if row.get(tag):
                    out.setdefault(tag, []).append((int(row["step"]), float(row[tag])))
    return out


def test_fit_from_a_checkpoint_supersedes_the_earlier_attempts_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from backendkit import approx_points  # here: this file is also the first attempt's script
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import otel_train as ot
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl, resolve_resumes

    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", RUN)
    monkeypatch.setenv("OTEL_TRAIN_RUN_ID", RUN)
    monkeypatch.setenv("OTEL_TRAIN_EXPORTERS", "tensorboard,jsonl")
    first = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=300,
                           check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    first_csv = _csv(CSVLogger(str(tmp_path / "csv-first"), version=0))
    assert [s for s, _ in first_csv["train/loss"]] == list(range(8))

    (ckpt,) = (tmp_path / "ckpt").glob("*step=4.ckpt")
    second_csv = _csv(_fit(tmp_path, "second", max_steps=6, seed=1, ckpt_path=ckpt))
    ot.shutdown()
    assert [s for s, _ in second_csv["train/loss"]] == [4, 5]
    want = {tag: [(s, v) for s, v in first_csv[tag] if s < 4] + second_csv[tag] for tag in TAGS}

    run = tmp_path / "runs" / RUN
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in TAGS:
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == approx_points(want[tag]), tag
    # The callback's own per-step series: steps 0..5 once each (the first attempt's 6 and 7 purged).
    assert [e.step for e in acc.Scalars("train/step_duration_s")] == list(range(6))

    records = resolve_resumes(read_jsonl(jsonl_path(tmp_path / "runs", RUN, 0)))
    for tag in TAGS:
        points = [(r["step"], r["value"]) for r in records if r["type"] == "metric" and r["tag"] == tag]
        assert points == approx_points(want[tag]), tag


if __name__ == "__main__":  # the first attempt, in a process of its own
    import otel_train as ot

    _fit(Path(sys.argv[1]), "first", max_steps=8, seed=0)
    ot.shutdown()
