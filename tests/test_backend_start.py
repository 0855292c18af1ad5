"""Backends start off the training loop: `init()` returns before a slow backend is up, every step still lands
in it; a backend that cannot start is said once and counted, and (in the exporter process) its windows wait
in the spool for `otel-train replay`.

The backend is W&B's stand-in (tests/helpers/fake_wandb.py) whose `import wandb` takes 5 s, or raises: the
exporter process imports it from `sys.path`, the training process too (then `sys.modules` is restored).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_wandb import fake_wandb_env, use_fake_wandb

import otel_train as ot
from otel_train.errors import ConfigError
from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.ship.spool import Spool, spool_dir

PLACEMENTS = {"exporter_process": "on", "in_process": "off"}
STEPS = 20


def _logged_steps(out: Path) -> list[int]:
    """Steps the stand-in's run was handed `train/loss` at, in order, each time it was."""
    logged = out / "logged.jsonl"
    lines = logged.read_text().splitlines() if logged.exists() else []
    return [rec["step"] for rec in map(json.loads, lines) if "train/loss" in rec]


def _jsonl_steps(directory: Path, run: str) -> list[int]:
    return [r["step"] for r in read_jsonl(jsonl_path(directory, run, 0))
            if r["type"] == "metric" and r["tag"] == "train/loss"]


