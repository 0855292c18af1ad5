"""The backend extension contract ("Writing a backend"): what a third-party backend implements and calls, pinned
by signature and by behaviour through a running session, and a backend shipped as its own distribution
(`examples/backend-plugin`) found through the `otel_train.exporters` entry point and used by name.

Only the backend-facing side is pinned here: how the core feeds windows (queues, retry timing) may change.
"""

from __future__ import annotations

import csv
import inspect
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import otel_train as ot
from otel_train.exporters import RowExporter
from otel_train.vocab.rows import HistogramRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "backend-plugin"

#: The hooks a backend implements (or calls: `mark_written`), with their parameters.
HOOKS = {
    "__init__": ["self", "options"],
    "write_metrics": ["self", "rows", "histograms"],
    "write_spans": ["self", "rows"],
    "write_resume": ["self", "run", "step"],
    "flush": ["self"],
    "durable_step": ["self"],
    "close": ["self"],
    "mark_preempted": ["self", "cause"],
    "row_problem": ["self", "row"],
    "mark_written": ["self", "rows"],
    "mark_appending": ["self", "files"],
}
#: Class attributes a backend sets, with the base's defaults.
ATTRIBUTES = {"handles_metrics": True, "handles_spans": False, "client_module": None, "display_names": False,
              "kill_safe_writes": False}


def test_the_hooks_a_backend_implements_keep_their_signatures() -> None:
    for hook, params in HOOKS.items():
        assert list(inspect.signature(getattr(RowExporter, hook)).parameters) == params, hook
    assert inspect.signature(RowExporter.__init__).parameters["options"].default is None
    assert isinstance(inspect.getattr_static(RowExporter, "preload"), classmethod)
    for attribute, default in ATTRIBUTES.items():
        assert getattr(RowExporter, attribute) == default, attribute
    assert isinstance(RowExporter.name, str)


def test_a_backend_overrides_only_what_it_writes(tmp_path: Path) -> None:
    class Minimal(RowExporter):
        name = "minimal"

    backend = Minimal()
    assert backend.durable_step() is None  # writes are synchronous unless the backend says otherwise
    backend.write_spans([])
    backend.flush()
    backend.mark_preempted("SIGTERM")
    backend.close()
    for field in ("directory", "project", "hparams", "resume_step"):  # the options a backend reads
        assert hasattr(backend.options, field), field


class Recorder(RowExporter):
    """Records every hook call in order and whether two ever overlapped."""

    name = "recorder"
    handles_spans = True

    def __init__(self, fail_first_write: bool = False) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []
        self.metrics: list[tuple[int, str, float]] = []
        self.active = 0
        self.overlaps = 0
        self._guard = threading.Lock()
        self._fail = fail_first_write

    def _enter(self, *call: Any) -> None:
        with self._guard:
            self.overlaps += self.active
            self.active += 1
        self.calls.append(call)

    def _leave(self) -> None:
        with self._guard:
            self.active -= 1

    def row_problem(self, row: MetricRow | HistogramRow) -> str | None:
        return "refused" if row.tag.startswith("bad/") else super().row_problem(row)

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        self._enter("write_metrics", [(r.step, r.tag) for r in rows])
        try:
            if self._fail and len(rows) > 1:
                self._fail = False
                self.metrics.append((rows[0].step, rows[0].tag, float(rows[0].value)))
                self.mark_written(rows[:1])  # landed: a retry must not hand it over again
                raise RuntimeError("the backend's server hung up")
            self.metrics += [(r.step, r.tag, float(r.value)) for r in rows]
        finally:
            self._leave()

    def write_spans(self, rows: Sequence[SpanRow]) -> None:
        self._enter("write_spans", [(r.name, r.step) for r in rows])
        self._leave()

    def write_resume(self, run: RunInfo, step: int) -> None:
        self._enter("write_resume", run.run_name, step)
        self._leave()

    def flush(self) -> None:
        self._enter("flush")
        self._leave()

    def close(self) -> None:
        self._enter("close")
        self._leave()


