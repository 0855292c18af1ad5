"""Real Lightning `fit` (CPU, tiny model) under a SLURM-like environment, for SIGUSR1 (SLURM's warning) mid-fit.

Run as ``python lightning_slurm_driver.py ROOT ORDER`` with the SLURM variables and a stub `scontrol` on PATH
set by the test. ORDER: ``before`` (the user calls `ot.init` before `fit`) or ``own`` (the integration's own
init, from `OTEL_TRAIN_*` variables). Prints each finished training step on stdout (``step N``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import otel_train as ot
from otel_train.integrations.lightning import OtelTrainCallback, OtelTrainLogger


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
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Report(pl.Callback):
    """Tells the test each step that finished (its metrics were handed to the loggers)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        print(f"step {trainer.global_step - 1}", flush=True)
        time.sleep(0.02)


def main() -> None:
    root, order = Path(sys.argv[1]), sys.argv[2]
    if order == "before":
        ot.init(exporters=["jsonl"], dir=root / "runs", run_name="slurm", shutdown_timeout_s=30.0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    trainer = pl.Trainer(max_epochs=1000, accelerator="cpu", devices=1, logger=OtelTrainLogger(),
                         callbacks=[OtelTrainCallback(), Report()], log_every_n_steps=1, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root / "pl"))
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    print("fit returned", flush=True)


if __name__ == "__main__":
    main()
