"""init/shutdown: resource, run identity, errors at init, process hooks (SIGTERM), bounded shutdown."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import otel_train as ot
from otel_train.config.settings import load_settings
from otel_train.errors import ConfigError
from otel_train.session.placement import resolve_run_id
from otel_train.testing import InMemoryRowExporter


def test_resource_carries_run_and_rank(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=vision")
    session = ot.init(exporters=[], dir=run_dir, run_id="job-42", run_name="resnet", service_name="trainer")
    attrs = session.resource.attributes
    assert attrs["train.run.id"] == "job-42" and attrs["train.run.name"] == "resnet"
    assert (attrs["train.rank"], attrs["train.local_rank"], attrs["train.world_size"]) == (0, 0, 4)
    assert attrs["service.name"] == "trainer" and attrs["team"] == "vision"
    assert attrs["process.pid"] == os.getpid() and attrs["host.name"]


def test_run_id_is_the_same_on_every_rank_without_communication() -> None:
    s = load_settings({})
    assert resolve_run_id(s, {"TORCHELASTIC_RUN_ID": "abc", "RANK": "3"}) == "abc"
    assert resolve_run_id(s, {"SLURM_JOB_ID": "991"}) == "991"
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert resolve_run_id(s, {**env, "RANK": "0"}) == resolve_run_id(s, {**env, "RANK": "1"})
    assert resolve_run_id(load_settings({"OTEL_TRAIN_RUN_ID": "mine"}), {"SLURM_JOB_ID": "1"}) == "mine"
    single = resolve_run_id(s, {})
    assert single != resolve_run_id(s, {})  # a lone process gets a fresh id


def test_second_init_warns_and_returns_the_same_session(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = ot.init(exporters=[], dir=run_dir)
    with caplog.at_level(logging.WARNING):
        second = ot.init(exporters=["tensorboard"], dir=run_dir)
    assert second is first
    assert any("init() called again" in r.getMessage() for r in caplog.records)


def test_unknown_exporter_lists_the_known_ones(run_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        ot.init(exporters="tensorbord", dir=run_dir)
    assert str(info.value).startswith(
        "OTEL_TRAIN_EXPORTERS: unknown exporter 'tensorbord'; known: chrome_trace, clearml, console, jsonl, "
        "mlflow, otlp, tensorboard, trackio, wandb"
    )


def test_missing_package_names_the_pip_install(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        ot.init(exporters="tensorboard,wandb", dir=run_dir)
    assert str(info.value) == (
        "OTEL_TRAIN_EXPORTERS: exporter 'wandb' needs the `wandb` package, which is not installed; "
        "run: pip install 'otel-train[wandb]'"
    )


def test_unwritable_dir_fails_at_init_naming_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"OTEL_TRAIN_DIR: cannot write to '.*a-file/runs'"):
        ot.init(exporters=[], dir=blocker / "runs")


def test_bad_env_fails_at_init(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_EVERY", "-3")
    with pytest.raises(ConfigError, match="OTEL_TRAIN_EXPORT_EVERY: -3 is too small"):
        ot.init(dir=run_dir)
    monkeypatch.setenv("WORLD_SIZE", "two")
    monkeypatch.delenv("OTEL_TRAIN_EXPORT_EVERY")
    with pytest.raises(ConfigError, match="WORLD_SIZE: 'two' is not an integer"):
        ot.init(exporters=[], dir=run_dir)


def test_init_after_shutdown_starts_a_new_session(run_dir: Path) -> None:
    a = InMemoryRowExporter()
    first = ot.init(exporters=[a], dir=run_dir)
    ot.shutdown()
    b = InMemoryRowExporter()
    second = ot.init(exporters=[b], dir=run_dir)
    assert second is not first
    ot.log({"x": 1.0}, step=0)
    ot.flush()
    assert b.values("x") == [(0, 1.0)] and a.metrics == []


_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import otel_train as ot
    ot.init(exporters="tensorboard,chrome_trace", dir=sys.argv[1], run_name="preempted",
            export_every=1000, export_interval_s=3600)
    for i in ot.steps(range(10**9)):
        with ot.span("forward"):
            ot.log({"train/loss": float(i)})
        if i == 199:
            print("ready", flush=True)
        if i >= 199:
            time.sleep(0.01)
    """
)


