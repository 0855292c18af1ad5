"""Lightning's own DDP launcher on 2 CPU processes, with the user's `ot.init()` at the top of the script: rank 0's
`init()` runs before there is a job (a run of its own, world size 1), and Lightning re-runs the script for rank 1
without `RANK`. Rank 1 takes its place from `LOCAL_RANK`; rank 0's session moves to Lightning's place before
anything is exported (with the logger alone too), and the job is one run folder with rank 0 and rank 1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the Lightning integration test needs `pip install 'otel-train[lightning]'`")

from selected import selected

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
                      logger=OtelTrainLogger(), callbacks=CALLBACKS, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Tiny())
    run = ot.current_session().run
    # One file per rank: both ranks share the launcher's stdout, where two prints can interleave mid-line.
    with open(f"placement-{trainer.global_rank}.txt", "w") as f:
        f.write(f"{trainer.global_rank} {run.rank} {run.world_size} {run.run_id}")
""")


CALLBACKS = {"logger_and_callback": "[OtelTrainCallback()]", "logger_only": "[]"}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory,
         request: pytest.FixtureRequest) -> Iterator[dict[str, tuple[Path, subprocess.Popen[bytes]]]]:
    """Both jobs, started together: in each, rank 1 imports Lightning only once rank 0 has launched it, so one
    job alone leaves a core of a 2-core machine idle most of the time. Each test waits for its own job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k not in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    started = {}
    for name in selected(request, "callbacks", CALLBACKS):
        root = tmp_path_factory.mktemp(name)
        script = root / "train.py"
        script.write_text(_SCRIPT.replace("CALLBACKS", CALLBACKS[name]))
        job_env = {**env, "OTEL_TRAIN_DIR": str(root / "runs"), "OTEL_TRAIN_EXPORTERS": "jsonl",
                   "OTEL_TRAIN_RANKS": "all"}
        with (root / "output.log").open("wb") as log:  # a file: the job's output never waits on a pipe
            started[name] = (root, subprocess.Popen([sys.executable, str(script)], env=job_env, cwd=root,
                                                    stdout=log, stderr=subprocess.STDOUT))
    try:
        yield started
    finally:
        for _, proc in started.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(60)


@pytest.mark.parametrize("callbacks", CALLBACKS)
def test_user_init_first_then_lightning_ddp_is_one_run_with_both_ranks(
        jobs: dict[str, tuple[Path, subprocess.Popen[bytes]]], callbacks: str) -> None:
    tmp_path, proc = jobs[callbacks]
    code = proc.wait(timeout=300)
    assert code == 0, (tmp_path / "output.log").read_text()[-3000:]
    runs = sorted(p.read_text().split() for p in tmp_path.glob("placement-*.txt"))
    assert [r[:3] for r in runs] == [["0", "0", "2"], ["1", "1", "2"]]  # Lightning's rank is the session's
    (run_id,) = {r[3] for r in runs}  # one run for the job
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_id]  # rank 0's first run left no folder
    for rank in (0, 1):
        points = [(r["step"], r["value"]) for r in read_jsonl(jsonl_path(tmp_path / "runs", run_id, rank))
                  if r["type"] == "metric" and r["tag"] == "train/rank"]
        assert points == [(0, float(rank)), (1, float(rank))]  # each rank's own values, in its own file
