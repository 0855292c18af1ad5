"""`otel-train replay` writes to the run's own stores: those recorded at `init()`, not the replaying shell's, and
never to a directory a crafted (or moved) ``exporters.json`` names outside the folder holding the run.

A backend's store is broken for the whole run (a directory where its database or file goes), so the spool keeps
every window for it; the fault is then removed and replay, run from another shell, delivers them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import readback
from faultkit import SERIES, value, wait_unlocked

STEPS = 30
TRAIN = textwrap.dedent("""
    import sys, time
    import otel_train as ot
    sys.path.insert(0, sys.argv[3])
    from faultkit import SERIES, value
    ot.init(exporters=sys.argv[2], dir=sys.argv[1], run_id="stores", run_name="stores", export_interval_s=0.05,
            shutdown_timeout_s=1)
    for s in ot.steps(range(int(sys.argv[4]))):
        ot.log({tag: value(tag, s) for tag in SERIES})
        time.sleep(0.01)
    ot.shutdown()
""")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "TRACKIO_", "MLFLOW_", "WANDB_", "CLEARML_"))}
    return {**env, **extra}


def _job_with_a_broken_store(tmp_path: Path, exporters: str, broken: Path, **env: str) -> Path:
    """Run the job while `broken` (a file a backend writes) is a directory; then remove the fault."""
    runs = tmp_path / "runs"
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    broken.mkdir(parents=True)
    done = subprocess.run([sys.executable, str(script), str(runs), exporters, str(Path(__file__).parent), str(STEPS)],
                          env=_env(OTEL_TRAIN_DRAIN_TIMEOUT_S="2", OTEL_TRAIN_VERIFY="record", OTEL_TRAIN_SELF_METRICS="0",
                                   **env), capture_output=True, text=True,
                          timeout=240, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    wait_unlocked(runs / "stores" / "spool" / "rank0")
    broken.rmdir()
    return runs / "stores"


def _replay(run_dir: Path, cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "otel_train.cli", "replay", str(run_dir), *args], env=_env(**env),
                          capture_output=True, text=True, timeout=240, check=False, cwd=cwd)


def _jsonl(run_dir: Path) -> list[tuple[str, int | None, float]]:
    return [(p.name, p.step, p.value) for p in readback.jsonl(run_dir / "rank0.jsonl") if p.name in SERIES]


ALL = sorted((tag, s, value(tag, s)) for s in range(STEPS) for tag in SERIES)


@pytest.mark.timeout(600)
def test_replay_from_a_shell_with_another_environment_writes_to_the_recorded_store(tmp_path: Path) -> None:
    recorded = tmp_path / "runs" / "trackio"
    run_dir = _job_with_a_broken_store(tmp_path, "jsonl,trackio", recorded / "otel-train.db",
                                       TRACKIO_DIR=str(recorded))
    assert not [p for p in readback.trackio(recorded, "otel-train", "stores") if p.name in SERIES]

    elsewhere = tmp_path / "other-shell"
    done = _replay(run_dir, elsewhere, TRACKIO_DIR=str(elsewhere / "trackio"))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert not (elsewhere / "trackio").exists()  # nothing went to the replaying shell's store
    points = [(p.name, p.step, p.value) for p in readback.trackio(recorded, "otel-train", "stores") if p.name in SERIES]
    assert sorted(points) == ALL  # every value once, in the store the run used
    assert sorted(_jsonl(run_dir)) == ALL
    verified = _verify(run_dir, elsewhere, TRACKIO_DIR=str(elsewhere / "trackio"))
    assert verified.returncode == 0, verified.stdout


def _verify(run_dir: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "otel_train.cli", "verify", str(run_dir)], env=_env(**env),
                          capture_output=True, text=True, timeout=240, check=False, cwd=cwd)


@pytest.mark.timeout(600)
def test_replay_never_writes_to_a_directory_a_crafted_exporters_json_names(tmp_path: Path) -> None:
    run_dir = _job_with_a_broken_store(tmp_path, "jsonl", tmp_path / "runs" / "stores" / "rank0.jsonl")
    assert not _jsonl(run_dir)
    meta = run_dir / "spool" / "rank0" / "exporters.json"
    described = json.loads(meta.read_text())
    outside = tmp_path / "outside"
    described["options"]["directory"] = str(outside)
    meta.write_text(json.dumps(described))

    done = _replay(run_dir, tmp_path / "shell")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "--allow-outside" in done.stderr and str(outside) in done.stderr  # says what it did not follow
    assert not outside.exists()
    assert sorted(_jsonl(run_dir)) == ALL and max(Counter(_jsonl(run_dir)).values()) == 1
    verified = _verify(run_dir, tmp_path / "shell")
    assert verified.returncode == 0, verified.stdout