def test_sigterm_mid_run_keeps_every_logged_step(tmp_path: Path) -> None:
    """Preemption: every step logged before SIGTERM is in the TB files and the trace."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from otel_train.trace_merge import load_trace

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "runs")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    assert rc == -signal.SIGTERM  # the default action still ends the process, after our flush
    acc = EventAccumulator(str(tmp_path / "runs" / "preempted"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == list(range(len(steps))) and len(steps) >= 200
    events = load_trace(tmp_path / "runs" / "preempted" / "trace" / "rank0.trace.json")
    span_steps = sorted(e["args"]["train.step"] for e in events if e.get("ph") == "X")
    assert span_steps[: len(steps)] == steps  # each logged step has its span


def test_shutdown_is_bounded_when_an_exporter_hangs(run_dir: Path) -> None:
    import threading

    class Stuck(InMemoryRowExporter):
        def write_metrics(self, rows, histograms):  # type: ignore[no-untyped-def]
            threading.Event().wait(60)

    ot.init(exporters=[Stuck()], dir=run_dir, shutdown_timeout_s=1)
    ot.log({"x": 1.0}, step=0)
    start = time.monotonic()
    ot.shutdown()
    assert time.monotonic() - start < 30  # returned at its 1 s timeout, not after the exporter's 60 s hang


_CHAINED = textwrap.dedent(
    """
    import signal, sys
    import otel_train as ot
    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))  # e.g. a checkpoint-on-preemption hook
    ot.init(exporters="jsonl", dir=sys.argv[1], run_name="chained", export_every=1000, export_interval_s=3600)
    for i in ot.steps(range(5)):
        ot.log({"x": float(i)})
    signal.raise_signal(signal.SIGTERM)
    print("handler called:", got == [signal.SIGTERM], flush=True)
    import json
    with open(sys.argv[1] + "/chained/rank0.jsonl") as f:
        rows = [json.loads(line) for line in f]
    print("flushed before the handler returned:", sum(r.get("tag") == "x" for r in rows), flush=True)
    """
)


def test_sigterm_flushes_then_chains_the_previous_handler(tmp_path: Path) -> None:
    script = tmp_path / "chained.py"
    script.write_text(_CHAINED)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "handler called: True" in result.stdout
    assert "flushed before the handler returned: 5" in result.stdout


def _forked_child(conn) -> None:  # type: ignore[no-untyped-def]
    try:
        with ot.step(100), ot.span("in-child"):
            ot.log({"x": -1.0})
        ot.flush()
        conn.send("ok")
    except BaseException as err:  # report anything that would have reached user code
        conn.send(repr(err))


def test_forked_child_neither_raises_nor_writes_into_the_parents_files(run_dir: Path) -> None:
    """A DataLoader worker started by fork shares the parent's files and socket: it uses neither, its data
    reaches the run through its own connection to the exporter process (tests/test_workers.py)."""
    import multiprocessing

    from otel_train.exporters.jsonl import read_jsonl

    ot.init(exporters="jsonl", dir=run_dir, run_name="forked")
    with ot.step(0):
        ot.log({"x": 1.0})
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_forked_child, args=(child_end,))
    proc.start()
    assert parent_end.recv() == "ok"
    proc.join(timeout=30)
    assert proc.exitcode == 0
    with ot.step(1):
        ot.log({"x": 2.0})
    ot.shutdown()
    rows = list(read_jsonl(run_dir / "forked" / "rank0.jsonl"))
    assert {(r["step"], r["value"]) for r in rows if r.get("tag") == "x"} == {(0, 1.0), (1, 2.0)}
    assert [r["value"] for r in rows if r.get("tag") == f"x{{worker={proc.pid}}}"] == [-1.0]
    assert len([r for r in rows if r.get("name") == "in-child"]) == 1


def test_init_rank_keywords_override_the_launcher_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frameworks pass their own rank to `init()`; it wins over RANK/WORLD_SIZE and gates metric export."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    session = ot.init(exporters=[], dir=tmp_path, rank=2, local_rank=1, world_size=4)
    try:
        assert (session.run.rank, session.run.local_rank, session.run.world_size) == (2, 1, 4)
        assert session.export_metrics is False
    finally:
        ot.shutdown()


_GLOBALS = textwrap.dedent(
    """
    import json, sys
    from opentelemetry import metrics, trace
    import otel_train as ot
    from otel_train.testing import InMemoryRowExporter

    early_meter = metrics.get_meter("lib")  # a library's module-level meter and tracer, taken before init
    early_tracer = trace.get_tracer("lib")
    out = {}
    for n in (1, 2):
        mem = InMemoryRowExporter()
        ot.init(exporters=[mem], dir=sys.argv[1], run_id=f"s{n}", export_interval_s=3600)
        if n == 1:
            seen = early_meter.create_counter("seen")  # created in session 1, used in both
        with ot.step(n):
            seen.add(n)
            metrics.get_meter("app").create_counter("calls").add(10 * n)
            with early_tracer.start_as_current_span(f"early{n}"):
                pass
            with trace.get_tracer("app").start_as_current_span(f"span{n}"):
                pass
        ot.shutdown()
        out[n] = {"metrics": sorted([r.tag, r.step, r.value] for r in mem.metrics if r.name in ("seen", "calls")),
                  "spans": sorted([s.name, s.step] for s in mem.spans)}
    seen.add(100)  # between sessions: goes nowhere, raises nothing
    print(json.dumps(out))
    """
)


def test_global_otel_meter_and_tracer_follow_a_new_session(tmp_path: Path) -> None:
    """`shutdown()` then `init()`: OTel's global meter and tracer, and instruments created in the first session,
    reach the second session's providers (OTel sets its globals once per process)."""
    import json

    script = tmp_path / "globals.py"
    script.write_text(_GLOBALS)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["1"] == {"metrics": [["calls", 1, 10.0], ["seen", 1, 1.0]], "spans": [["early1", 1], ["span1", 1]]}
    assert out["2"] == {"metrics": [["calls", 2, 20.0], ["seen", 2, 2.0]], "spans": [["early2", 2], ["span2", 2]]}
