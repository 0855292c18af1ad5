"""Lightning's real SLURM requeue handler with otel-train: SIGUSR1 (SLURM's warning) mid-fit.

A real `Trainer.fit` (CPU, tiny model) under a SLURM-like environment, so Lightning's `SLURMEnvironment` with
auto-requeue installs its SIGUSR1 handler; a stub `scontrol` on PATH records the requeue and then, as SLURM
does when it requeues a running job, sends SIGTERM to the job. Both orders: `ot.init` before `fit`, and the
integration's own init. Lightning's handler must run (requeue recorded, its HPC checkpoint written), every
step logged before the signal must land, the run is marked preempted, and the process exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import pytest

pytest.importorskip("lightning", reason="needs `pip install 'otel-train[lightning]'`")

import torch
from selected import selected

from otel_train.exporters.jsonl import jsonl_path, read_jsonl

DRIVER = Path(__file__).with_name("lightning_slurm_driver.py")
JOB_ID = "4242"
SIGNAL_AFTER_STEP = 5
DEADLINE_S = 120  # a bound on the whole exit, far above the 30 s shutdown timeout: not a timing measurement

SCONTROL = textwrap.dedent("""\
    #!/bin/sh
    # SLURM's scontrol, for the test: record the call; a requeue of a running job ends it with SIGTERM.
    echo "$@" >> "$SCONTROL_LOG"
    kill -TERM "$PPID"
""")


def slurm_env(root: Path, order: str) -> dict[str, str]:
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    stub = bin_dir / "scontrol"
    stub.write_text(SCONTROL)
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_TRAIN_", "SLURM_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", SCONTROL_LOG=str(root / "scontrol.log"),
               SLURM_JOB_ID=JOB_ID, SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_JOB_NAME="train",
               SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODELIST="localhost")
    if order == "own":  # the integration's own init reads the environment
        env.update(OTEL_TRAIN_EXPORTERS="jsonl", OTEL_TRAIN_DIR=str(root / "runs"), OTEL_TRAIN_RUN_NAME="slurm",
                   OTEL_TRAIN_SHUTDOWN_TIMEOUT_S="30")
    return env


ORDERS = ("before", "own")


class Fitted(NamedTuple):
    root: Path
    code: int
    stderr: str
    reported: list[int]  # the steps the script reported finished


def fit_and_signal(root: Path, order: str, env: dict[str, str]) -> Fitted:
    """Run the driver, send SIGUSR1 once it reports step `SIGNAL_AFTER_STEP`, wait for its exit."""
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(root), order], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    reported: list[int] = []
    for line in proc.stdout:
        if line.startswith("step "):
            reported.append(int(line.split()[1]))
            if reported[-1] == SIGNAL_AFTER_STEP:
                proc.send_signal(signal.SIGUSR1)
    code = proc.wait(timeout=DEADLINE_S)
    return Fitted(root, code, proc.stderr.read(), reported)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> Iterator[dict[str, Future[Fitted]]]:
    """Both orders, started together: a run is mostly one process importing Lightning, which leaves the second
    core of a 2-core machine idle. Each test waits for its own run."""
    roots = {order: tmp_path_factory.mktemp(order) for order in selected(request, "order", ORDERS)}
    with ThreadPoolExecutor(max_workers=len(ORDERS)) as pool:
        yield {order: pool.submit(fit_and_signal, root, order, slurm_env(root, order))
               for order, root in roots.items()}


@pytest.mark.parametrize("order", ORDERS)
def test_sigusr1_mid_fit_runs_lightnings_requeue_and_lands_every_step(fitted: dict[str, Future[Fitted]],
                                                                       order: str) -> None:
    tmp_path, code, stderr, reported = fitted[order].result()
    # Lightning's handler ran: it requeued the job and saved its HPC checkpoint.
    assert (tmp_path / "scontrol.log").read_text().splitlines() == [f"requeue {JOB_ID}"], stderr[-3000:]
    assert [p.name for p in (tmp_path / "pl").glob("hpc_ckpt_*.ckpt")] == ["hpc_ckpt_1.ckpt"]
    # The SIGTERM that followed stopped `fit` (Lightning's SIGTERMException, a clean SystemExit), not us.
    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    records = list(read_jsonl(jsonl_path(tmp_path / "runs", "slurm", 0)))
    steps = sorted({r["step"] for r in records if r["type"] == "metric" and r["tag"] == "train/loss"})
    assert steps == list(range(len(steps))), steps  # no hole
    assert set(range(SIGNAL_AFTER_STEP + 1)) <= set(steps)  # every step logged before the signal landed
    assert steps[-1] >= reported[-1]  # ... and every step reported at all
    assert [r["signal"] for r in records if r["type"] == "preempted"] == ["SIGUSR1"]


def test_handlers_during_and_after_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """During `fit` the requeue signal runs otel-train's flush, then Lightning's requeue handler; after `fit`
    (Lightning restores what it found) otel-train's own handler is back, so a later SIGUSR1 still flushes."""
    from otel_train.session import exit_hooks

    for key, value in slurm_env(tmp_path, "before").items():
        if key.startswith("SLURM_"):
            monkeypatch.setenv(key, value)
    # SIGUSR1 as a job's process starts with it (the default): Lightning installs its requeue handler only over
    # that, and a test that ran earlier in this process may have left another one.
    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    stale = exit_hooks._previous_handlers.pop(signal.SIGUSR1, None)
    try:
        _handlers_during_and_after_fit(tmp_path)
    finally:
        signal.signal(signal.SIGUSR1, before)
        if stale is not None:
            exit_hooks._previous_handlers[signal.SIGUSR1] = stale


def _handlers_during_and_after_fit(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning_slurm_driver import Tiny
    from torch.utils.data import DataLoader, TensorDataset

    import otel_train as ot
    from otel_train.integrations.lightning import OtelTrainCallback, OtelTrainLogger

    ot.init(exporters=["jsonl"], dir=tmp_path / "runs", run_name="slurm")
    ours = signal.getsignal(signal.SIGUSR1)
    seen: list[object] = []

    class Look(pl.Callback):
        def on_train_batch_end(self, *args: object) -> None:
            seen.append(signal.getsignal(signal.SIGUSR1))

    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=OtelTrainLogger(),
                         callbacks=[OtelTrainCallback(), Look()], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path / "pl"))
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    assert len(seen) == 2 and seen[0] is seen[1]
    chained: Any = seen[0]
    assert type(chained).__name__ == "_FlushThenRequeue" and chained.ours is ours
    assert type(chained.theirs).__name__ == "_HandlersCompose"  # Lightning's requeue handler
    assert [h.__name__ for h in chained.theirs.signal_handlers] == ["_slurm_sigusr_handler_fn"]
    assert signal.getsignal(signal.SIGUSR1) is ours
