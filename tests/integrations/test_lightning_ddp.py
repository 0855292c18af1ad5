"""Lightning's own DDP launcher on 2 CPU processes, with the user's `ot.init()` at the top of the script: Lightning
re-runs the script for rank 1 without `RANK`, so both processes start as "rank 0" of a run of their own; the
integration adopts Lightning's rank before anything is exported, and the job is one run with rank 0 and rank 1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the Lightning integration test needs `pip install 'otel-train[lightning]'`")

from otel_train.exporters.jsonl import jsonl_path, read_jsonl

_SCRIPT = textwrap.dedent("""
    import torch
    from lightning import LightningModule, Trainer

    import otel_train as ot
    from otel_train.integrations.lightning import OtelTrainCallback, OtelTrainLogger

    ot.init()  # at the top, before Lightning starts rank 1 (which re-runs this file)


    class Tiny(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("train/rank", float(self.global_rank))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.ones(8, 2))
            return torch.utils.data.DataLoader(data, batch_size=2)


    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=2, log_every_n_steps=1,
                      logger=OtelTrainLogger(), callbacks=[OtelTrainCallback()], enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Tiny())
    run = ot._session.run
    print("RUN", trainer.global_rank, run.rank, run.world_size, run.run_id, flush=True)
""")


@pytest.mark.skipif(os.environ.get("CI") == "true", reason=(
    "unstable: in 1 of 2 full-suite runs the job exited 0 without printing its RUN lines (3 of 3 alone passed); "
    "kept out of CI until the cause is found (issue 22 note); run it with `pytest tests/integrations/test_lightning_ddp.py`"))
def test_user_init_first_then_lightning_ddp_is_one_run_with_both_ranks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k not in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    env.update({"OTEL_TRAIN_DIR": str(tmp_path / "runs"), "OTEL_TRAIN_EXPORTERS": "jsonl", "OTEL_TRAIN_RANKS": "all"})
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RUN "))
    assert [r[:3] for r in runs] == [["0", "0", "2"], ["1", "1", "2"]]  # Lightning's rank is the session's
    (run_id,) = {r[3] for r in runs}  # one run for the job
    for rank in (0, 1):
        points = [(r["step"], r["value"]) for r in read_jsonl(jsonl_path(tmp_path / "runs", run_id, rank))
                  if r["type"] == "metric" and r["tag"] == "train/rank"]
        assert points == [(0, float(rank)), (1, float(rank))]  # each rank's own values, in its own file
