"""Several runs in one process (a notebook, an in-process sweep): each `init()` after `shutdown()` is a run of
its own, with a step sequence that starts again at 0. Read back from JSONL and TensorBoard's own event-file
loader as lists, so a point at a wrong step or written twice fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import readback
from reference import Point

import otel_train as ot
from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.vocab.run_paths import run_folder


def _train(run_dir: Path, name: str, scale: float) -> None:
    ot.init(exporters=["jsonl", "tensorboard"], dir=run_dir, run_id=name, run_name=name)
    for i in ot.steps(range(3)):
        ot.log({"loss": scale * (i + 1)})
    ot.shutdown()


def _loss(points: list[Point]) -> list[Point]:
    return [p for p in points if p.name == "loss"]


def test_each_run_starts_its_steps_at_zero(run_dir: Path) -> None:
    _train(run_dir, "first", 1.0)
    _train(run_dir, "second", 10.0)
    for name, scale in (("first", 1.0), ("second", 10.0)):
        expected = [Point("loss", s, scale * (s + 1)) for s in range(3)]
        assert _loss(readback.jsonl(jsonl_path(run_dir, name, 0))) == expected
        assert _loss(readback.tensorboard(run_folder(run_dir, name))) == expected
        iterations = [p for p in readback.jsonl(jsonl_path(run_dir, name, 0)) if p.name == "train.iterations"]
        assert [(p.step, p.value) for p in iterations] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_step_order_of_the_first_run_does_not_reach_the_second(run_dir: Path) -> None:
    ot.init(exporters=["jsonl"], dir=run_dir, run_id="strict", run_name="strict", step_order="raise")
    for i in ot.steps(range(5)):
        ot.log({"loss": float(i)})
    ot.shutdown()
    ot.init(exporters=["jsonl"], dir=run_dir, run_id="again", run_name="again", step_order="raise")
    ot.log({"loss": 7.0}, step=1)  # below the first run's last step: not "backwards" in a run of its own
    ot.shutdown()
    assert _loss(readback.jsonl(jsonl_path(run_dir, "again", 0))) == [Point("loss", 1, 7.0)]


_PREEMPTED_THEN_AGAIN = textwrap.dedent("""
    import os, signal, sys
    import otel_train as ot

    stop = []
    signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))  # a requeue handler: the loop stops by itself
    ot.init(exporters=["jsonl"], dir=sys.argv[1], run_id="first", run_name="first")
    for i in ot.steps(range(10)):
        ot.log({"loss": float(i)})
        if i == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # the scheduler's warning
        if stop:
            break
    ot.shutdown()
    ot.init(exporters=["jsonl"], dir=sys.argv[1], run_id="second", run_name="second")
    for i in ot.steps(range(3)):
        ot.log({"loss": float(i)})
    ot.shutdown()
""")


def test_a_preemption_of_the_first_run_does_not_mark_the_second(run_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _PREEMPTED_THEN_AGAIN, str(run_dir)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    marks = {name: [r["signal"] for r in read_jsonl(jsonl_path(run_dir, name, 0)) if r["type"] == "preempted"]
             for name in ("first", "second")}
    assert marks == {"first": ["SIGUSR1"], "second": []}
    assert _loss(readback.jsonl(jsonl_path(run_dir, "second", 0))) == [Point("loss", s, float(s)) for s in range(3)]