def _loss(rows: list[Any]) -> list[Any]:
    """The rows of the series the tests log (the session adds its own, e.g. `train.step.duration_s`)."""
    return [r for r in rows if r[1] == "train/loss"]


def _train(backend: Recorder, tmp_path: Path, steps: range) -> None:
    ot.init(exporters=[backend], dir=tmp_path, run_name="contract", export_every=2)
    for s in ot.steps(steps):
        with ot.span("forward"):
            ot.log({"train/loss": float(s), "bad/x": 1.0})


def test_what_the_core_guarantees_a_backend(tmp_path: Path) -> None:
    """Rows it refuses never reach it (counted); every other row arrives once, in step order; spans too;
    hooks never overlap; `flush` then `close`, once, last."""
    backend = Recorder()
    _train(backend, tmp_path, range(6))
    ot.shutdown()
    ot.shutdown()
    assert _loss(backend.metrics) == [(s, "train/loss", float(s)) for s in range(6)]
    assert backend.rows_lost == {"refused": 6}
    spans = [span for call in backend.calls if call[0] == "write_spans" for span in call[1]]
    assert spans == [("forward", s) for s in range(6)]
    assert backend.calls[-2:] == [("flush",), ("close",)]
    assert [c for c in backend.calls if c[0] == "close"] == [("close",)]
    assert backend.overlaps == 0


def test_a_failed_write_is_retried_without_repeating_what_landed(tmp_path: Path) -> None:
    backend = Recorder(fail_first_write=True)
    _train(backend, tmp_path, range(6))  # nothing raises into the loop
    ot.shutdown()
    assert sorted(_loss(backend.metrics)) == [(s, "train/loss", float(s)) for s in range(6)]
    assert backend.failures >= 1
    assert backend.calls[-1] == ("close",)


def test_a_resume_reaches_the_backend_after_the_rows_logged_before_it(tmp_path: Path) -> None:
    backend = Recorder()
    _train(backend, tmp_path, range(6))
    ot.resume(3)
    for s in ot.steps(range(3, 5)):
        ot.log({"train/loss": 10.0 + s})
    ot.shutdown()
    names = [c[0] for c in backend.calls]
    at = names.index("write_resume")
    assert backend.calls[at] == ("write_resume", "contract", 3)
    before = _loss([row for c in backend.calls[:at] if c[0] == "write_metrics" for row in c[1]])
    after = _loss([row for c in backend.calls[at:] if c[0] == "write_metrics" for row in c[1]])
    assert before == [(s, "train/loss") for s in range(6)]
    assert after == [(3, "train/loss"), (4, "train/loss")]


def _install_example(site: Path) -> None:
    """What `pip install examples/backend-plugin` puts in site-packages: the package and a `.dist-info` whose
    `entry_points.txt` comes from the example's pyproject (no build backend or network needed here)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    shutil.copytree(EXAMPLE / "otel_train_example_backend", site / "otel_train_example_backend")
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = project["entry-points"]
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items())
        for group, eps in groups.items()))


def test_a_third_party_backend_installed_as_a_package_is_used_by_name(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _install_example(site)
    script = (
        "import otel_train as ot\n"
        "try:\n"
        "    ot.init(exporters='no_such_backend')\n"
        "except ot.ConfigError as err:\n"
        "    print(err)\n"
        "ot.init()\n"
        "for s in ot.steps(range(5)):\n"
        "    ot.log({'train/loss': 1.0 / (s + 1)})\n"
        "ot.shutdown()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "OTEL_TRAIN_EXPORTERS": "example_csv", "OTEL_TRAIN_DIR": str(tmp_path / "runs"),
           "OTEL_TRAIN_RUN_NAME": "plugin"}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "unknown exporter 'no_such_backend'" in done.stdout and "example_csv" in done.stdout
    with open(tmp_path / "runs" / "plugin" / "rank0.csv", encoding="utf-8", newline="") as f:
        rows = [(int(r["step"]), r["tag"], float(r["value"])) for r in csv.DictReader(f)]
    assert _loss(rows) == [(s, "train/loss", 1.0 / (s + 1)) for s in range(5)]
