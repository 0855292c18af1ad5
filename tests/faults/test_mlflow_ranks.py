"""MLflow with several ranks started at once (`OTEL_TRAIN_RANKS=all`): one store, one run, every step once.

Two real training processes (RANK/WORLD_SIZE as a launcher sets them) wait for one start signal, then each
opens MLflow's default SQLite store from its exporter process at the same moment. Before the store lock, one
of them failed MLflow's migration ("Online migration expected to match one row") and wrote nothing until a
replay, or the store could not be opened afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

STEPS = 30
WORLD = 2
RUN_ID = "mlflow-ranks"
SCRIPT = textwrap.dedent("""
    import os, sys, time
    go, ready = sys.argv[1], sys.argv[2]
    import otel_train as ot
    from mlflow.tracking import MlflowClient  # noqa: F401  (imported before the start, as a warm job has it)
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.002)
    ot.init()
    rank = int(os.environ["RANK"])
    for s in ot.steps(range({steps})):
        ot.log({{"train/loss": s + rank / 10, "val/mAP@0.5": s * 2 + rank}})
    ot.shutdown()
""")


def _env(tmp_path: Path, rank: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OTEL_"))}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), HOME=str(tmp_path / "home"),
               OTEL_TRAIN_DIR=str(tmp_path / "runs"), OTEL_TRAIN_RUN_ID=RUN_ID, OTEL_TRAIN_RANKS="all",
               OTEL_TRAIN_EXPORTERS="mlflow", OTEL_TRAIN_EXPORT_EVERY="5",
               # `shutdown()` returns when MLflow has every step: on a loaded machine the exporter process may still
               # be creating the store at the default 10 s, and this test's client would open it under that build.
               OTEL_TRAIN_SHUTDOWN_TIMEOUT_S="120")
    return env


def test_two_ranks_start_together_and_every_step_lands_once(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from otel_train.exporters.mlflow import mlflow_name

    script, go = tmp_path / "rank.py", tmp_path / "go"
    script.write_text(SCRIPT.format(steps=STEPS))
    ready = [tmp_path / f"ready-{rank}" for rank in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, str(script), str(go), str(ready[rank])], env=_env(tmp_path, rank),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(WORLD)]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready):  # both interpreters up and waiting: the start is simultaneous
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.01)
    go.touch()
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "migration" not in err.lower() and "mlflow:" not in err, err[-3000:]

    uri = f"sqlite:///{(tmp_path / 'runs' / 'mlruns' / 'mlflow.db').resolve()}"
    client = MlflowClient(uri)  # the store opens afterwards
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`train.run.id` = '{RUN_ID}'")
    assert len(runs) == 1
    rid = runs[0].info.run_id

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(rid, key))

    for rank in range(WORLD):
        suffix = f"__rank-{rank}" if rank else ""
        assert history("train/loss" + suffix) == [(s, pytest.approx(s + rank / 10)) for s in range(STEPS)], rank
        assert history(mlflow_name("val/mAP@0.5") + suffix) == [(s, s * 2 + rank) for s in range(STEPS)], rank
        # Built-in series: one naming on every rank (the display name), every step once.
        assert [s for s, _ in history("train/step_duration_s" + suffix)] == list(range(STEPS)), rank
        assert runs[0].data.tags["otel_train.last_step" + (f".rank{rank}" if rank else "")] == str(STEPS - 1)
    keys = set(runs[0].data.metrics)
    assert not any("train.step.duration_s" in k for k in keys), sorted(keys)
