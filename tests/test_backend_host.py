"""Backends with a heavy client each in a process of their own (`otel_train.ship.backend_host`).

Two or more of W&B, MLflow, ClearML and Trackio configured: each runs in a fresh interpreter beside the exporter
process, so their imports and starts run side by side. Every step still lands once in each; a backend process
killed mid-run is started again and handed what its store did not hold, and one killed more often than it is
started again leaves the rest in the spool, said, for `otel-train replay`; a backend that cannot start there is
said and counted as in the exporter process. Real Trackio beside W&B's stand-in
(tests/helpers/fake_wandb.py, which records the pid of each process that imports it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import readback
from fake_wandb import fake_wandb_env, use_fake_wandb

import otel_train as ot
from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.ship.spool import Spool, spool_dir

STEPS = 20


def _fake_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> Path:
    """The stand-in `wandb` first on `sys.path` (this process's, hence the exporter and backend processes');
    returns where it records."""
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", "on")
    return use_fake_wandb(tmp_path, monkeypatch, mode)


def _train(steps: range) -> None:
    for step in steps:
        with ot.step(step):
            ot.log({"train/loss": float(step)})


def _wandb_steps(out: Path) -> list[int]:
    logged = out / "logged.jsonl"
    lines = logged.read_text().splitlines() if logged.exists() else []
    return [rec["step"] for rec in map(json.loads, lines) if "train/loss" in rec]


def _trackio_steps(tmp_path: Path, run: str) -> list[int]:
    return [p.step for p in readback.trackio(tmp_path / "trackio", "otel-train", run) if p.name == "train/loss"]


def _jsonl_steps(directory: Path, run: str) -> list[int]:
    return [r["step"] for r in read_jsonl(jsonl_path(directory, run, 0))
            if r["type"] == "metric" and r["tag"] == "train/loss"]


def _pids(out: Path) -> list[int]:
    return [int(line) for line in (out / "pids").read_text().split()]


@pytest.mark.timeout(300)
def test_two_heavy_backends_run_in_processes_of_their_own_and_each_holds_every_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _fake_wandb(tmp_path, monkeypatch, "record")
    directory = tmp_path / "runs"
    session = ot.init(exporters=["jsonl", "wandb", "trackio"], dir=directory, run_name="hosted",
                      shutdown_timeout_s=120)
    _train(range(STEPS))
    exporter_pid = session.export_process.pid
    ot.shutdown()
    (host,) = _pids(out)  # imported once, in neither the training nor the exporter process
    assert host not in (os.getpid(), exporter_pid)
    assert _wandb_steps(out) == list(range(STEPS))  # every step, once, in order
    assert sorted(_trackio_steps(tmp_path, "hosted")) == list(range(STEPS))
    assert _jsonl_steps(directory, "hosted") == list(range(STEPS))
    assert session.export_process.last_progress.behind() == {}


@pytest.mark.timeout(300)
def test_with_backend_processes_off_they_run_in_the_exporter_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _fake_wandb(tmp_path, monkeypatch, "record")
    monkeypatch.setenv("OTEL_TRAIN_BACKEND_PROCESSES", "off")
    session = ot.init(exporters=["wandb", "trackio"], dir=tmp_path / "runs", run_name="inside",
                      shutdown_timeout_s=120)
    _train(range(STEPS))
    exporter_pid = session.export_process.pid
    ot.shutdown()
    assert _pids(out) == [exporter_pid]
    assert _wandb_steps(out) == list(range(STEPS))
    assert sorted(_trackio_steps(tmp_path, "inside")) == list(range(STEPS))


def _killed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Any]:
    """W&B's stand-in and Trackio, each in a process of its own, beside JSONL: (where W&B records, runs, session)."""
    out = _fake_wandb(tmp_path, monkeypatch, "record")
    directory = tmp_path / "runs"
    session = ot.init(exporters=["jsonl", "wandb", "trackio"], dir=directory, run_name="killed",
                      shutdown_timeout_s=60)
    return out, directory, session


