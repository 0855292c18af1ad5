"""Trackio after a kill between two windows that split one step's values: the restarted delivery (a restarted
exporter process, `otel-train replay`) writes the rest of that step, and nothing the store already holds twice.

Two processes, as a killed one and its replay: the first writes window 1 (steps 0-4 whole, step 5's `loss`), the
second, resuming the same run, is handed window 2 (step 5's `acc`, steps 6-7) and window 1 again (what a replay
from before the cut does). Real Trackio stores (under TRACKIO_DIR, read at import: each process its own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from trackio.sqlite_storage import SQLiteStorage
    from otel_train.backend import Window
    from otel_train.exporters.trackio import TrackioExporter
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    run = RunInfo("split-1", "split")

    def row(step, tag):
        return MetricRow(run, step, tag, tag, step + (0.5 if tag == "acc" else 0.0), "gauge", 0, {})

    first = [row(s, t) for s in range(5) for t in ("loss", "acc")] + [row(5, "loss")]
    second = [row(5, "acc")] + [row(s, t) for s in (6, 7) for t in ("loss", "acc")]
    exp = TrackioExporter(ExporterOptions(directory=Path(sys.argv[2]), project="split"))
    windows = [first] if sys.argv[1] == "first" else [first, second]
    ok = all(exp.export_window(Window(metrics=w)) for w in windows)
    exp.shutdown()
    logs = SQLiteStorage.get_logs("split", "split")
    print("RESULT" + json.dumps({"ok": ok, "logs": logs}, default=str))
""")


def _phase(phase: str, tmp_path: Path, script: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKIO_", "HF_", "OTEL_TRAIN_"))}
    env.update(HOME=str(tmp_path / "home"), TRACKIO_DIR=str(tmp_path / "trackio"), HF_HOME=str(tmp_path / "hf"))
    done = subprocess.run([sys.executable, str(script), phase, str(tmp_path / "runs")], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    result: dict[str, object] = json.loads(line[len("RESULT"):])
    return result


def test_a_step_split_over_two_windows_keeps_all_its_values_once(tmp_path: Path) -> None:
    script = tmp_path / "split.py"
    script.write_text(SCRIPT)
    assert _phase("first", tmp_path, script)["ok"]
    result = _phase("replay", tmp_path, script)
    assert result["ok"]
    points = [(k, e["step"], v) for e in result["logs"] for k, v in e.items()  # type: ignore[attr-defined]
              if k in ("loss", "acc")]
    expected = [(t, s, s + (0.5 if t == "acc" else 0.0)) for s in range(8) for t in ("loss", "acc")]
    assert max(Counter(points).values()) == 1, [p for p, n in Counter(points).items() if n > 1]
    assert sorted(points) == sorted(expected)
