"""SIGTERM, SIGINT, SIGUSR1 and SIGHUP at steps from the first on: every step logged before the signal lands, exactly, and the loop
runs no step after it (the handler holds the loop while it hands off, then acts as the handler before ours would).

A driver forks a tiny loop (JSONL + TensorBoard) per repetition and signals it after a given step;
each repetition asserts the exact (series, step, value) sets read back from both backends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from faultkit import expected

# Real processes, each under a 300 s limit of its own: twice the suite's default per test.
pytestmark = pytest.mark.timeout(600)
DRIVER = Path(__file__).with_name("signal_driver.py")
# The steps after which each repetition (a real exporter process each) is signalled. The loop runs on while the
# signal is sent, so where in a step it lands (in `log`, in a span, between steps, during a window's hand-off
# every 0.05 s) is up to timing, not the step; the steps cover the first step, its neighbours and later ones.
SIGNAL_STEPS = (0, 1, 2, 13, 27, 40)


def drive(out: Path, sig: str, steps: tuple[int, ...], mode: str = "default") -> list[dict[str, Any]]:
    listed = ",".join(map(str, steps)) + ","  # a list, even of one
    proc = subprocess.run([sys.executable, str(DRIVER), str(out), sig, listed, "0", mode],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: list[dict[str, Any]] = json.loads(proc.stdout)
    assert [r["signal_after_step"] for r in results] == list(steps)
    return results


def landed_prefix(points: list[list[Any]]) -> int:
    """The last step of the landed points, after checking they are steps 0..N with no hole."""
    steps = sorted({p[1] for p in points})
    assert steps == list(range(len(steps))), f"a hole in the landed steps: {steps}"
    return len(steps) - 1


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP"])
def test_signal_at_any_step_lands_every_step_logged_before_it(tmp_path: Path, sig: str) -> None:
    signum = getattr(signal, sig)
    for r in drive(tmp_path, sig, SIGNAL_STEPS):
        last = landed_prefix(r["jsonl"])
        # Deterministic: the loop stops at the signal (no step runs after it), so every step it finished is there,
        # and at most the step it was in besides (its one `log` call made before the signal came).
        assert r["last_reported"] <= last <= r["last_reported"] + 1, r
        assert {tuple(p) for p in r["jsonl"]} == expected(range(last + 1)), r["rep"]
        assert {tuple(p) for p in r["tb"]} == expected(range(last + 1), as_f32=True), r["rep"]
        assert len(r["jsonl"]) == len(expected(range(last + 1)))  # exactly once
        if sig == "SIGINT":  # KeyboardInterrupt in the loop, then the exit hooks
            assert r["exit_code"] == 130
        else:  # the default action still ends the process, by the same signal
            assert r["killed_by"] == signum


def test_the_same_signal_twice_at_once_is_one_signal(tmp_path: Path) -> None:
    """A launcher that forwards SIGTERM to the rank and also signals its process group sends two at once: the second
    was taken as "a second signal ends it at once" and killed the hand-off (no summary line; the last steps lost
    in about 1 run of 8). A repeat within a second is now the same signal: every finished step lands."""
    for r in drive(tmp_path, "SIGTERM", SIGNAL_STEPS, "twice"):
        last = landed_prefix(r["jsonl"])
        assert r["last_reported"] <= last <= r["last_reported"] + 1, r
        assert {tuple(p) for p in r["jsonl"]} == expected(range(last + 1)), r["rep"]
        assert {tuple(p) for p in r["tb"]} == expected(range(last + 1), as_f32=True), r["rep"]
        assert r["killed_by"] == signal.SIGTERM


@pytest.mark.parametrize("mode", ["chained", "composed"])
def test_sigusr1_keeps_the_users_or_frameworks_handler_working(tmp_path: Path, mode: str) -> None:
    """A SLURM requeue handler installed before `init` (chained) or a framework's installed after it
    (composed, Lightning's way) still runs; the process is not ended by us and exits cleanly."""
    for r in drive(tmp_path, "SIGUSR1", (0, 11, 40), mode=mode):
        assert r["handler_ran"] and r["exit_code"] == 0 and r["killed_by"] is None, r
        last = landed_prefix(r["jsonl"])
        assert last == r["last_reported"]  # the loop stopped by itself; every step it logged landed
        assert {tuple(p) for p in r["tb"]} == expected(range(last + 1), as_f32=True)


def test_open_spans_are_closed_and_flagged_truncated(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, signal, threading, time
        import otel_train as ot
        ot.init(exporters=["jsonl"], dir={str(tmp_path)!r}, run_id="t", run_name="t")
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with ot.step(0):
            with ot.span("epoch"):
                with ot.span("forward"):
                    time.sleep(60)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    spans = {r["name"]: r for r in read_jsonl(jsonl_path(tmp_path, "t", 0)) if r["type"] == "span"}
    assert set(spans) == {"epoch", "forward"}
    for span in spans.values():
        assert span["attributes"]["otel_train.truncated"] is True and span["step"] == 0
        assert span["end_unix_nano"] > span["start_unix_nano"]
    assert spans["forward"]["parent_span_id"] == spans["epoch"]["span_id"]



_HANGUP = textwrap.dedent("""
    import os, signal, sys, time
    import otel_train as ot
    if sys.argv[2] == "nohup":  # as `nohup` starts a program: hangups ignored
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    ot.init(exporters=["jsonl"], dir=sys.argv[1], run_id="h", run_name="h")
    for s in range(6):
        with ot.step(s):
            ot.log({"loss": 1.0 / (s + 1), "acc": s * 0.5})
        if s == 2:
            os.killpg(0, signal.SIGHUP)  # the terminal or SSH session closed: its whole process group gets it
            time.sleep(0.5)
    ot.shutdown()
""")


@pytest.mark.parametrize("mode", ["terminal", "nohup"])
def test_sighup_hands_off_and_marks_the_run_unless_ignored(tmp_path: Path, mode: str) -> None:
    """A closed terminal sends SIGHUP to the job's process group: the trainer flushes, marks the run preempted and
    ends by SIGHUP, like SIGTERM (the exporter process, in a session of its own, delivers it all); a
    program started under `nohup` (SIGHUP ignored before `init`) keeps ignoring it: it runs on, unmarked."""
    proc = subprocess.run([sys.executable, "-c", _HANGUP, str(tmp_path), mode], capture_output=True, text=True,
                          timeout=120, check=False, start_new_session=True)  # a process group of its own
    from faultkit import jsonl_points

    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    path = jsonl_path(tmp_path, "h", 0)
    points = jsonl_points(tmp_path, "h")
    marks = [r["signal"] for r in (read_jsonl(path) if path.exists() else ()) if r["type"] == "preempted"]
    if mode == "terminal":
        assert proc.returncode == -signal.SIGHUP, proc.stderr[-3000:]
        assert sorted(points) == sorted(expected(range(3))) and len(points) == len(expected(range(3)))
        assert marks == ["SIGHUP"]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(points) == sorted(expected(range(6))) and len(points) == len(expected(range(6)))
        assert marks == []


_IN_FLUSH = textwrap.dedent("""
    import os, signal, sys, threading, time
    import otel_train as ot
    from otel_train.exporters.base import RowExporter

    class Slow(RowExporter):  # holds every flush: the signal comes while the loop waits in otel-train's code
        name = "slow"
        def write_metrics(self, rows, histograms):
            time.sleep(float(sys.argv[2]))

    ot.init(exporters=["jsonl", Slow()], dir=sys.argv[1], run_id="f", run_name="f", export_every=1000,
            export_interval_s=3600)
    try:
        for s in range(1000):
            with ot.step(s):
                ot.log({"loss": 1.0 / (s + 1), "acc": s * 0.5})
                if s == 10:
                    threading.Timer(0.1, os.kill, (os.getpid(), getattr(signal, sys.argv[3]))).start()
                    ot.flush()
    except KeyboardInterrupt as err:  # SIGINT: raised in the loop's own line, or inside `flush()`?
        tb, names = err.__traceback__, []
        while tb is not None:
            names.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        print("raised through", " > ".join(names), flush=True)
        sys.exit(130)
""")


@pytest.mark.parametrize(("sig", "write_s"), [("SIGTERM", 0.5), ("SIGTERM", 2.5), ("SIGINT", 0.5)])
def test_a_signal_inside_otel_trains_own_waiting_is_handled_once_the_loop_leaves_it(tmp_path: Path, sig: str,
                                                                                   write_s: float) -> None:
    """SIGTERM while the loop waits inside `ot.flush()` (threading's and otel-train's code, which may hold a lock
    the hand-off needs): it is acted on at the loop's next line of its own code, as the default action would; when
    the loop stays inside longer than 1 s (a 2.5 s backend write), the hand-off runs without it and the process
    then ends by the signal all the same. SIGINT's `KeyboardInterrupt` is raised in the loop's own line."""
    proc = subprocess.run([sys.executable, "-c", _IN_FLUSH, str(tmp_path), str(write_s), sig], capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, "OTEL_TRAIN_EXPORT_PROCESS": "off"})
    if sig == "SIGINT":
        # raised from the trace hook on the loop's line (`local`), not from inside `flush()`'s wait
        assert proc.returncode == 130, proc.stderr[-3000:]
        assert proc.stdout.startswith("raised through <module> > local > "), proc.stdout
        assert "flush" not in proc.stdout and "wait" not in proc.stdout, proc.stdout
    else:
        assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    from faultkit import jsonl_points

    points = jsonl_points(tmp_path, "f")
    last = landed_prefix([list(p) for p in points])
    assert last == 10  # acted on at the loop's next line after `flush()` returned: no later step ran
    assert sorted(points) == sorted(expected(range(last + 1)))
