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


def test_a_step_holding_the_gil_in_a_c_call_is_named_from_faulthandlers_dump(tmp_path: Path) -> None:
    """The watchdog's thread cannot run while the training thread holds the GIL: faulthandler's timer, armed by
    the watchdog, dumps the stacks without the GIL, and the roll call names the rank with that frame."""
    import os
    import subprocess
    import sys

    from otel_train.hangs.hang_file import read_hang_files
    from otel_train.hangs.roll_call import take_roll_call

    env = {**os.environ, "OTEL_TRAIN_HANG_AFTER_S": "1", "OTEL_TRAIN_HANG_FACTOR": "5",
           "OTEL_TRAIN_EXPORT_PROCESS": "off", "OTEL_TRAIN_QUIET": "1"}
    job = subprocess.Popen([sys.executable, str(Path(__file__).with_name("gil_job.py")), str(tmp_path), "12"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "gil"
    try:
        deadline = time.monotonic() + 60
        while "native_dump" not in read_hang_files(run_dir).get(0, {}):
            assert job.poll() is None, job.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no faulthandler dump while the GIL was held"
            time.sleep(0.2)
        files = read_hang_files(run_dir)
        call = take_roll_call(files, now=time.time() + 60)  # as a roll call a minute later sees it
    finally:
        output, _ = job.communicate(timeout=120)
    assert job.returncode == 0, output[-3000:]
    assert files[0]["native_dump"]["main_frames"][0].endswith("gil_job.py:15 in hold_the_gil")
    assert [s.rank for s in call.silent] == [0] and call.suspects() == [0]
    assert "its main thread holds the GIL in native code, called from `" in call.verdict()
    assert call.verdict().endswith("gil_job.py:15 in hold_the_gil`): rank 0 is where to look")
    assert json.loads((run_dir / "hang" / "rank0.json").read_text())["state"] == "ended"


FORK_SCRIPT = """
import os, sys, time
import otel_train as ot
from otel_train.hangs.native_timer import NATIVE_TIMER

ot.init(dir=sys.argv[1], run_name="fork", exporters=["jsonl"])
with ot.step(0):
    deadline = time.monotonic() + 30
    while not NATIVE_TIMER.armed and time.monotonic() < deadline:  # the watchdog's first look arms it
        time.sleep(0.05)
    assert NATIVE_TIMER.armed
    pid = os.fork()
    if pid == 0:  # a child that ends through the interpreter's normal exit (not os._exit)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), "armed in parent", NATIVE_TIMER.armed)
ot.shutdown()
"""


def test_a_child_forked_while_the_native_timer_is_armed_exits(tmp_path: Path) -> None:
    """CPython's faulthandler timer, armed at a fork, hangs the child at its normal exit: it is cancelled before
    every fork and re-armed in the parent after it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OTEL_TRAIN_HANG_AFTER_S": "1", "OTEL_TRAIN_EXPORT_PROCESS": "off", "OTEL_TRAIN_QUIET": "1"}
    done = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "child 0 armed in parent True"


STUCK_JOB = """
import sys, time
import otel_train as ot

ot.init(exporters="jsonl", dir=sys.argv[1], run_name="r")
for i in ot.steps(range(30)):
    with ot.span("data"):
        if i == 25:
            open(sys.argv[2], "w").close()  # the test waits for the `stuck` record from here on
            time.sleep(600)  # stuck until the launcher stops the job
        time.sleep(0.002)
"""


def test_a_job_stopped_while_stuck_leaves_an_ended_record_not_a_live_hang(tmp_path: Path) -> None:
    """SIGTERM (a launcher's timeout) while step 25 is stuck: the shutdown writes an `ended` record into the file
    and as a log record, so neither the file nor the sink goes on showing a live hang."""
    import os
    import signal
    import subprocess
    import sys

    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    script, marker = tmp_path / "job.py", tmp_path / "at-25"
    script.write_text(STUCK_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRAIN_HANG_AFTER_S="0.5", OTEL_TRAIN_HANG_FACTOR="5", OTEL_TRAIN_QUIET="1")
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(marker)], env=env,
                            stderr=subprocess.PIPE, text=True)
    hang_file = tmp_path / "r" / "hang" / "rank0.json"
    try:
        deadline = time.monotonic() + 120  # a bound on waiting, not an assertion on time
        while time.monotonic() < deadline and proc.poll() is None:
            if marker.exists() and hang_file.exists() and json.loads(hang_file.read_text())["state"] == "stuck":
                break
            time.sleep(0.05)
        assert json.loads(hang_file.read_text())["state"] == "stuck"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    content = json.loads(hang_file.read_text())
    assert content["state"] == "ended", err[-2000:]
    ended = content["latest"]
    assert (ended["state"], ended["step"], ended["phase"]) == ("ended", 25, "data")
    assert ended["waited_s"] >= content["history"][-2]["waited_s"]
    records = [r for r in read_jsonl(jsonl_path(tmp_path, "r", 0))
               if r["type"] == "log" and r["logger"] == "otel_train.hang"]
    assert [r["attributes"]["train.hang.state"] for r in records][-1] == "ended"
    assert [r["attributes"]["train.hang.state"] for r in records].count("ended") == 1