@pytest.mark.timeout(300)
def test_a_backend_process_killed_mid_run_is_started_again_and_holds_every_step_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Killed while windows flow (no flush before): what the dead process was handed and its store does not hold
    # is handed to the new one again from the spool, and it writes only what its run lacks.
    out, directory, session = _killed_run(tmp_path, monkeypatch)
    steps = 3 * STEPS
    for step in range(steps):
        with ot.step(step):
            ot.log({"train/loss": float(step)})
        if step == STEPS:
            assert ot.flush(120)  # its process is up (a kill during its start is a start that failed)
        if step == STEPS + 5:  # windows handed since that flush are not yet known to be held
            (host,) = _pids(out)
            os.kill(host, signal.SIGKILL)
        time.sleep(0.01)
    ot.shutdown()
    said = [r.getMessage() for r in caplog.records if "ended with exit code" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("otel-train: backend `wandb`: its process"), said
    assert "it is started again at its next call" in said[0]
    again = [r.getMessage() for r in caplog.records if "started again (pid" in r.getMessage()]
    assert len(again) == 1 and "restart 1 of at most 3" in again[0], again
    assert "handed to it again from the spool" in again[0]
    assert len(_pids(out)) == 2
    assert _wandb_steps(out) == list(range(steps))  # every step once, in order: nothing twice, nothing missing
    assert sorted(_trackio_steps(tmp_path, "killed")) == list(range(steps))
    assert session.export_process.last_progress.behind() == {}
    spool = Spool(spool_dir(directory, "killed", 0))
    assert spool.cursor("wandb") == spool.last_seq == spool.cursor("jsonl") == spool.cursor("trackio")
    spool.close()


@pytest.mark.timeout(300)
def test_a_backend_process_killed_more_often_than_it_is_started_again_leaves_the_rest_for_replay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from otel_train.ship.backend_host import MAX_RESTARTS

    out, directory, session = _killed_run(tmp_path, monkeypatch)
    for kill in range(MAX_RESTARTS + 1):
        _train(range(kill * 5, kill * 5 + 5))
        # Every backend holds what came before: a restarted one once it is up again (a flush does not hurry the
        # retry of a backend whose process ended, so it says False until then).
        deadline = time.monotonic() + 120
        while not ot.flush(5) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _wandb_steps(out)[-1:] == [kill * 5 + 4]
        os.kill(_pids(out)[-1], signal.SIGKILL)
    held = 5 * (MAX_RESTARTS + 1)
    _train(range(held, held + 5))  # the loop never notices
    ot.shutdown()
    said = [r.getMessage() for r in caplog.records if "ended with exit code" in r.getMessage()]
    assert len(said) == MAX_RESTARTS + 1, said
    assert "stays in the spool for `otel-train replay`" in said[-1]
    assert len(_pids(out)) == MAX_RESTARTS + 1
    assert _wandb_steps(out) == list(range(held))
    assert sorted(_trackio_steps(tmp_path, "killed")) == list(range(held + 5))  # the others went on
    progress = session.export_process.last_progress
    assert set(progress.behind()) == {"wandb"} and progress.failures["wandb"] >= 1
    spool = Spool(spool_dir(directory, "killed", 0))
    assert spool.cursor("wandb") < spool.last_seq == spool.cursor("jsonl") == spool.cursor("trackio")
    spool.close()

    # Replay hands W&B what it lacks, once; the rest of the run stays as it was.
    env = {**os.environ, **fake_wandb_env(tmp_path, "record")}
    done = subprocess.run([sys.executable, "-m", "otel_train.cli", "replay", str(directory / "killed")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _wandb_steps(out) == list(range(held + 5))
    assert sorted(_trackio_steps(tmp_path, "killed")) == list(range(held + 5))


@pytest.mark.timeout(300)
def test_a_hosted_backend_that_cannot_start_is_said_once_and_its_windows_wait_in_the_spool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _fake_wandb(tmp_path, monkeypatch, "broken")
    directory = tmp_path / "runs"
    session = ot.init(exporters=["jsonl", "wandb", "trackio"], dir=directory, run_name="broken",
                      shutdown_timeout_s=60)
    started = time.monotonic()
    _train(range(STEPS))
    ot.shutdown()
    assert time.monotonic() - started < 60  # not a hang: the shutdown did not run into its timeout
    said = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("otel-train: backend `wandb` could not start: RuntimeError: injected: no wandb here; ")
    assert sorted(_trackio_steps(tmp_path, "broken")) == list(range(STEPS))
    progress = session.export_process.last_progress
    assert progress.behind() == {"wandb": STEPS} and progress.failures["wandb"] >= 1
