"""The watchdog in a real session: started by `init()`, a step stuck in a sleep recorded, off at 0."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import otel_train as ot


def load_batch() -> None:
    time.sleep(3.0)  # a C call: the watchdog sees this frame not move


def test_a_step_stuck_in_a_sleep_is_recorded_then_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_HANG_AFTER_S", "0.5")
    monkeypatch.setenv("OTEL_TRAIN_HANG_FACTOR", "5")
    monkeypatch.setenv("OTEL_TRAIN_QUIET", "1")
    ot.init(exporters=["jsonl"], dir=tmp_path, run_name="r")
    hang_file = tmp_path / "r" / "hang" / "rank0.json"
    assert json.loads(hang_file.read_text())["state"] == "running"
    for i in ot.steps(range(30)):
        with ot.span("data"):
            if i == 25:
                load_batch()
            time.sleep(0.002)
    ot.shutdown()
    content = json.loads(hang_file.read_text())
    assert content["state"] == "ended"
    stuck = [r for r in content["history"] if r["state"] == "stuck"]
    assert stuck and {(r["step"], r["phase"], tuple(r["spans"])) for r in stuck} == {(25, "data", ("data",))}
    assert stuck[0]["main_frame"].endswith(" in load_batch") and stuck[0]["native"] is True
    assert stuck[0]["user_frame"] == stuck[0]["main_frame"]
    main_thread = next(t for t in stuck[0]["threads"] if t["main"])
    assert main_thread["frames"][0] == stuck[0]["main_frame"]
    assert any(f.endswith("in test_a_step_stuck_in_a_sleep_is_recorded_then_resumed") for f in main_thread["frames"])
    resumed = content["history"][-1]
    assert (resumed["state"], resumed["step"]) == ("resumed", 25) and resumed["waited_s"] >= 3.0


def test_hang_after_0_turns_the_watchdog_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_HANG_AFTER_S", "0")
    session = ot.init(exporters=["jsonl"], dir=tmp_path, run_name="r")
    with ot.step(0):
        pass
    ot.shutdown()
    assert session.hang_watchdog is None and not (tmp_path / "r" / "hang").exists()