def _train(steps: int = STEPS) -> None:
    for step in range(steps):
        with ot.step(step), ot.span("fwd"):
            ot.log({"train/loss": float(step)})


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_init_returns_before_a_slow_backend_is_up_and_every_step_lands_in_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, placement: str) -> None:
    out = use_fake_wandb(tmp_path, monkeypatch, "record", import_s=5.0)
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", PLACEMENTS[placement])
    ot.init(exporters=["jsonl", "wandb"], dir=tmp_path / "runs", run_name="slow", shutdown_timeout_s=60)
    # The stand-in leaves `imported` once its 5 s import is over: init() came back before that.
    assert not (out / "imported").exists()
    _train()
    assert not (out / "imported").exists()  # the loop did not wait either
    ot.shutdown()
    assert (out / "imported").exists()
    assert _logged_steps(out) == list(range(STEPS))  # every step, once, in order
    assert _jsonl_steps(tmp_path / "runs", "slow") == list(range(STEPS))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_backend_that_cannot_start_is_said_once_and_counted_and_the_loop_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, placement: str) -> None:
    use_fake_wandb(tmp_path, monkeypatch, "broken")
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", PLACEMENTS[placement])
    directory = tmp_path / "runs"
    session = ot.init(exporters=["jsonl", "wandb"], dir=directory, run_name="broken")
    _train()
    ot.shutdown()
    said = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("otel-train: backend `wandb` could not start: RuntimeError: injected: no wandb here; ")
    assert _jsonl_steps(directory, "broken") == list(range(STEPS))  # the other backend got everything
    if placement == "in_process":
        (wandb,) = [ex for ex in session.exporters if ex.name == "wandb"]
        assert wandb.failures >= 1
        assert wandb.rows_lost["not_started"] >= STEPS  # at least every `train/loss` row, counted lost
        assert "its data is not written" in said[0]
        return
    progress = session.export_process.last_progress
    assert progress.failures["wandb"] >= 1
    assert progress.behind() == {"wandb": STEPS}  # none of its windows acknowledged
    assert "its windows stay in the spool" in said[0]
    spool = Spool(spool_dir(directory, "broken", 0))
    assert spool.cursor("wandb") == 0 < spool.last_seq == spool.cursor("jsonl")
    spool.close()
    # While W&B still cannot start, `otel-train replay` says so at once (not after `--stall`) and keeps its windows.
    still = subprocess.run([sys.executable, "-m", "otel_train.cli", "replay", str(directory / "broken"), "--stall",
                            "3600"], env={**os.environ, **fake_wandb_env(tmp_path, "broken")}, capture_output=True,
                           text=True, timeout=240, check=False)
    assert still.returncode == 1, still.stderr[-3000:]
    assert "backend `wandb` could not start: RuntimeError: injected: no wandb here" in still.stderr, still.stderr
    assert f"`wandb` behind by {STEPS} step(s)" in still.stdout and "kept in" in still.stdout, still.stdout
    # Once W&B can start, `otel-train replay` delivers each of its steps once.
    env = {**os.environ, **fake_wandb_env(tmp_path, "record")}
    env.pop("FAKE_WANDB_IMPORT_S", None)
    done = subprocess.run([sys.executable, "-m", "otel_train.cli", "replay", str(directory / "broken")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _logged_steps(tmp_path / "wandb-out") == list(range(STEPS))


def test_a_backend_still_starting_when_shutdowns_time_runs_out_in_process_counts_what_it_never_got(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # In the training process there is no spool: what a backend still starting holds at shutdown's deadline is
    # lost, and the summary says how much (it said "0 dropped").
    out = use_fake_wandb(tmp_path, monkeypatch, "record", import_s=30.0)
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", "off")
    directory = tmp_path / "runs"
    ot.init(exporters=["jsonl", "wandb"], dir=directory, run_name="late", shutdown_timeout_s=1)
    _train()
    ot.shutdown()
    assert not (out / "imported").exists()  # still starting when shutdown gave up on it
    assert _jsonl_steps(directory, "late") == list(range(STEPS))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    written = sum(1 for r in read_jsonl(jsonl_path(directory, "late", 0)) if r["type"] in ("metric", "span"))
    assert f"wandb: {written:,} rows not written ({written:,} not written when shutdown's time ran out)" in line, (
        written, line)


def test_a_bad_setting_of_a_backend_started_elsewhere_still_fails_init(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpcx")
    with pytest.raises(ConfigError, match=r"^OTEL_EXPORTER_OTLP_PROTOCOL: 'grpcx' is not supported; "
                                          r"use one of grpc, http/protobuf$"):
        ot.init(exporters=["otlp"], dir=tmp_path / "runs")
    assert ot._session is None


def test_a_child_process_left_alive_does_not_hold_the_listener_at_close(tmp_path: Path) -> None:
    """A persistent DataLoader worker stays connected after the trainer's shutdown: the exporter process reads
    what it sent and closes at once, without waiting for it to disconnect."""
    from otel_train.ship.workers import WorkerClient, WorkerListener
    from otel_train.vocab.run_identity import RunInfo

    got: list[list[tuple[str, int, float]]] = []
    address = str(tmp_path / "w.sock")
    listener = WorkerListener(address, RunInfo("r", "r"), lambda w: got.append(
        [(r.name, r.step, r.value) for r in w.metrics]), lambda: 0)
    client = WorkerClient(address)
    client.log({"data/fetch_s": 0.5}, 3)
    client.send_now()
    listener.close(timeout_s=30.0)
    serving = list(listener._serving)
    assert not any(t.is_alive() for t in serving)  # its reader ended though the child is still connected
    assert got == [[("data/fetch_s", 3, 0.5)]]  # and what it sent was delivered first
    client.close()


def test_the_log_level_of_a_start_failure_is_error() -> None:
    # The one line a user sees when a backend they configured does not start: an error, not a debug note.
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.ship.backend_start import StartingBackend

    def fail(options: ExporterOptions) -> None:
        raise OSError("no route to the tracking server")

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("otel_train").addHandler(handler)
    try:
        backend = StartingBackend("mine", fail, ExporterOptions())  # type: ignore[arg-type]
        backend.start()
        assert backend.wait_started(30)
    finally:
        logging.getLogger("otel_train").removeHandler(handler)
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.ERROR, ("otel-train: backend `mine` could not start: OSError: no route to the tracking server; "
                         "its data is not written"))]
    assert backend.start_error == "OSError: no route to the tracking server" and backend.failures == 1
