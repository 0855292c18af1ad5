"""A script that ends without `shutdown()` while W&B runs in the training process: every step reaches the
`.wandb` file. W&B registers its own `atexit` teardown when its run starts, after ours, so it would run first
and lose what was still to be written; ours runs before every `atexit` hook.

Real offline W&B, read back from its `.wandb` file; the three in-process placements: named backends with
`OTEL_TRAIN_EXPORT_PROCESS=off`, an exporter object passed to `init`, and the in-process fallback after the
exporter process died twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from backendkit import read_run, wandb_files

STEPS = 200

_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import otel_train as ot

    placement, root = sys.argv[1], sys.argv[2]
    exporters = ["wandb"]
    if placement == "object":
        from otel_train.exporters.wandb import WandbExporter
        from otel_train.config.exporter_options import ExporterOptions

        exporters = [WandbExporter(ExporterOptions(directory=root, project="exit"))]
    session = ot.init(exporters=exporters, dir=root, run_id="exit", run_name="exit", project="exit")
    if placement == "fallback":  # the exporter process dies twice: the training process exports itself
        for _ in range(2):
            proc = session.export_process
            old = proc.pid
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while proc.pid == old and proc.fallback is None and time.monotonic() < deadline:
                time.sleep(0.01)
        assert proc.fallback is not None
    for i in ot.steps(range(STEPS)):
        ot.log({"train/loss": float(i)})
        if i == STEPS // 2:
            assert ot.flush(timeout_s=120)  # W&B's run is open (and its exit hook registered) from here on
    print("done", flush=True)
    # no ot.shutdown(): the interpreter's exit hooks hand off
    """
).replace("STEPS", str(STEPS))


@pytest.mark.timeout(600)  # a real process under a 300 s limit of its own
@pytest.mark.parametrize("placement", ["off", "object", "fallback"])
def test_exit_without_shutdown_keeps_every_step_in_wandb(tmp_path: Path, backend_home: Path, placement: str) -> None:
    env = dict(os.environ)
    if placement == "off":
        env["OTEL_TRAIN_EXPORT_PROCESS"] = "off"
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), placement, str(tmp_path / "runs")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
    files = wandb_files(tmp_path / "runs", "exit", "exit")
    assert len(files) == 1, files
    history = read_run(files[0])["history"]
    assert sorted((s, h["train/loss"]) for s, h in history.items() if "train/loss" in h) == [
        (s, float(s)) for s in range(STEPS)]
